"""Give the heap's freed pages back to the system after each item.

A long run (a test suite's worker, `make parity` with its items in one process) frees most of what an
item allocated (traces, copies of the model, exported graphs), but glibc's malloc keeps the freed
pages of its arenas, so the process's resident size only grows: two test workers reached 9.3 and
9.8 GB and the kernel killed one (docs/performance.md). `malloc_trim(0)` returns them in well under
a millisecond. A no-op where the C library is not glibc."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return None


def return_freed_memory() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
