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
