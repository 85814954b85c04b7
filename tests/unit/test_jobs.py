"""Jobs run in a child process: an exception, a segfault or a hang is the job's outcome."""
from __future__ import annotations

import os
import signal
import time

import pytest

from harness.jobs import run_job


def ok_job(x: int) -> dict:
    return {"double": 2 * x}


def failing_job() -> None:
    raise ValueError("bad tensor 'asr'\nsecond line")


def segfault_job() -> None:
    os.kill(os.getpid(), signal.SIGSEGV)


def hanging_job() -> None:
    time.sleep(600)


def test_ok(tmp_path):
    r = run_job("tests.unit.test_jobs:ok_job", {"x": 21}, tmp_path, timeout=120)
    assert r.ok and r.value == {"double": 42} and r.peak_rss_mb > 0


def test_exception_gives_first_error_line_and_traceback(tmp_path):
    r = run_job("tests.unit.test_jobs:failing_job", {}, tmp_path, timeout=120)
    assert r.status == "error" and r.error == "ValueError: bad tensor 'asr'"
    assert "Traceback" in r.traceback and "second line" in r.log_tail


def test_segfault_is_crashed_with_the_signal(tmp_path):
    r = run_job("tests.unit.test_jobs:segfault_job", {}, tmp_path, timeout=120)
    assert r.status == "crashed" and "SIGSEGV" in r.error


def test_hang_is_a_timeout_and_is_killed(tmp_path):
    start = time.monotonic()
    r = run_job("tests.unit.test_jobs:hanging_job", {}, tmp_path, timeout=3)
    assert r.status == "timeout" and time.monotonic() - start < 60


def test_missing_function_is_an_error(tmp_path):
    r = run_job("tests.unit.test_jobs:no_such_job", {}, tmp_path, timeout=120)
    assert r.status == "error" and "no_such_job" in r.error


def test_time_limits_parse_and_name_the_bad_one():
    from harness.runner import Limits

    limits = Limits.parse(["compile=600", "run=30.5"])
    assert (limits.export_s, limits.compile_s, limits.run_s) == (1200, 600, 30.5)
    with pytest.raises(ValueError, match="lower"):
        Limits.parse(["lower=3"])
    with pytest.raises(ValueError, match="'ten'"):
        Limits.parse(["run=ten"])
