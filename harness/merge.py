"""Shards' report dirs joined into one, losing nothing: records, work counts, and every file an
item produced (WAVs, run directories with their inputs, outputs and logs, repro bundles, bisection
probes), so that the history entry and the dashboard made from the merged dir equal those of a
single run.

A shard's tree is copied as it is, except what is made from the records (`history`, `dashboard`,
`junit`: rebuilt from the merged dir) and `records`/`counts` (checked and rewritten), and the
leftovers of an item a shard was killed in (`runs/<item>`, `audio/<item>`, `repro/<item>` without its
record) when another shard, the resumed run, has that item's record: those are dropped and reported.
With `later_wins` an item in several shards (a re-run of a failed or stale item) comes from the last
shard given, and the earlier shards' record and per-item files of it are left out. Records name
files by paths relative to their report dir (audio) or as they were when written (a repro bundle's
`reports/shard-1/repro/<item>` on the CI runner): every string of a record that names a file of its
shard by a path's tail is rewritten relative to the merged dir, so links resolve after the move.
"""
from __future__ import annotations

import filecmp
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from .history import MANIFEST, HistoryError, _check_record, item_id, item_seconds, work_counts
from .plumbing.files import atomic_write, atomic_write_json
from .plumbing.errors import UsageError

DERIVED = ("history", "dashboard", "junit")  # made from the records: never merged, rebuilt from the result
OWN = ("records", "counts")  # merged by meaning, not copied
PER_ITEM = ("runs", "audio", "repro")  # top directories whose children are named by item id


@dataclass
class Shard:
    path: Path
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # record file name -> record
    files: list[str] = field(default_factory=list)  # POSIX paths relative to the shard, copied as they are
    counts: dict[str, int] = field(default_factory=dict)  # the sum of its processes' work counts
    empty_dirs: list[str] = field(default_factory=list)  # e.g. a bisection probe's directory that kept nothing

    def summary(self) -> dict[str, Any]:
        return {"path": str(self.path), "records": len(self.records), "files": len(self.files),
                "counts": self.counts, "item_seconds": round(sum(item_seconds(r) for r in self.records.values()), 3)}


@dataclass
class MergeResult:
    out: Path
    shards: list[Shard]
    dropped: dict[str, list[str]] = field(default_factory=dict)  # shard path -> items' leftovers not copied
    superseded: dict[str, list[str]] = field(default_factory=dict)  # shard path -> items a later shard re-ran

    @property
    def n_records(self) -> int:
        return sum(len(s.records) for s in self.shards)

    @property
    def n_files(self) -> int:
        return sum(len(s.files) for s in self.shards)


def read_shard(path: str | Path) -> Shard:
    """A shard's records (validated), its other files and its summed counts; errors name the file."""
    path = Path(path)
    if not (path / "records").is_dir():
        raise FileNotFoundError(f"{path}: not a report dir (no records/ directory)")
    shard = Shard(path)
    for p in sorted((path / "records").glob("*.json")):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
            _check_record(rec, 0)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, HistoryError) as e:
            raise UsageError(f"{p}: not a record: {e}") from None
        shard.records[p.name] = rec
    if not shard.records:
        raise FileNotFoundError(f"{path / 'records'}: no records")
    for p in sorted((path / "counts").glob("*.json")):
        try:
            for k, v in json.loads(p.read_text(encoding="utf-8")).items():
                shard.counts[k] = shard.counts.get(k, 0) + int(v)
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise UsageError(f"{p}: not a counts file: {e}") from None
    if not shard.counts:  # its processes wrote none (`kokoro-parity run`): what its records show
        shard.counts = work_counts(shard.records.values())
    mine = [p for p in path.rglob("*") if p.relative_to(path).parts[0] not in (*DERIVED, *OWN, MANIFEST)]
    shard.files = sorted(p.relative_to(path).as_posix() for p in mine if p.is_file())
    shard.empty_dirs = sorted(p.relative_to(path).as_posix() for p in mine if p.is_dir() and not any(p.iterdir()))
    return shard


def relocate(value: Any, files: set[str]) -> Any:
    """`value` (a record or part of one) with every string that names one of `files` (or a
    directory holding them) by a path whose tail is that file's path rewritten to the tail alone."""
    if isinstance(value, dict):
        return {k: relocate(v, files) for k, v in value.items()}
    if isinstance(value, list):
        return [relocate(v, files) for v in value]
    if not isinstance(value, str) or "/" not in value or "\n" in value or len(value) > 4096:
        return value
    parts = PurePath(value).parts
    for i in range(len(parts) - 1):  # the longest tail first; at least two parts (`repro/<item>`)
        tail = PurePath(*parts[i:]).as_posix()
        if tail in files:
            return tail
    return value


def _dirs_of(files: list[str]) -> set[str]:
    out = set(files)
    for f in files:
        parts = PurePath(f).parts
        out.update(PurePath(*parts[:i]).as_posix() for i in range(2, len(parts)))
    return out


def _copy(src: Path, dst: Path) -> None:
    def write(f):
        with open(src, "rb") as s:
            shutil.copyfileobj(s, f)

    atomic_write(dst, write)
    shutil.copystat(src, dst)


def merge_shards(shard_dirs: list[str | Path], out: str | Path, later_wins: bool = False) -> MergeResult:
    """Join the shards' report dirs into `out`. Raises ValueError when an item is in two shards
    (unless `later_wins`: then the item is taken from the last shard given, a re-run, and the
    earlier shards' record and per-item files of it are left out and reported), a file is in two
    shards with different contents, or `out` already holds records or counts of another run (they
    would be summed into this one); nothing is written then. Every shard's work counts are summed,
    a superseded run's included: that work was done."""
    out = Path(out)
    shards = [read_shard(d) for d in shard_dirs]
    owner: dict[str, Shard] = {}  # item id -> the shard it comes from
    superseded: dict[str, list[str]] = {}
    for shard in shards:
        for rec in shard.records.values():  # only an earlier shard loses a record here
            iid = item_id(rec)
            if iid in owner:
                if not later_wins:
                    raise UsageError(f"item {iid} is in two shards ({owner[iid].path} and {shard.path}); "
                                     f"--later-wins takes it from the later one")
                earlier = owner[iid]
                del earlier.records[next(n for n, r in earlier.records.items() if item_id(r) == iid)]
                superseded.setdefault(str(earlier.path), []).append(iid)
            owner[iid] = shard
    dropped = _drop_superseded_leftovers(shards, set(owner))
    dropped = {path: kept for path, items in dropped.items()
               if (kept := [i for i in items if i not in superseded.get(path, [])])}
    files: dict[str, Shard] = {}
    for shard in shards:
        for rel in shard.files:
            first = files.setdefault(rel, shard)
            if first is not shard and not filecmp.cmp(first.path / rel, shard.path / rel, shallow=False):
                raise UsageError(f"{rel} differs between shards {first.path} and {shard.path}")
    names = _count_names(shards)
    for sub, mine in (("records", {n for s in shards for n in s.records}), ("counts", {f"{n}.json" for n in names})):
        stale = sorted(p.name for p in (out / sub).glob("*.json") if p.name not in mine)
        if stale:
            raise UsageError(f"{out / sub} already holds {', '.join(stale[:5])}{' ...' if len(stale) > 5 else ''} "
                             f"from another run: merge into an empty directory, or remove them")
    for rel, shard in files.items():
        _copy(shard.path / rel, out / rel)
    for shard in shards:
        for rel in shard.empty_dirs:
            (out / rel).mkdir(parents=True, exist_ok=True)
    for shard, name in zip(shards, names):
        known = _dirs_of(shard.files)
        for fname, rec in shard.records.items():
            atomic_write_json(out / "records" / fname, relocate(rec, known))
        atomic_write_json(out / "counts" / f"{name}.json", shard.counts)
    atomic_write_json(out / MANIFEST, {"shards": [s.summary() for s in shards], "dropped": dropped,
                                       "superseded": superseded})
    return MergeResult(out, shards, dropped, superseded)


def _drop_superseded_leftovers(shards: list[Shard], finished: set[str]) -> dict[str, list[str]]:
    """Take out of each shard's files the per-item directories of items it holds no record of but
    another shard does: a shard killed mid-item leaves them, and its resumed run re-ran that item.
    Leftovers of an item no shard finished are kept (the only trace of a crash or a kill)."""
    dropped: dict[str, list[str]] = {}
    for shard in shards:
        own = {item_id(rec) for rec in shard.records.values()}

        def superseded(rel: str) -> bool:  # a file or directory in runs/<item>, audio/<item>, repro/<item>
            parts = PurePath(rel).parts
            return len(parts) >= 2 and parts[0] in PER_ITEM and parts[1] not in own and parts[1] in finished

        gone = [rel for rel in shard.files if superseded(rel)]
        if gone:
            shard.files = [rel for rel in shard.files if not superseded(rel)]
            shard.empty_dirs = [rel for rel in shard.empty_dirs if not superseded(rel)]
            dropped[str(shard.path)] = sorted({PurePath(rel).parts[1] for rel in gone})
    return dropped


def _count_names(shards: list[Shard]) -> list[str]:
    """One counts file name per shard: its directory's name, numbered when two share one."""
    names = [s.path.resolve().name or "shard" for s in shards]
    return [n if names.count(n) == 1 else f"{n}-{i + 1}" for i, n in enumerate(names)]
