"""The content-addressed cache: rebuilt weights, traces, exported programs, compiled artifacts, runs.

Entries are directories named by `files.content_key(...)` of everything that changes them, written
to a temporary sibling and renamed into place, under a file lock so that concurrent writers (xdist
workers, two shells) never see half an entry. Safe to delete at any time.

The cache is bounded (default 40 GiB, `KOKORO_PARITY_CACHE_MAX_GB`): a hit touches its entry's
`.complete`, and each new entry prunes the least recently used ones until the cache fits:
unbounded, a backend matrix, which writes a program and an artifact per item, fills a 250 GB
disk. Entries used in the last hour are never pruned, since another
process may be about to read them; the rebuilt weights and the admission ledger are not entries.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator
from .errors import UsageError
from .deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
filelock = deferred_import("filelock")
platformdirs = deferred_import("platformdirs")

CACHE_ENV = "KOKORO_PARITY_CACHE"
MAX_GB_ENV = "KOKORO_PARITY_CACHE_MAX_GB"
DEFAULT_MAX_GB = 40.0
KINDS = ("traces", "variants", "synthesizer", "programs", "artifacts", "bisect", "runs")  # prunable
RECENT_S = 3600.0  # an entry used this recently may be in use by another process


def cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    if not root:
        root = platformdirs.user_cache_dir("kokoro-parity")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(path) + ".lock"):
        yield


def entry(kind: str, key: str) -> Path:
    return cache_dir() / kind / key


def lookup(kind: str, key: str) -> Path | None:
    """The complete entry, marked as just used (its `.complete` is touched), or None."""
    marker = entry(kind, key) / ".complete"
    try:
        os.utime(marker)
    except FileNotFoundError:
        return None
    return marker.parent


def get_or_build(kind: str, key: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
    """Return (entry directory, hit). On a miss `build(tmpdir)` fills a temp dir that is renamed in,
    and then the cache is pruned to its size limit.

    `build` may raise; then nothing is cached and the error propagates.
    """
    final = entry(kind, key)
    if lookup(kind, key):
        return final, True
    with lock(final):
        if lookup(kind, key):
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
    prune()
    return final, False


def _tree_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except FileNotFoundError:  # removed by another process meanwhile
            pass
    return total


def size_bytes() -> int:
    return _tree_bytes(cache_dir())


def sizes_by_kind() -> dict[str, int]:
    root = cache_dir()
    return {child.name: _tree_bytes(child) for child in sorted(root.iterdir()) if child.is_dir()}


def max_bytes() -> int:
    raw = os.environ.get(MAX_GB_ENV, "")
    try:
        gb = float(raw) if raw else DEFAULT_MAX_GB
    except ValueError:
        raise UsageError(f"{MAX_GB_ENV}={raw!r}: expected a number of GiB") from None
    return int(gb * 2**30)


@dataclass
class Pruned:
    removed: list[Path]
    freed_bytes: int
    size_bytes: int  # what is left
    limit_bytes: int


def prune(limit_bytes: int | None = None, recent_s: float = RECENT_S) -> Pruned:
    """Remove least recently used entries until the cache holds at most `limit_bytes`.

    Also removes leftovers of builds that died (temporary `.KEY.*` directories) once they are older
    than `recent_s`. An entry somebody is building or removing (its lock is held) is skipped.
    """
    limit = max_bytes() if limit_bytes is None else limit_bytes
    now = time.time()
    root = cache_dir()
    candidates: list[tuple[float, Path]] = []  # (last use, entry)
    removed: list[Path] = []
    start = total = size_bytes()

    def remove(path: Path, lock_path: Path) -> int:
        """Bytes freed, or 0 when somebody holds the lock (building or removing it)."""
        try:
            with filelock.FileLock(str(lock_path), timeout=0):
                size = _tree_bytes(path)
                shutil.rmtree(path, ignore_errors=True)
        except filelock.Timeout:
            return 0
        removed.append(path)
        return size

    for kind in KINDS:
        folder = root / kind
        if not folder.is_dir():
            continue
        for child in folder.iterdir():
            if not child.is_dir():
                continue
            try:
                used = (child / ".complete").stat().st_mtime
            except FileNotFoundError:  # an unfinished build (`.KEY.xxxx`): a leftover once old and unlocked
                if child.name.startswith(".") and now - child.stat().st_mtime > recent_s:
                    total -= remove(child, folder / (child.name[1:].split(".")[0] + ".lock"))
                continue
            if now - used > recent_s:
                candidates.append((used, child))
    for _used, child in sorted(candidates):
        if total <= limit:
            break
        total -= remove(child, Path(str(child) + ".lock"))
    return Pruned(removed, start - total, total, limit)


def clear() -> None:
    root = cache_dir()
    for child in root.iterdir():
        if child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)
