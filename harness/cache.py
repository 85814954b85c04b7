"""The content-addressed cache: rebuilt weights, traces, exported programs, compiled artifacts.

Entries are directories named by `files.content_key(...)` of everything that changes them, written
to a temporary sibling and renamed into place, under a file lock so that concurrent writers (xdist
workers, two shells) never see half an entry. Safe to delete at any time.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

CACHE_ENV = "KOKORO_PARITY_CACHE"


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if not root:
        from platformdirs import user_cache_dir

        root = user_cache_dir("kokoro-parity")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        yield


def entry(kind: str, key: str) -> Path:
    return cache_dir() / kind / key


def get_or_build(kind: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Return (entry directory, hit). On a miss `build(tmpdir)` fills a temp dir that is renamed in.

    `build` may raise; then nothing is cached and the error propagates.
    """
    final = entry(kind, key)
    if (final / ".complete").exists():
        return final, True
    with lock(final):
        if (final / ".complete").exists():
            return final, True
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=final.parent))
        try:
            build(tmp)
            (tmp / ".complete").write_text("ok\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final, False


def size_bytes() -> int:
    return sum(p.stat().st_size for p in cache_dir().rglob("*") if p.is_file())


def clear() -> None:
    root = cache_dir()
    for child in root.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
