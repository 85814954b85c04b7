"""Forward hooks that are removed whatever the forward pass does.

Three passes put hooks on a step's modules for one run (the float16 audit, the modules a step
calls, the references at a port's module boundaries); a hook left behind by a forward that raised
would fire in every later run of the shared model. Imports nothing: the handles come from torch.
"""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator


@contextlib.contextmanager
def registered(handles: Iterable) -> Iterator[list]:
    """`with registered(sub.register_forward_hook(f) for sub in ...):` removes them on exit."""
    handles = list(handles)
    try:
        yield handles
    finally:
        for h in handles:
            h.remove()
