"""A module named at the top of the module that uses it and imported at its first use.

For the optional runtimes (executorch, tvm, coremltools, playwright, mlx, the dashboard's
libraries) and for kokoro's slow import: the module's dependencies read at its top like imports,
while the import waits for the first attribute read, so a missing extra stays the backend's skip
(its `available()` says which extra) and `--help` or a warm run load nothing they do not use.
tests/unit/test_layering.py holds these names to the import contracts of pyproject.toml.
"""
from __future__ import annotations

import importlib


class DeferredModule:
    """`name`'s attributes, the module imported on the first read (sys.modules caches it after)."""

    __slots__ = ("_name",)

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


def deferred_import(name: str) -> DeferredModule:
    return DeferredModule(name)
