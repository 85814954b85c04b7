"""The one place that writes files and names content.

Golden files, caches and reports are written atomically (temp file in the same directory, fsync,
rename), so a run that is killed half way never leaves a truncated file that a later run trusts.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np
from .deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
torch = deferred_import("torch")

_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write(path: str | os.PathLike, write: Callable[[io.BufferedWriter], Any]) -> Path:
    """Call `write(f)` on a temporary file beside `path`, then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes 0600; give the file the mode open() would
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()


def content_key(*parts: Any) -> str:
    """The one function that makes cache keys: a short sha256 of a canonical JSON of `parts`."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def tensors_digest(values: dict) -> str:
    """sha256 of named tensors' names, dtypes, shapes and bytes: the inputs' part of a cache key."""
    h = hashlib.sha256()
    for k in sorted(values):
        t = values[k].detach().contiguous().cpu()
        h.update(f"{k}:{t.dtype}:{list(t.shape)}".encode())
        h.update(t.numpy().tobytes() if t.dtype != torch.bool else t.to(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def canonical(t):
    """A copy of `t` with the standard (row-major) strides, also along size-1 axes.

    torch calls a [1, N, 1] tensor with strides (1, 1, N) contiguous (a size-1 axis's stride never
    matters to it), so `.contiguous()` returns it as it is; ExecuTorch derives a dim order from the
    strides and then rejects an op whose inputs' dim orders differ ("3 input tensors have different
    dim orders", XNNPACK: "Propagating input shapes failed"). Every tensor a job receives is made
    canonical here."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t) if t.stride() != _row_major(t.shape) else t


def _row_major(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def save_tensors(path: str | os.PathLike, tensors) -> Path:
    """Save a list (or the values of a dict) of tensors atomically, each with canonical strides:
    the inputs file of an export, compile or run job."""
    values = list(tensors.values()) if isinstance(tensors, dict) else list(tensors)
    return atomic_write(path, lambda f: torch.save([canonical(t) for t in values], f))


def save_arrays(path: str | os.PathLike, arrays) -> Path:
    """Save a list of numpy arrays atomically as an uncompressed .npz (`a0`, `a1`, ... in order):
    the inputs file of a job that must not import torch (harness.backends.onnx_child)."""
    return atomic_write(path, lambda f: np.savez(f, **{f"a{i}": np.ascontiguousarray(a)
                                                       for i, a in enumerate(arrays)}))


def load_arrays(path: str | os.PathLike) -> list:
    """The arrays save_arrays wrote, in order."""
    with np.load(path, allow_pickle=False) as z:
        return [z[f"a{i}"] for i in range(len(z.files))]


_FILE_DIGESTS: dict[tuple, str] = {}


def sha256_file_cached(path: str | os.PathLike) -> str:
    """sha256_file, memoized per (path, size, mtime_ns) in this process: a port run keys the same
    artifact at every stage run and would otherwise re-read the whole file each time."""
    st = os.stat(path)
    stamp = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if stamp not in _FILE_DIGESTS:
        _FILE_DIGESTS[stamp] = sha256_file(path)
    return _FILE_DIGESTS[stamp]


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file below a directory (an .mlpackage, a TVM export)."""
    path = Path(path)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
