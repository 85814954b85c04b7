"""Backends that fail the hard way on purpose, to prove that an item's crash or hang is its outcome
and the run goes on (tests/unit/test_backends.py)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from . import InterpreterBackend


class SegfaultBackend(InterpreterBackend):
    name = "example-segfault"
    description = "dies with SIGSEGV while compiling"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        os.kill(os.getpid(), signal.SIGSEGV)
        return {}


class HangBackend(InterpreterBackend):
    name = "example-hang"
    description = "never finishes compiling"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        time.sleep(3600)
        return {}
