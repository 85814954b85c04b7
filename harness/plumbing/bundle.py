"""The one writer of repro bundles: a localized op (bisection), an ONNX stage's subgraph, a rewrite's
module, an upstream defect's minimal program.

One layout, whatever wrote it: the minimal program or subgraph, its inputs, the float64 expected
output, `repro.py` (exit 1 reproduced, 0 fixed, 2 cannot run here), `meta.json` (what the bundle is
about, as data) and `REPORT.md` (the same for a person, as a runtime's tracker asks). The directory
is written beside its place and renamed into it, so a bundle is whole or absent: a localization that
crashes half-way never leaves a repro.py beside the inputs of another run.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable, Iterator, Union

# a file's content: text, bytes, a file to copy, or a function that writes the file at the path it is given
Content = Union[str, bytes, Path, Callable[[Path], None]]


@contextlib.contextmanager
def partial_bundle(out: Path) -> Iterator[Path]:
    """A directory to write a bundle into, renamed to `out` (replacing it) when the block ends
    without an exception, removed when it raises: the last whole bundle stays."""
    out = Path(out)
    tmp = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        for p in tmp.rglob("*"):
            if p.is_file():
                p.chmod(0o644)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_bundle_dir(out: Path, files: dict[str, Content], meta: dict | None = None) -> Path:
    """Write `files` (and `meta.json` from `meta`) to the directory `out`, replacing what was there."""
    with partial_bundle(out) as tmp:
        for name, content in files.items():
            _write(tmp / name, content)
        if meta is not None:
            write_meta(tmp, meta)
    return Path(out)


def write_meta(directory: Path, meta: dict) -> None:
    (Path(directory) / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")


def _write(path: Path, content: Content) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)  # a bundle's own folders (a page's `ort/`)
    if isinstance(content, str):
        path.write_text(content)
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, Path):
        shutil.copyfile(content, path)
    else:
        content(path)


def bundle_info(out: Path) -> dict:
    """The record's view of a written bundle: where, its files and their bytes."""
    files = sorted(p for p in Path(out).iterdir() if p.is_file())
    return {"path": str(out), "files": [p.name for p in files], "bytes": sum(p.stat().st_size for p in files)}
