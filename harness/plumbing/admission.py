"""Memory admission for compiles: never start compiles together that would not fit in memory.

An LSTM step's XNNPACK lowering peaks at ~4.3 GB; two xdist workers, or two shells, starting
several of them at once can push a small CI machine into the OOM killer, which would then kill a
job that had nothing to do with it. So every compile asks for admission with the peak memory
that the same (step, backend) needed last time (recorded in the cache's ledger), and waits until
the machine's available memory, minus what admitted jobs have reserved and not yet released,
covers it. A compile never seen before asks for nothing and is recorded when it finishes.

Reservations are files under `<cache>/admission/` named by pid, so a reservation of a process that
died is ignored; the decision is taken under a file lock, so two processes cannot both take the
same free memory.
"""
from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator

from . import cache
from .files import atomic_write_json

LEDGER = "peaks.json"


def available_mb() -> float:
    """MemAvailable of /proc/meminfo (what the kernel says can be allocated without swapping)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("inf")  # not Linux: no admission control


def _root() -> Path:
    path = cache.cache_dir() / "admission"
    path.mkdir(parents=True, exist_ok=True)
    return path


def recorded_peak_mb(key: str) -> float:
    """The largest peak RSS recorded for `key` (e.g. "compile/xnnpack/f0n"); 0 when never seen."""
    try:
        return float(json.loads((_root() / LEDGER).read_text()).get(key, 0.0))
    except (OSError, ValueError):
        return 0.0


def record_peak_mb(key: str, peak_mb: float | None) -> None:
    if not peak_mb:
        return
    with cache.lock(_root() / LEDGER):
        try:
            ledger = json.loads((_root() / LEDGER).read_text())
        except (OSError, ValueError):
            ledger = {}
        ledger[key] = max(float(ledger.get(key, 0.0)), float(peak_mb))
        atomic_write_json(_root() / LEDGER, ledger)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reserved_mb() -> float:
    """Memory reserved by admitted jobs of live processes (stale reservations are removed)."""
    total = 0.0
    for p in _root().glob("*.reservation"):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if _alive(int(r["pid"])):
            total += float(r["mb"])
        else:
            p.unlink(missing_ok=True)
    return total


@contextlib.contextmanager
def admitted(key: str, poll_s: float = 2.0, available: Callable[[], float] = available_mb,
             on_wait: Callable[[float, float], None] | None = None) -> Iterator[float]:
    """Hold a reservation of the recorded peak of `key` while the body runs. Waits while the
    available memory minus other reservations is below it, except when nothing else is reserved
    (a job larger than the machine still runs alone rather than never). Yields seconds waited."""
    need = recorded_peak_mb(key)
    start = time.monotonic()
    ticket = _root() / f"{os.getpid()}-{uuid.uuid4().hex[:8]}.reservation"
    while True:
        with cache.lock(_root() / "decide"):
            others = reserved_mb()
            if need <= 0 or others == 0 or available() - others >= need:
                atomic_write_json(ticket, {"pid": os.getpid(), "mb": need, "key": key})
                break
        if on_wait:
            on_wait(need, available() - others)
        time.sleep(poll_s)
    try:
        yield time.monotonic() - start
    finally:
        ticket.unlink(missing_ok=True)
