"""Rewrites of Kokoro in another framework, judged module by module (`--rewrite NAME|ADAPTER.py`).

- `adapter`: the interface (which Kokoro modules a rewrite maps, how each is called, how the
  rewrite loads a Kokoro checkpoint) and the check of its module paths;
- `mlx_audio`: mlx-audio's MLX Kokoro, the first adapter (`mlx_call`: how it calls a module, with
  mlx and numpy only, the file its repro bundles ship);
- `captures`: each mapped module's float64 inputs and output and its float32 floor;
- `repro`: the first failing module's standalone repro bundle;
- `item`: `RewriteItem`, one more kind of item of harness.pipeline.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from .adapter import Adapter, Mapped, RewriteError, resolve_modules
from .item import RewriteItem

BUILTIN = {"mlx-audio": "harness.rewrite.mlx_audio"}


def load_adapter(spec: str) -> Adapter:
    """A built-in adapter by name (`mlx-audio`), or the `ADAPTER` of a Python file by path; one
    RewriteError naming the file and the field otherwise."""
    if spec in BUILTIN:
        return importlib.import_module(BUILTIN[spec]).ADAPTER
    path = Path(spec)
    if path.suffix != ".py" or not path.is_file():
        raise RewriteError(f"--rewrite {spec}: neither a built-in rewrite ({', '.join(BUILTIN)}) nor a Python file")
    module_spec = importlib.util.spec_from_file_location(f"kokoro_parity_rewrite_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - the user's file: its error, named
        raise RewriteError(f"{path}: importing it raised {type(e).__name__}: {e}") from None
    adapter = getattr(module, "ADAPTER", None)
    if not isinstance(adapter, Adapter):
        raise RewriteError(f"{path}: field 'ADAPTER': an instance of harness.rewrite.adapter.Adapter, "
                           f"got {type(adapter).__name__}")
    return adapter


def rewrite_items(session, specs: list[str]) -> list[RewriteItem]:
    """One item per (case, rewrite); an adapter that does not load or maps a module Kokoro does
    not have gives items that report its error instead of stopping the run. No rewrite asked: no
    model loaded for it."""
    if not specs:
        return []
    paths = tuple(p for p, _ in session.model.kmodel.named_modules() if p)
    items = []
    for spec in specs:
        adapter, mapped, error = None, (), ""
        try:
            adapter = load_adapter(spec)
            mapped = tuple(resolve_modules(adapter, paths, spec))
        except RewriteError as e:
            error = str(e)
        items += [RewriteItem(c, spec, adapter, mapped, error) for c in session.cases]
    return items


__all__ = ["Adapter", "Mapped", "RewriteError", "RewriteItem", "load_adapter", "resolve_modules", "rewrite_items"]
