"""The warm worker (harness.plumbing.worker): jobs run one after another in one process, and a job
that raises, crashes or hangs is that job's outcome only: the next job gets a working worker."""
from __future__ import annotations

import os
import sys
import time

import pytest

from harness.plumbing.worker import WarmWorker

HERE = "tests.unit.test_worker"
JOBS = "tests.unit.test_jobs"  # its failing, segfaulting and hanging job functions


def pid_job(tag: str) -> dict:
    print(f"job {tag} says hello")
    return {"pid": os.getpid(), "torch": "torch" in sys.modules}


@pytest.fixture
def worker():
    w = WarmWorker()
    yield w
    w.stop()


def test_jobs_share_one_process_and_keep_their_own_logs(worker, tmp_path):
    a = worker.run_job(f"{HERE}:pid_job", {"tag": "a"}, tmp_path / "a", timeout=120)
    b = worker.run_job(f"{HERE}:pid_job", {"tag": "b"}, tmp_path / "b", timeout=120)
    assert a.ok and b.ok, (a.error, b.error)
    assert a.value["pid"] == b.value["pid"] != os.getpid()
    assert not b.value["torch"]  # the worker stays torch-free
    assert "job a says hello" in (tmp_path / "a" / "log.txt").read_text()
    assert "job a" not in (tmp_path / "b" / "log.txt").read_text()
    assert a.peak_rss_mb > 0 and a.extra["warm_worker"]


def test_an_exception_is_the_jobs_error_and_the_worker_lives_on(worker, tmp_path):
    first = worker.run_job(f"{HERE}:pid_job", {"tag": "a"}, tmp_path / "a", timeout=120)
    r = worker.run_job(f"{JOBS}:failing_job", {}, tmp_path / "f", timeout=120)
    assert r.status == "error" and r.error == "ValueError: bad tensor 'asr'" and "Traceback" in r.traceback
    after = worker.run_job(f"{HERE}:pid_job", {"tag": "b"}, tmp_path / "b", timeout=120)
    assert after.ok and after.value["pid"] == first.value["pid"]


def test_a_crash_is_the_jobs_outcome_and_the_next_job_gets_a_new_worker(worker, tmp_path):
    first = worker.run_job(f"{HERE}:pid_job", {"tag": "a"}, tmp_path / "a", timeout=120)
    r = worker.run_job(f"{JOBS}:segfault_job", {}, tmp_path / "s", timeout=120)
    assert r.status == "crashed" and "SIGSEGV" in r.error
    after = worker.run_job(f"{HERE}:pid_job", {"tag": "b"}, tmp_path / "b", timeout=120)
    assert after.ok and after.value["pid"] != first.value["pid"]


def test_a_hang_is_killed_at_its_time_limit(worker, tmp_path):
    start = time.monotonic()
    r = worker.run_job(f"{JOBS}:hanging_job", {}, tmp_path / "h", timeout=2)
    assert r.status == "timeout" and time.monotonic() - start < 60
    after = worker.run_job(f"{HERE}:pid_job", {"tag": "b"}, tmp_path / "b", timeout=120)
    assert after.ok


# ---- the one-job spare of a compiled artifact's run -------------------------------------------

def slow_preload(seconds: float, mark: str) -> None:
    """A preload that takes time (as torch and a runtime's imports do) and leaves a mark."""
    time.sleep(seconds)
    os.environ["KP_TEST_PRELOADED"] = mark


def preloaded_job() -> dict:
    print("preloaded job runs")
    return {"pid": os.getpid(), "mark": os.environ.get("KP_TEST_PRELOADED")}


def test_a_prestarted_spare_does_its_preload_before_the_job_and_serves_one_job(tmp_path):
    from harness.plumbing import worker

    preload = {"function": f"{HERE}:slow_preload", "kwargs": {"seconds": 3.0, "mark": "yes"}}
    try:
        worker.prestart(preload)
        time.sleep(6)  # the parent's compile
        a = worker.run_spare_job(preload, f"{HERE}:preloaded_job", {}, tmp_path / "a", timeout=120)
        assert a.ok and a.value["mark"] == "yes" and a.value["pid"] != os.getpid()
        assert a.seconds < 2.5, a.seconds  # the preload's 3 s were spent before the job
        assert "preloaded job runs" in (tmp_path / "a" / "log.txt").read_text()
        assert worker._SPARE is None  # used up: the next job gets a new process
        # without a prestart, the job pays for its process's preload, as a fresh process would
        b = worker.run_spare_job(preload, f"{HERE}:preloaded_job", {}, tmp_path / "b", timeout=120)
        assert b.ok and b.value["pid"] != a.value["pid"] and b.seconds >= 3.0
    finally:
        worker.stop_worker()


def test_a_spare_started_before_the_environment_changed_is_not_used(tmp_path, monkeypatch):
    from harness.plumbing import worker

    preload = {"function": f"{HERE}:slow_preload", "kwargs": {"seconds": 0.0, "mark": "x"}}
    try:
        worker.prestart(preload)
        first = worker._SPARE.proc.pid
        monkeypatch.setenv("KP_TEST_SWITCH", "on")  # e.g. a workaround switched off in between
        r = worker.run_spare_job(preload, f"{HERE}:env_job", {}, tmp_path / "r", timeout=120)
        assert r.ok and r.value["switch"] == "on" and r.value["pid"] != first
    finally:
        worker.stop_worker()


def env_job() -> dict:
    return {"pid": os.getpid(), "switch": os.environ.get("KP_TEST_SWITCH")}


def test_a_crashing_spare_job_reads_like_a_crashed_child(tmp_path):
    from harness.plumbing import worker

    r = worker.run_spare_job({"function": f"{HERE}:slow_preload", "kwargs": {"seconds": 0.0, "mark": "x"}},
                             f"{JOBS}:segfault_job", {}, tmp_path / "s", timeout=120)
    assert r.status == "crashed" and r.error.startswith("child died with signal SIGSEGV")


def test_a_job_process_reads_as_a_fresh_child_and_restarts_when_the_environment_changes(tmp_path, monkeypatch):
    """The probes' and exports' process (JobProcess): jobs share it, leave no warm-worker mark, and
    a job after the environment changed runs in a new process that sees the change."""
    from harness.plumbing.worker import JobProcess

    w = JobProcess(max_jobs=2)
    try:
        a = w.run_job(f"{HERE}:pid_job", {"tag": "a"}, tmp_path / "a", timeout=120)
        b = w.run_job(f"{HERE}:pid_job", {"tag": "b"}, tmp_path / "b", timeout=120)
        assert a.ok and b.ok and a.value["pid"] == b.value["pid"] and "warm_worker" not in a.extra
        monkeypatch.setenv("PYTEST_CURRENT_TEST", "another test (call)")  # pytest's own: no restart
        c = w.run_job(f"{HERE}:pid_job", {"tag": "c"}, tmp_path / "c", timeout=120)  # past max_jobs
        monkeypatch.setenv("KOKORO_PARITY_TEST_SWITCH", "on")
        d = w.run_job(f"{HERE}:pid_job", {"tag": "d"}, tmp_path / "d", timeout=120)
        assert c.value["pid"] != b.value["pid"] and d.value["pid"] != c.value["pid"]
    finally:
        w.stop()


def cache_job() -> dict:
    from harness.plumbing.cache import CACHE_ENV

    return {"pid": os.getpid(), "cache": os.environ.get(CACHE_ENV)}


def test_a_job_process_keeps_its_process_across_caches_and_each_job_sees_its_own(tmp_path, monkeypatch):
    """A test suite switches the cache directory between tests: the exporter keeps its process
    (kokoro imported, the model built) and each job sees the cache its parent had, set or not."""
    from harness.plumbing.cache import CACHE_ENV
    from harness.plumbing.worker import JobProcess

    w = JobProcess(max_jobs=8)
    try:
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / "one"))
        a = w.run_job(f"{HERE}:cache_job", {}, tmp_path / "a", timeout=120)
        monkeypatch.setenv(CACHE_ENV, str(tmp_path / "two"))
        b = w.run_job(f"{HERE}:cache_job", {}, tmp_path / "b", timeout=120)
        monkeypatch.delenv(CACHE_ENV)
        c = w.run_job(f"{HERE}:cache_job", {}, tmp_path / "c", timeout=120)
        assert a.ok and b.ok and c.ok and a.value["pid"] == b.value["pid"] == c.value["pid"]
        assert (a.value["cache"], b.value["cache"], c.value["cache"]) == (str(tmp_path / "one"), str(tmp_path / "two"),
                                                                          None)
        monkeypatch.setenv("KOKORO_PARITY_TEST_SWITCH", "on")  # any other variable: a new process
        d = w.run_job(f"{HERE}:cache_job", {}, tmp_path / "d", timeout=120)
        assert d.ok and d.value["pid"] != c.value["pid"]
    finally:
        w.stop()
