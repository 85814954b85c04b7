"""Child processes that outlive one job or start before it: a warm worker for the small, torch-free
jobs of a port chain (so judging a chain costs little more than running its artifacts), a one-job
spare for a compiled artifact's run (its process starts while the artifact compiles), and a
compiler for one backend's compiles in a row (`Compiler`: the backend's imports paid once).

A port item runs each ONNX stage twice (local and chained) and describes each artifact once; as a
fresh process each, those jobs spent more on Python's start, numpy and onnxruntime's imports and
on loading the same ONNX twice than on running it (`make bench`: benchmarks/chain_overhead.py).
The worker is one long-lived child that runs such jobs one after another, keeping what they loaded
(harness.backends.onnx_child memoizes its sessions). Isolation is the same as a job's: a job that
crashes the worker, or outlives its time limit (the worker is then killed), is that job's outcome,
and the next job starts a new worker. Same files as jobs.py (job.json in, result.json and log.txt
out), so a job's directory reads the same whichever way it ran. Only torch-free job functions are
sent here (a worker that imported torch would make every later job's memory figure a lie).

A spare (`prestart`, `run_spare_job`) is a worker that serves one job and exits: started while the
artifact compiles, it imports torch and the runtime (`preload`, 3-6 s for ExecuTorch) on the other
core, so the run job that follows pays for the run only. One job per process keeps a run's
isolation and its memory figure exactly a fresh process's.

    parent: WarmWorker.run_job(function, kwargs, workdir, timeout) -> JobResult
    child:  python -m harness.plumbing.worker [PRELOAD_JSON [MAX_JOBS]]
            (reads one workdir per line, answers one line each)
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from .cache import CACHE_ENV
from .files import atomic_write_json
from .jobs import JobResult, _child, _tail, _vm_hwm_mb, python_child


class WarmWorker:
    """The parent's handle on one worker process (started on the first job, restarted after a crash)."""

    def __init__(self, preload: dict | None = None, max_jobs: int = 0) -> None:
        """`preload`: {"function": "module:function", "kwargs": {...}} the child calls before its
        first job; `max_jobs`: the child exits after that many jobs (0: never)."""
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.jobs_run = 0
        self.preload, self.max_jobs = preload, max_jobs
        self._served = 0  # jobs the current process has served
        self.label = "child" if max_jobs == 1 else "warm worker"  # what an error message calls it
        self.env: dict[str, str] = {}

    def _start(self) -> subprocess.Popen:
        argv = [json.dumps(self.preload or {}), str(self.max_jobs)]
        self.env = dict(os.environ)  # a job's environment is the one its process started with
        self.proc = subprocess.Popen(python_child("harness.plumbing.worker", *argv), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True,
                                     env={**self.env, "PYTHONWARNINGS": "ignore"})
        self._served = 0
        return self.proc

    def serves(self, preload: dict) -> bool:
        """Whether this (started) worker's process fits a job with `preload` in today's environment."""
        return self.preload == preload and (self.proc is None or not self.env_changed())

    # variables each job carries in its job.json and sets in the child before it runs: a change of
    # them between jobs does not need a new process
    per_job_env: tuple[str, ...] = ()

    def env_changed(self) -> bool:
        """Whether the environment differs from the one the process started with (what a job can
        see: pytest rewrites PYTEST_CURRENT_TEST at every phase of every test, which changes nothing
        a job computes; `per_job_env` is set for each job)."""
        def job_env(env) -> dict[str, str]:
            return {k: v for k, v in env.items() if k != "PYTEST_CURRENT_TEST" and k not in self.per_job_env}
        return job_env(self.env) != job_env(os.environ)

    def start(self) -> None:
        """Start the process now (its preload runs while the parent does other work)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()

    def run_job(self, function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
        """`jobs.run_job`'s contract, in the warm worker."""
        with self.lock:
            workdir.mkdir(parents=True, exist_ok=True)
            job = {"function": function, "kwargs": kwargs}
            if self.per_job_env:
                job["env"] = {k: os.environ.get(k) for k in self.per_job_env}
            atomic_write_json(workdir / "job.json", job)
            (workdir / "result.json").unlink(missing_ok=True)
            proc = self.proc if self.proc is not None and self.proc.poll() is None else self._start()
            start = time.monotonic()
            proc.stdin.write((str(workdir.resolve()) + "\n").encode())
            proc.stdin.flush()
            status, peak = self._wait(proc, timeout)
            seconds = time.monotonic() - start
            tail = _tail(workdir / "log.txt")
            if status == "timeout":
                return JobResult("timeout", error=f"no result after {timeout:.0f} s ({self.label} killed)",
                                 seconds=seconds, peak_rss_mb=peak, log_tail=tail)
            if status != "done":
                name = signal.Signals(-status).name if isinstance(status, int) and -status in \
                    signal.Signals._value2member_map_ else str(status)
                hint = " (killed: out of memory?)" if status == -signal.SIGKILL else ""
                return JobResult("crashed", error=f"{self.label} died with signal {name}{hint}", seconds=seconds,
                                 peak_rss_mb=peak, log_tail=tail)
            self.jobs_run += 1
            self._served += 1
            if self.max_jobs and self._served >= self.max_jobs:  # the child exits after its last job
                proc.stdin.close()
                proc.wait()
                self.proc = None
            r = json.loads((workdir / "result.json").read_text())
            return JobResult(r["status"], value=r.get("value"), error=r.get("error", ""),
                             traceback=r.get("traceback", ""), seconds=seconds,
                             peak_rss_mb=max(peak, r.get("peak_rss_mb", 0.0)), log_tail=tail,
                             extra={"warm_worker": True})

    def _wait(self, proc: subprocess.Popen, timeout: float) -> tuple[str | int, float]:
        """("done" | "timeout" | the exit status of a worker that died, peak RSS seen in /proc)."""
        deadline = time.monotonic() + timeout
        peak = 0.0
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 0.05)
            peak = max(peak, _vm_hwm_mb(proc.pid))
            if ready:
                line = proc.stdout.readline()
                if line.strip() == b"done":
                    return "done", peak
                proc.wait()
                self.proc = None
                return proc.returncode, peak
            if time.monotonic() > deadline:
                self.stop()
                return "timeout", peak

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


_WORKER = WarmWorker()


def run_warm_job(function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
    """Run a torch-free job function in this process's warm worker."""
    return _WORKER.run_job(function, kwargs, Path(workdir), timeout)


_SPARE: WarmWorker | None = None  # at most one waiting spare (a run process holds torch: ~0.5 GB)


def prestart(preload: dict) -> None:
    """Start a one-job spare that preloads `preload` now, for a run job that will follow; a spare
    waiting with another preload is stopped (a job runs only where its own imports were made)."""
    global _SPARE
    if _SPARE is not None and not _SPARE.serves(preload):
        _SPARE.stop()
        _SPARE = None
    if _SPARE is None:
        _SPARE = WarmWorker(preload, max_jobs=1)
    _SPARE.start()


def run_spare_job(preload: dict, function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
    """Run one job in the spare started for `preload` (else in one started now: a fresh process's
    cost, its imports inside the job's seconds)."""
    global _SPARE
    spare = _SPARE if _SPARE is not None and _SPARE.serves(preload) else WarmWorker(preload, max_jobs=1)
    if _SPARE is not None and spare is not _SPARE:
        _SPARE.stop()  # started for another job, or before the environment changed
    _SPARE = None
    try:
        result = spare.run_job(function, kwargs, Path(workdir), timeout)
    finally:
        spare.stop()
    result.extra.pop("warm_worker", None)
    return result


class JobProcess(WarmWorker):
    """A worker for one kind of heavy job (a localization's probes, a run's exports) that would
    pay the same imports in every fresh child: torch, kokoro and the model's build, a runtime. Its
    jobs read as a fresh child's (no `warm_worker` mark); a change of the environment (a fault or
    a workaround switched off between jobs) starts a new process, as a fresh child would have seen
    it. The variables of `per_job_env` (the cache directory by default) are the exception: each job
    sets the parent's in the child, as a fresh child would have inherited them (a test suite
    switches caches between tests, and each switch cost a new exporter its torch and kokoro imports
    and the model's build, about 7 CPU s)."""

    def __init__(self, preload: dict | None = None, max_jobs: int = 0, per_job_env: tuple[str, ...] = (CACHE_ENV,)) -> None:
        super().__init__(preload, max_jobs)
        self.per_job_env = per_job_env

    def run_job(self, function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
        if self.proc is not None and self.env_changed():
            self.stop()
        result = super().run_job(function, kwargs, workdir, timeout)
        result.extra.pop("warm_worker", None)
        return result


class Compiler:
    """Compiles of one backend after another in one process (a JobProcess): each fresh compile
    child paid the backend's imports again (ExecuTorch's 5-8 s, coremltools' more) before a
    lowering of a small program that takes a second or two. One backend at a time: a compile of
    another backend stops the process and starts its own, so idle compilers never hold the
    imports of several runtimes at once. A crash or a hang is the job's outcome as in a fresh
    child, and the next compile starts a new process. So does the compile after a big one: the
    memory a lowering of Kokoro's decoder leaves in the allocator would count in the next
    compile's peak (a record's figure and the admission ledger's), where a fresh child's starts
    from its imports."""

    FRESH_AFTER_MB = 1500  # a compile that peaked above this is its process's last

    def __init__(self, max_jobs: int = 16) -> None:
        self.backend: str | None = None
        self.process: JobProcess | None = None
        self.max_jobs = max_jobs
        self.lock = threading.Lock()

    def runner(self, backend: str):
        """`jobs.run_job`'s stand-in for a compile of `backend`."""
        def run(function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
            with self.lock:
                if self.process is None or self.backend != backend:
                    self.stop()
                    self.process, self.backend = JobProcess(max_jobs=self.max_jobs), backend
                result = self.process.run_job(function, kwargs, workdir, timeout)
                if result.peak_rss_mb > self.FRESH_AFTER_MB:
                    self.stop()
                return result
        return run

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
        self.process = self.backend = None


COMPILER = Compiler()


def stop_worker() -> None:
    """Stop the warm worker, a waiting spare and the compiler."""
    global _SPARE
    _WORKER.stop()
    COMPILER.stop()
    if _SPARE is not None:
        _SPARE.stop()
        _SPARE = None


atexit.register(stop_worker)


def _serve(preload: dict | None = None, max_jobs: int = 0) -> None:
    """The worker's loop: each line names a job directory; the job's output goes to its log.txt."""
    reply = os.fdopen(os.dup(1), "w")
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1), os.dup2(quiet, 2)  # the preload's prints must not reach the reply pipe
    if preload:
        _preload(preload)
    served = 0
    for line in sys.stdin:
        workdir = Path(line.strip())
        _reset_peak()
        log = os.open(workdir / "log.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1), os.dup2(log, 2)
        try:
            _child(workdir)
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(quiet, 1), os.dup2(quiet, 2)
            os.close(log)
            _reset_peak()  # before "done": the parent's next poll must not read this job's peak as the next one's
        reply.write("done\n")
        reply.flush()
        served += 1
        if max_jobs and served >= max_jobs:
            return


def _preload(preload: dict) -> None:
    """Call the preload function; a failure is left for the job itself to meet and report."""
    try:
        module, _, name = preload["function"].partition(":")
        getattr(importlib.import_module(module), name)(**preload.get("kwargs", {}))
    except Exception:
        pass


def _reset_peak() -> None:
    """Reset this process's VmHWM, so a job's peak RSS is its own (Linux; elsewhere the worker's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]) if len(sys.argv) > 1 else None, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
