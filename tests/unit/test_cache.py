"""The cache's size limit: least recently used entries go first, recent and locked ones stay."""
from __future__ import annotations

import os
import time

import pytest

from harness.plumbing import cache


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def make_entry(kind: str, key: str, size: int, used_ago_s: float):
    def build(tmp):
        (tmp / "blob").write_bytes(b"x" * size)

    path, hit = cache.get_or_build(kind, key, build)
    assert not hit
    then = time.time() - used_ago_s
    os.utime(path / ".complete", (then, then))
    return path


def test_prune_removes_least_recently_used_first_until_under_the_limit(cache_root):
    old = make_entry("programs", "old", 1000, used_ago_s=5 * 3600)
    middle = make_entry("artifacts", "middle", 1000, used_ago_s=3 * 3600)
    new = make_entry("artifacts", "new", 1000, used_ago_s=2 * 3600)
    result = cache.prune(limit_bytes=2100)
    assert result.removed == [old]
    assert not old.exists() and middle.exists() and new.exists()
    assert result.size_bytes <= 2100


def test_a_hit_marks_the_entry_as_used(cache_root):
    a = make_entry("programs", "a", 1000, used_ago_s=5 * 3600)
    b = make_entry("programs", "b", 1000, used_ago_s=4 * 3600)
    os.utime(a / ".complete", (time.time() - 2 * 3600,) * 2)  # pretend a was hit after b
    assert cache.lookup("programs", "a") == a
    cache.prune(limit_bytes=1100)
    assert a.exists() and not b.exists()
    assert cache.lookup("programs", "b") is None


def test_recent_and_locked_entries_are_never_pruned(cache_root):
    from filelock import FileLock

    recent = make_entry("programs", "recent", 1000, used_ago_s=60)
    locked = make_entry("programs", "locked", 1000, used_ago_s=5 * 3600)
    with FileLock(str(locked) + ".lock"):
        result = cache.prune(limit_bytes=0)
    assert recent.exists() and locked.exists() and result.removed == []


def test_a_new_entry_prunes_to_the_configured_limit(cache_root, monkeypatch):
    old = make_entry("programs", "old", 4000, used_ago_s=5 * 3600)
    monkeypatch.setenv(cache.MAX_GB_ENV, str(5000 / 2**30))
    make_entry("programs", "new", 2000, used_ago_s=0)
    assert not old.exists()


def test_leftovers_of_dead_builds_are_removed_once_old(cache_root):
    leftover = cache_root / "artifacts" / ".key.abc"
    leftover.mkdir(parents=True)
    (leftover / "half.pte").write_bytes(b"x" * 10)
    then = time.time() - 2 * 3600
    os.utime(leftover, (then, then))
    from filelock import FileLock

    with FileLock(str(cache_root / "artifacts" / "key.lock")):  # its build still runs
        assert cache.prune(limit_bytes=10**9).removed == []
    assert leftover in cache.prune(limit_bytes=10**9).removed
    assert not leftover.exists()


def test_a_bad_limit_names_the_variable(cache_root, monkeypatch):
    monkeypatch.setenv(cache.MAX_GB_ENV, "lots")
    with pytest.raises(ValueError, match="KOKORO_PARITY_CACHE_MAX_GB"):
        cache.max_bytes()
