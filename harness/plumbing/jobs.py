"""Jobs: one export, compile or run, described as files and executed in a child process.

A job directory holds `job.json` (a function "module:function" and its keyword arguments) and the
files it names. The child writes `result.json` and its log. A segfault, abort, OOM kill or hang is
the job's outcome (crashed with the signal, or timeout), never the end of the harness's run.
The same directory is what a cache entry, a repro bundle or a remote device would receive.
"""
from __future__ import annotations

import importlib
import json
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import admission, cache
from .files import atomic_write_json
from .errors import UsageError

MEMORY_SHARE = 0.8


@dataclass
class Limits:
    """Each phase of an item, by default, within 15 minutes (one item's limit on a 2-core machine); a
    cost law skips up front what it estimates past a limit. Here, below the runner, so that the
    bisection's probes (harness.bisect) take the same limits without importing the runner."""

    export_s: float = 900
    compile_s: float = 900
    run_s: float = 900
    compile_gb: float | None = None  # None: MEMORY_SHARE of this machine's memory (--memory-limit)

    def memory_gb(self) -> float:
        """The memory a compile may be estimated to need (harness.backends.cost) before it is skipped:
        by default MEMORY_SHARE of the machine's, the rest being the OS's, the pytest process's
        (weights, references: 2-3 GB) and the run's."""
        if self.compile_gb is not None:
            return self.compile_gb
        return MEMORY_SHARE * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30

    @classmethod
    def parse(cls, specs: list[str], memory_gb: float | None = None) -> "Limits":
        """From `PHASE=SECONDS` strings (`--time-limit compile=600`) and `--memory-limit GB`."""
        limits = cls(compile_gb=memory_gb)
        for spec in specs:
            phase, _, seconds = spec.partition("=")
            if phase not in ("export", "compile", "run"):
                raise UsageError(f"--time-limit {spec!r}: the phase is export, compile or run")
            try:
                setattr(limits, f"{phase}_s", float(seconds))
            except ValueError:
                raise UsageError(f"--time-limit {spec!r}: {seconds!r} is not a number of seconds") from None
        return limits


@dataclass
class JobResult:
    status: str  # ok | error | crashed | timeout
    value: Any = None
    error: str = ""  # first error line
    traceback: str = ""
    seconds: float = 0.0
    peak_rss_mb: float = 0.0
    log_tail: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# The C stack a job's process starts with (KiB): compilers that walk a written-out graph
# recursively need far more than the usual 8 MB. TVM's compile of en_long's f0n (an LSTM written
# out 1,078 steps long) died with SIGSEGV at 8 MB and passes with more (docs/findings.md, 13).
# Bounded, so that a runaway recursion still ends; the hard limit wins where it is lower (macOS).
STACK_KB = 2 * 1024 * 1024


def python_child(module: str, *args: str) -> list[str]:
    """argv for `python -m module args` started with a C stack of STACK_KB (`sh` sets the limit and
    execs Python: the same pid, so signals and exit statuses are Python's own)."""
    if os.name != "posix":
        return [sys.executable, "-m", module, *args]
    script = f'ulimit -s {STACK_KB} 2>/dev/null || ulimit -s "$(ulimit -H -s)" 2>/dev/null; exec "$@"'
    return ["/bin/sh", "-c", script, "sh", sys.executable, "-m", module, *args]


def run_job(function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
    """Run `function(**kwargs)` in a fresh Python process inside `workdir`."""
    workdir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(workdir / "job.json", {"function": function, "kwargs": kwargs})
    (workdir / "result.json").unlink(missing_ok=True)
    log_path = workdir / "log.txt"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(python_child("harness.plumbing.jobs", str(workdir)), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore"})
        try:
            status, polled_peak = _wait(proc, timeout)
        except BaseException:  # the harness is stopping (Ctrl-C, SIGTERM): the child, in its own session, would run on
            _kill(proc)
            raise
    seconds = time.monotonic() - start
    tail = _tail(log_path)
    peak = polled_peak
    if status == "timeout":
        return JobResult("timeout", error=f"no result after {timeout:.0f} s (killed)", seconds=seconds,
                         peak_rss_mb=peak, log_tail=tail)
    if status < 0:
        name = signal.Signals(-status).name if -status in signal.Signals._value2member_map_ else str(-status)
        hint = " (killed: out of memory?)" if -status == signal.SIGKILL else ""
        return JobResult("crashed", error=f"child died with signal {name}{hint}", seconds=seconds,
                         peak_rss_mb=peak, log_tail=tail)
    result_path = workdir / "result.json"
    if not result_path.exists():
        return JobResult("crashed", error=f"child exited with code {status} and no result", seconds=seconds,
                         peak_rss_mb=peak, log_tail=tail)
    r = json.loads(result_path.read_text())
    peak = max(peak, r.get("peak_rss_mb", 0.0))
    return JobResult(r["status"], value=r.get("value"), error=r.get("error", ""), traceback=r.get("traceback", ""),
                     seconds=seconds, peak_rss_mb=peak, log_tail=tail)


def _wait(proc: subprocess.Popen, timeout: float) -> tuple[int | str, float]:
    """(exit status or "timeout", the child's peak RSS in MB as last seen in /proc).

    Not wait4's ru_maxrss: a forked child starts with the parent's resident pages counted in its
    high-water mark and keeps that figure across exec, so a 3 GB pytest process made every child
    report at least 3 GB. /proc/<pid>/status VmHWM belongs to the exec'd image alone; polling it
    also gives a figure for a child the OOM killer ends."""
    deadline = time.monotonic() + timeout
    peak = 0.0
    while True:
        peak = max(peak, _vm_hwm_mb(proc.pid))
        pid, code, _ = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            proc.returncode = os.waitstatus_to_exitcode(code)
            return proc.returncode, peak
        if time.monotonic() > deadline:
            _kill(proc)
            return "timeout", peak
        time.sleep(0.05)


def _kill(proc: subprocess.Popen) -> None:
    """Kill a job's child and what it started (its session), and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.wait4(proc.pid, 0)
    except ChildProcessError:  # reaped already
        pass


def _vm_hwm_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


def own_peak_rss_mb() -> float:
    """This process's peak RSS since exec, and that of the processes it started and reaped (whose
    figures can only exceed ours by their own allocations: they forked from us)."""
    return max(_vm_hwm_mb(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def first_error_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


class _BuildFailed(Exception):
    pass


def cached_job(kind: str, key: str, function: str, timeout: float, make_kwargs, counts=None,
               admission_key: str | None = None, runner=None) -> tuple[Path, JobResult | None]:
    """Run a job whose output directory is a cache entry (`kind`, `key`); nothing is cached when
    the job fails. Returns (entry, None) on a hit, else (entry, the job's result). With
    `admission_key`, the job first waits for the memory its last run peaked at (admission.py).
    `counts` (a Counter) gets `<kind>_hits` / `<kind>_misses`. `runner`: run_job's stand-in (a
    worker process's `run_job`)."""
    run_job_ = runner or run_job
    entry = cache.entry(kind, key)
    if cache.lookup(kind, key):
        if counts is not None:
            counts[f"{kind}_hits"] += 1
        return entry, None
    outcome: dict = {}

    def build(tmp: Path) -> None:
        if admission_key is None:
            result = run_job_(function, make_kwargs(tmp), tmp, timeout)
        else:
            with admission.admitted(admission_key) as waited:
                result = run_job_(function, make_kwargs(tmp), tmp, timeout)
            result.extra["admission_wait_s"] = round(waited, 1)
            admission.record_peak_mb(admission_key, result.peak_rss_mb)
        outcome["result"] = result
        if not result.ok:
            raise _BuildFailed()

    if counts is not None:
        counts[f"{kind}_misses"] += 1
    try:
        entry, _ = cache.get_or_build(kind, key, build)
    except _BuildFailed:
        pass
    return entry, outcome.get("result")


def _child(workdir: Path) -> None:
    job = json.loads((workdir / "job.json").read_text())
    for key, value in job.get("env", {}).items():  # a JobProcess's per-job variables (harness.plumbing.worker)
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    module, _, name = job["function"].partition(":")
    start = time.monotonic()
    try:
        fn = getattr(importlib.import_module(module), name)
        value = fn(**job["kwargs"])
        result = {"status": "ok", "value": value}
    except Exception as e:  # noqa: BLE001 - any failure of the job is its result
        # a crash the job saw in a process it drives (a browser's renderer) says so: `job_status`
        status = "crashed" if getattr(e, "job_status", None) == "crashed" else "error"
        result = {"status": status, "error": first_error_line(e), "traceback": traceback.format_exc(),
                  "value": getattr(e, "partial", None)}  # what the job knew before failing (an audit)
        traceback.print_exc()
    result["seconds_in_child"] = time.monotonic() - start
    result["peak_rss_mb"] = own_peak_rss_mb()
    atomic_write_json(workdir / "result.json", result)


if __name__ == "__main__":
    _child(Path(sys.argv[1]))
