"""A TVM Relax shared library: built for `llvm` and run on the Relax VM.

A leaf (nothing of the harness): the `tvm` backend builds and runs its artifact with it, the
prebuilt backend runs a user's `.so` with it, and neither imports the other."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
tvm = deferred_import("tvm")
relax = deferred_import("tvm.relax")

TARGET = "llvm"


def build_library(mod, out_path: Path) -> None:
    """relax.build for the llvm target, exported as a shared library (needs a C compiler)."""
    with tvm.transform.PassContext(opt_level=3):
        executable = relax.build(mod, target=TARGET)
    executable.export_library(str(out_path))


def run_library(path: Path, inputs: list) -> list:
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(path)), tvm.cpu())
    args = [tvm.runtime.tensor(np.ascontiguousarray(t.detach().cpu().numpy())) for t in inputs]
    out = vm["main"](*args)
    return [torch.from_numpy(np.array(o.numpy())) for o in _flatten(out)]


def _flatten(value) -> list:
    if hasattr(value, "numpy"):
        return [value]
    out = []
    for v in value:
        out.extend(_flatten(v))
    return out
