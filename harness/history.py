"""Runs and their history: one JSON file per run, comparison with earlier runs, JUnit XML.

A run file (schema `kokoro-parity/run/1`) holds the run's metadata (date, git commit, versions, the
machine, what was selected) and one record per item exactly as `Record.to_dict()` wrote it. Records
stay plain dicts here, so that fields added to records later (`bisect`, `repro_dir`, ...) travel
through the history and reach the dashboard without a schema change.

The file is rewritten atomically after every item with `complete: false`, and once more at the end:
a run that stops half way leaves a valid, readable (incomplete) entry. A history file that cannot be
read is reported as a `Problem` with its reason and skipped, never silently dropped.

JUnit XML is written with the standard library's ElementTree: the format is a few elements, and the
stdlib is as well kept as it gets.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import math
import os
import platform
import socket
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from . import __version__
from .backends import get_backend
from .plumbing.files import atomic_write_json, atomic_write_text
from .record import SCHEMA as RECORD_SCHEMA, SCHEMAS as RECORD_SCHEMAS, Record, _finite_json, item_id as record_item_id
from .upstream import check_bundles
from .verdict import Profile, Tolerance, Verdict
from .plumbing.errors import UsageError

SCHEMA = "kokoro-parity/run/1"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_FACTOR = 2.0
DEFAULT_METRICS = ("rel_l2", "floor_ratio")
# Verdicts from best to worst, by how far the item got through the pipeline. Skipped has no rank: a
# skip says nothing about the backend's numerics (see `compare`).
RANK = {Verdict.PASS.value: 0, Verdict.FAIL.value: 1, Verdict.RUN_ERROR.value: 2, Verdict.CRASHED.value: 2,
        Verdict.TIMEOUT.value: 2, Verdict.COMPILE_ERROR.value: 3, Verdict.EXPORT_ERROR.value: 4}
PACKAGES = ("torch", "kokoro", "numpy", "executorch", "onnxruntime", "onnx", "coremltools", "apache-tvm", "tvm")


class HistoryError(UsageError):
    """A run file that cannot be used; the message says why."""


def item_id(rec: dict[str, Any]) -> str:
    return record_item_id(rec["case"], rec["step"], rec["backend"], rec["mode"])


def as_float(v: Any) -> float:
    """Record metrics as floats: records write NaN/Inf as strings (strict JSON)."""
    if isinstance(v, bool) or v is None:
        return math.nan
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


# Timings that are work done for an item (any stage tag, e.g. `duration_stage.compile_s`); `run_s` is
# inside `run_job_s`, `compile_wait_s` is waiting for memory, not work.
WORK_TIMINGS = ("export_s", "compile_s", "run_job_s", "transport_s")


def item_seconds(rec: dict[str, Any]) -> float:
    """Seconds of work an item took: its export, compile and run jobs (every stage) and its
    bisection. What a merged entry sums, since the shards' wall clocks are not in their records."""
    t = sum(as_float(v) for k, v in (rec.get("timings") or {}).items() if k.endswith(WORK_TIMINGS))
    b = rec.get("bisect")
    t += as_float(b.get("seconds", 0)) if isinstance(b, dict) else 0.0
    return t if math.isfinite(t) else 0.0


def work_counts(records: Iterable[dict[str, Any]]) -> dict[str, int]:
    """Exports, compiles and runs as the records' timings show them (a job that ran has its
    seconds; a cache hit has none): the work of a report dir whose processes wrote no counts
    (`kokoro-parity run`), counted the way pytest's counts are."""
    out = {"exports": 0, "compiles": 0, "runs": 0}
    for rec in records:
        for k in rec.get("timings") or {}:
            for key, suffix in (("exports", "export_s"), ("compiles", "compile_s"), ("runs", "run_job_s")):
                out[key] += k.endswith(suffix)
    return out


# ----------------------------------------------------------------------------- one run

@dataclass
class Run:
    id: str
    date: str  # UTC start, ISO 8601
    records: list[dict[str, Any]] = field(default_factory=list)
    git: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    selection: dict[str, Any] = field(default_factory=dict)
    complete: bool = False
    finished: str = ""
    duration_s: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    regressions: list[dict[str, Any]] = field(default_factory=list)  # against earlier runs, when written
    error: str = ""  # why an incomplete run stopped, when known
    upstream: list[dict[str, Any]] = field(default_factory=list)  # harness.upstream: each bundle's repro status
    path: Path | None = None  # where it was read from (not written)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "id": self.id, "date": self.date, "finished": self.finished,
                "complete": self.complete, "duration_s": self.duration_s, "git": self.git,
                "versions": self.versions, "machine": self.machine, "selection": self.selection,
                "counts": self.counts, "error": self.error, "regressions": self.regressions,
                "upstream": self.upstream, "records": self.records}

    @classmethod
    def from_dict(cls, d: Any) -> "Run":
        if not isinstance(d, dict):
            raise HistoryError(f"expected a JSON object, got {type(d).__name__}")
        if d.get("schema") != SCHEMA:
            raise HistoryError(f"schema {d.get('schema')!r} is not {SCHEMA!r}")
        for key in ("id", "date", "records"):
            if key not in d:
                raise HistoryError(f"missing field {key!r}")
        if not isinstance(d["records"], list):
            raise HistoryError("field 'records' is not a list")
        for i, rec in enumerate(d["records"]):
            _check_record(rec, i)
        known = {k: d[k] for k in ("git", "versions", "machine", "selection", "complete", "finished", "duration_s",
                                   "counts", "regressions", "error", "upstream") if k in d}
        return cls(id=str(d["id"]), date=str(d["date"]), records=d["records"], **known)

    def by_item(self) -> dict[str, dict[str, Any]]:
        return {item_id(r): r for r in self.records}

    @property
    def filename(self) -> str:
        return f"{self.id}.json"

    @property
    def verdict_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.records:
            out[r["verdict"]] = out.get(r["verdict"], 0) + 1
        return out


def _check_record(rec: Any, i: int) -> None:
    if not isinstance(rec, dict):
        raise HistoryError(f"record {i} is not an object")
    if rec.get("schema") not in RECORD_SCHEMAS:
        raise HistoryError(f"record {i}: schema {rec.get('schema')!r} is not {RECORD_SCHEMA!r}")
    missing = [k for k in ("case", "step", "backend", "mode", "verdict") if k not in rec]
    if missing:
        raise HistoryError(f"record {i}: missing field(s) {', '.join(missing)}")
    try:
        Verdict(rec["verdict"])
    except ValueError:
        raise HistoryError(f"record {i} ({item_id(rec)}): unknown verdict {rec['verdict']!r}") from None


def write_run(directory: str | os.PathLike, run: Run) -> Path:
    path = atomic_write_json(Path(directory) / run.filename, run.to_dict())
    run.path = path
    return path


def read_run(path: str | os.PathLike) -> Run:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise HistoryError(f"cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise HistoryError(f"not valid JSON: {e}") from None
    run = Run.from_dict(data)
    run.path = path
    return run


# ----------------------------------------------------------------------------- the history

@dataclass(frozen=True)
class Problem:
    path: Path
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason} (skipped)"


@dataclass
class History:
    runs: list[Run]  # oldest first
    problems: list[Problem]

    @property
    def latest(self) -> Run | None:
        return self.runs[-1] if self.runs else None

    def baseline(self, index: int) -> dict[str, tuple[str, dict[str, Any]]]:
        """item id -> (run id, record) from the latest run before `runs[index]` that has the item."""
        out: dict[str, tuple[str, dict[str, Any]]] = {}
        for run in self.runs[:index]:
            for iid, rec in run.by_item().items():
                out[iid] = (run.id, rec)
        return out

    def regressions(self, factor: float = DEFAULT_FACTOR,
                    metrics: Iterable[str] = DEFAULT_METRICS) -> dict[str, list["Regression"]]:
        """run id -> its regressions against the runs before it."""
        return {run.id: compare(self.baseline(i), run.records, factor, metrics) for i, run in enumerate(self.runs)}


def load_history(directory: str | os.PathLike) -> History:
    """Every readable run under `directory`, oldest first, and a Problem for every file that is not."""
    directory = Path(directory)
    runs, problems = [], []
    if directory.is_dir():
        for path in sorted(directory.glob("*.json")):
            try:
                runs.append(read_run(path))
            except HistoryError as e:
                problems.append(Problem(path, str(e)))
    runs.sort(key=lambda r: (r.date, r.id))
    return History(runs, problems)


# ----------------------------------------------------------------------------- regressions

@dataclass(frozen=True)
class Regression:
    item: str
    kind: str  # verdict | metric | coverage
    what: str  # "verdict" or "<output>.<metric>"
    before: Any
    after: Any
    previous_run: str
    note: str = ""

    def __str__(self) -> str:
        if self.kind == "metric":
            grew = self.after / self.before if isinstance(self.after, float) and self.before else math.nan
            change = f"{_num(self.before)} -> {_num(self.after)}" + (f" (x{grew:.3g})" if math.isfinite(grew) else "")
        else:
            change = f"{self.before} -> {self.after}"
        return f"{self.item}: {self.what} {change} (vs run {self.previous_run})" + (f"; {self.note}" if self.note else "")

    def to_dict(self) -> dict[str, Any]:
        return _finite_json({"item": self.item, "kind": self.kind, "what": self.what, "before": self.before,
                             "after": self.after, "previous_run": self.previous_run, "note": self.note,
                             "message": str(self)})


def _num(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def compare(baseline: dict[str, tuple[str, dict[str, Any]]], records: Iterable[dict[str, Any]],
            factor: float = DEFAULT_FACTOR, metrics: Iterable[str] = DEFAULT_METRICS) -> list[Regression]:
    """Regressions of `records` against `baseline` (item id -> (run id, record)).

    - verdict: the verdict got worse (RANK), e.g. pass -> fail or fail -> compile_error;
    - coverage: an item that ran before is now skipped (with the skip's reason);
    - metric: an error metric of an output grew by more than `factor`, or became NaN.
    Items without an earlier record, or skipped before, have nothing to regress from.
    """
    if factor <= 1:
        raise UsageError(f"regression factor must be > 1, got {factor}")
    metrics = tuple(metrics)
    out: list[Regression] = []
    for rec in records:
        iid = item_id(rec)
        if iid not in baseline:
            continue
        prev_run, prev = baseline[iid]
        note = ""
        if prev.get("model", {}).get("digest") != rec.get("model", {}).get("digest"):
            note = f"model changed: {prev.get('model', {}).get('digest')} -> {rec.get('model', {}).get('digest')}"
        before, after = prev["verdict"], rec["verdict"]
        if before == Verdict.SKIPPED.value:
            continue
        if after == Verdict.SKIPPED.value:
            out.append(Regression(iid, "coverage", "verdict", before, f"skipped ({rec.get('reason', '')})", prev_run,
                                  note))
            continue
        if RANK.get(after, 2) > RANK.get(before, 2):  # a verdict added later counts as an error
            out.append(Regression(iid, "verdict", "verdict", before, after, prev_run, note))
        for output, m in rec.get("metrics", {}).items():
            pm = prev.get("metrics", {}).get(output)
            if not pm:
                continue
            for key in metrics:
                if key not in m or key not in pm:
                    continue
                a, b = as_float(pm[key]), as_float(m[key])
                if not math.isfinite(a):
                    continue
                if math.isnan(b) or b > factor * a and b > a:
                    out.append(Regression(iid, "metric", f"{output}.{key}", a, b, prev_run, note))
    return out


# ----------------------------------------------------------------------------- run metadata

def git_info(repo: Path = REPO) -> dict[str, Any]:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              timeout=30).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError) as e:
        return {"commit": "unknown", "error": str(e).splitlines()[0] if str(e) else type(e).__name__}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(),
                            "arch": platform.machine(), "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    try:
        info["memory_gib"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return info


def version_info(backends: Iterable[str] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {"harness": __version__, "python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    out["backends"] = {}
    for b in backends:
        try:
            out["backends"][b] = get_backend(b).version()
        except KeyError as e:  # the run will say so, item by item
            out["backends"][b] = f"unknown ({e})"
    return out


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def new_run(history_dir: Path, selection: dict[str, Any], backends: Iterable[str]) -> Run:
    date = utc_now()
    git = git_info()
    base = date.replace("-", "").replace(":", "") + "-" + str(git.get("commit", "unknown"))[:8]
    run_id, n = base, 1
    while (Path(history_dir) / f"{run_id}.json").exists():
        n += 1
        run_id = f"{base}-{n}"
    return Run(id=run_id, date=date, git=git, versions=version_info(backends), machine=machine_info(),
               selection=selection)


def profile_dict(profile) -> dict[str, Any]:
    """The tolerance profile a run was judged with, so that pages show the thresholds it used."""
    return {"default": dict(vars(profile.default)),
            "overrides": [{**match, **vars(tol)} for match, tol in profile.overrides]}


def profile_from(data: dict[str, Any] | None):
    """Inverse of `profile_dict`; None or an unusable dict gives the default profile."""
    try:
        default = Tolerance(**data["default"])
        overrides = [({k: o[k] for k in ("step", "backend", "mode") if k in o},
                      Tolerance(**{k: v for k, v in o.items() if k not in ("step", "backend", "mode")}))
                     for o in data.get("overrides", [])]
        return Profile(default, overrides)
    except (TypeError, KeyError, AttributeError, ValueError):  # ValueError: pydantic's ValidationError
        return Profile.load()


# ----------------------------------------------------------------------------- JUnit

def junit_xml(run: Run, regressions: list[Regression], has_baseline: bool) -> str:
    """One testsuite of items (fail -> failure, errors -> error, skipped -> skipped) and one of
    regressions against the previous run, so that CI shows both."""
    root = ET.Element("testsuites", name=f"kokoro-parity nightly {run.id}")
    suite = ET.SubElement(root, "testsuite", name="kokoro-parity.items", timestamp=run.date,
                          hostname=str(run.machine.get("hostname", "")))
    props = ET.SubElement(suite, "properties")
    for k, v in (("run", run.id), ("commit", run.git.get("commit", "")), ("complete", str(run.complete).lower())):
        ET.SubElement(props, "property", name=k, value=str(v))
    n = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    total = 0.0
    for rec in run.records:
        t = item_seconds(rec)
        total += t
        case = ET.SubElement(suite, "testcase", classname=f"kokoro_parity.{rec['step']}.{rec['backend']}",
                             name=item_id(rec), time=f"{t:.3f}")
        n["tests"] += 1
        verdict, reason = rec["verdict"], rec.get("reason", "")
        if verdict == Verdict.FAIL.value:
            ET.SubElement(case, "failure", message=reason[:1000], type="fail").text = reason
            n["failures"] += 1
        elif verdict == Verdict.SKIPPED.value:
            ET.SubElement(case, "skipped", message=reason[:1000])
            n["skipped"] += 1
        elif verdict != Verdict.PASS.value:
            el = ET.SubElement(case, "error", message=f"{verdict}: {reason}"[:1000], type=verdict)
            el.text = "\n".join(x for x in (reason, rec.get("log", "")) if x)
            n["errors"] += 1
    suite.attrib.update({k: str(v) for k, v in n.items()}, time=f"{total:.3f}")

    rsuite = ET.SubElement(root, "testsuite", name="kokoro-parity.regressions", timestamp=run.date)
    r = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for reg in regressions:
        case = ET.SubElement(rsuite, "testcase", classname="kokoro_parity.regressions", name=f"{reg.item} {reg.what}")
        ET.SubElement(case, "failure", message=str(reg), type=reg.kind).text = str(reg)
        r["tests"] += 1
        r["failures"] += 1
    if not regressions:
        case = ET.SubElement(rsuite, "testcase", classname="kokoro_parity.regressions", name="no regressions")
        if not has_baseline:
            ET.SubElement(case, "skipped", message="no earlier run in the history to compare with")
            r["skipped"] += 1
        r["tests"] += 1
    rsuite.attrib.update({k: str(v) for k, v in r.items()})
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# ----------------------------------------------------------------------------- the nightly

@dataclass
class NightlyResult:
    run: Run
    path: Path
    regressions: list[Regression]
    problems: list[Problem]
    junit_path: Path | None

    def summary(self) -> str:
        c = self.run.counts
        lines = [f"run {self.run.id}: {len(self.run.records)} items {self.run.verdict_counts} -> {self.path}",
                 f"work: exports {c.get('exports', 0)}, compiles {c.get('compiles', 0)}, runs {c.get('runs', 0)}; "
                 f"{self.run.duration_s:.1f} s", f"junit: {self.junit_path}"]
        if self.regressions:
            lines.append(f"{len(self.regressions)} regression(s) against earlier runs:")
            lines += [f"  {r}" for r in self.regressions]
        else:
            lines.append("no regressions against earlier runs")
        return "\n".join(lines)


def nightly(records: Iterable[Record], history_dir: str | os.PathLike, *, n_items: int, backends: Iterable[str],
            profile, counts: Callable[[], dict] = dict, junit_path: str | os.PathLike | None = None,
            factor: float = DEFAULT_FACTOR, selection: dict[str, Any] | None = None,
            on_record: Callable[[Record], None] | None = None,
            upstream_dir: str | os.PathLike | None = None) -> NightlyResult:
    """Keep one history entry of `records` as they arrive (the caller runs the items, e.g.
    `(session.run(i) for i in items)`: history never runs anything itself), valid after every
    record; then compare with the history and write the JUnit XML. With `upstream_dir`
    (docs/upstream), also run every repro bundle's repro.py alone and keep each status in the
    entry: a defect whose repro exits 0 on the installed versions is marked fixed."""
    history_dir = Path(history_dir)
    earlier = load_history(history_dir)
    run = new_run(history_dir, selection or {}, sorted(set(backends)))
    run.selection.setdefault("items", n_items)
    run.selection["tolerances"] = profile_dict(profile)
    start = time.monotonic()
    write_run(history_dir, run)
    try:
        for rec in records:
            run.records.append(rec.to_dict())
            run.counts = dict(counts())
            run.duration_s = round(time.monotonic() - start, 3)
            write_run(history_dir, run)
            if on_record:
                on_record(rec)
        if upstream_dir is not None:
            run.upstream = check_bundles(upstream_dir)
            write_run(history_dir, run)
    except BaseException as e:
        run.error = f"stopped after {len(run.records)} of {n_items} items: {type(e).__name__}: {e}".strip()
        run.finished, run.duration_s = utc_now(), round(time.monotonic() - start, 3)
        write_run(history_dir, run)
        raise
    return _finish(run, earlier, history_dir, junit_path, factor, time.monotonic() - start)


MANIFEST = "merge.json"  # `kokoro-parity merge`'s list of its shards (harness.merge writes it)


def read_manifest(report_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The merge's summary of its shards, when `report_dir` was made by `harness.merge.merge_shards`."""
    p = Path(report_dir) / MANIFEST
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def record_run(records_dir: str | os.PathLike, history_dir: str | os.PathLike, *,
               junit_path: str | os.PathLike | None = None, factor: float = DEFAULT_FACTOR,
               selection: dict[str, Any] | None = None, profile=None) -> NightlyResult:
    """A history entry from records that are already written (e.g. shards joined by
    `kokoro-parity merge`), compared and reported exactly like a nightly run. Its work counts are
    the sum of the report dir's `counts/` (one file per shard or pytest process; without any, what
    the records' timings show: `work_counts`) and its duration
    the sum of the items' work seconds (`item_seconds`): shards run on several machines at once,
    so this is the matrix's cost, not a wall time (`selection.duration` says so)."""
    history_dir = Path(history_dir)
    records = []
    for path in sorted(Path(records_dir).glob("*.json")):
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
            _check_record(rec, len(records))
        except (OSError, json.JSONDecodeError, HistoryError) as e:
            raise HistoryError(f"{path}: {e}") from None
        records.append(rec)
    if not records:
        raise HistoryError(f"no records in {records_dir}")
    earlier = load_history(history_dir)
    run = new_run(history_dir, selection or {}, sorted({r["backend"] for r in records}))
    run.records = records
    run.selection.update(items=len(records), from_records=str(records_dir),
                         tolerances=profile_dict(profile or Profile.load()),
                         duration="sum of the items' export, compile, run and bisection seconds")
    manifest = read_manifest(Path(records_dir).parent)
    if manifest:
        run.selection["shards"] = manifest.get("shards", [])
    for path in sorted((Path(records_dir).parent / "counts").glob("*.json")):
        try:
            for k, v in json.loads(path.read_text(encoding="utf-8")).items():
                run.counts[k] = run.counts.get(k, 0) + int(v)
        except (OSError, ValueError, AttributeError, TypeError) as e:
            raise HistoryError(f"{path}: not a counts file: {e}") from None
    if not run.counts:  # no process wrote its counts (`kokoro-parity run`): the records' own
        run.counts = work_counts(records)
    return _finish(run, earlier, history_dir, junit_path, factor, sum(item_seconds(r) for r in records))


def _finish(run: Run, earlier: History, history_dir: Path, junit_path, factor: float, seconds: float) -> NightlyResult:
    baseline = earlier.baseline(len(earlier.runs))
    regressions = compare(baseline, run.records, factor)
    run.regressions = [r.to_dict() for r in regressions]
    run.complete, run.finished = True, utc_now()
    run.duration_s = round(seconds, 3)
    run.selection["factor"] = factor
    path = write_run(history_dir, run)
    if junit_path is not None:
        junit_path = Path(junit_path)
        atomic_write_text(junit_path, junit_xml(run, regressions, has_baseline=bool(baseline)))
    return NightlyResult(run, path, regressions, earlier.problems, junit_path)
