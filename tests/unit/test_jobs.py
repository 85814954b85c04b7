"""Jobs run in a child process: an exception, a segfault or a hang is the job's outcome."""
from __future__ import annotations

import os
import signal
import time

import pytest

from harness.plumbing.jobs import run_job


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


def allocating_job(mb: int) -> int:
    block = bytearray(mb * 2**20)
    for i in range(0, len(block), 4096):  # touch every page
        block[i] = 1
    return len(block)


def allocate_then_segfault(mb: int) -> None:
    allocating_job(mb)
    time.sleep(0.5)  # long enough for the parent's /proc poll to see the high-water mark
    segfault_job()


def test_peak_memory_is_the_childs_own_not_its_parents(tmp_path):
    """wait4's ru_maxrss would report the parent's RSS at fork for any child; a 700 MB parent
    must not make an idle child look like a 700 MB job, and an allocating child must show its own."""
    ballast = bytearray(700 * 2**20)
    for i in range(0, len(ballast), 4096):
        ballast[i] = 1
    idle = run_job("tests.unit.test_jobs:ok_job", {"x": 1}, tmp_path / "idle", timeout=120)
    busy = run_job("tests.unit.test_jobs:allocating_job", {"mb": 400}, tmp_path / "busy", timeout=120)
    crashed = run_job("tests.unit.test_jobs:allocate_then_segfault", {"mb": 400}, tmp_path / "crash", timeout=120)
    del ballast
    assert 0 < idle.peak_rss_mb < 500, idle.peak_rss_mb
    assert busy.peak_rss_mb - idle.peak_rss_mb > 350, (busy.peak_rss_mb, idle.peak_rss_mb)
    assert crashed.status == "crashed" and crashed.peak_rss_mb > 350


def deep_c_recursion_job(depth: int) -> int:
    """json's C encoder recursing `depth` lists deep: about 40 bytes of C stack per level more than
    Python's own frames, 200,000 levels past an 8 MB stack (a SIGSEGV there, as TVM's compile of a
    1,078-step LSTM was)."""
    import json
    import sys

    sys.setrecursionlimit(10 * depth)
    x: list = []
    for _ in range(depth):
        x = [x]
    return len(json.dumps(x))


def stack_limit_job() -> int:
    import resource

    return resource.getrlimit(resource.RLIMIT_STACK)[0]


def test_a_job_has_the_c_stack_a_deep_compile_needs(tmp_path):
    import resource

    from harness.plumbing.jobs import STACK_KB

    hard = resource.getrlimit(resource.RLIMIT_STACK)[1]
    want = STACK_KB * 1024 if hard == resource.RLIM_INFINITY else min(hard, STACK_KB * 1024)
    limit = run_job("tests.unit.test_jobs:stack_limit_job", {}, tmp_path / "limit", timeout=120)
    assert limit.ok and limit.value == want, (limit.value, want)
    if want >= 256 * 2**20:
        r = run_job("tests.unit.test_jobs:deep_c_recursion_job", {"depth": 200_000}, tmp_path / "deep", timeout=300)
        assert r.ok and r.value == 400_002, (r.status, r.error)


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


def test_a_stopped_harness_kills_the_running_job_and_what_it_started(tmp_path, monkeypatch):
    """The child runs in its own session (a terminal's Ctrl-C does not reach it): when the harness
    is stopped while waiting, the child and its own children are killed, not left running."""
    pidfile = tmp_path / "pid"
    real_sleep = time.sleep

    def sleep(seconds):
        if pidfile.exists() and pidfile.read_text().strip():
            raise KeyboardInterrupt
        real_sleep(seconds)

    monkeypatch.setattr("harness.plumbing.jobs.time.sleep", sleep)
    with pytest.raises(KeyboardInterrupt):
        run_job("subprocess:call", {"args": ["sh", "-c", f"echo $$ > {pidfile}; exec sleep 600"]}, tmp_path / "job",
                timeout=120)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        real_sleep(0.05)
    assert not alive(pid)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for init to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_missing_function_is_an_error(tmp_path):
    r = run_job("tests.unit.test_jobs:no_such_job", {}, tmp_path, timeout=120)
    assert r.status == "error" and "no_such_job" in r.error


def test_time_limits_parse_and_name_the_bad_one():
    from harness.runner import Limits

    limits = Limits.parse(["compile=600", "run=30.5"])
    assert (limits.export_s, limits.compile_s, limits.run_s) == (900, 600, 30.5)  # export: the default
    with pytest.raises(ValueError, match="lower"):
        Limits.parse(["lower=3"])
    with pytest.raises(ValueError, match="'ten'"):
        Limits.parse(["run=ten"])


def test_compiles_of_one_backend_share_a_process_and_a_crash_or_a_big_one_ends_it(tmp_path, monkeypatch):
    """The runner's compiles go through `Compiler`: one process for one backend's compiles in a row
    (its imports paid once), a new one for another backend, after a crash, and after a compile
    whose peak would count in the next one's figure; a peak is the job's own, not the last job's."""
    from harness.plumbing.worker import Compiler

    compiler = Compiler()
    monkeypatch.setattr(Compiler, "FRESH_AFTER_MB", 300)
    run = lambda backend, fn, name, **kw: compiler.runner(backend)(fn, kw, tmp_path / name, 120)  # noqa: E731
    try:
        first, second = run("a", "os:getpid", "1"), run("a", "os:getpid", "2")
        assert first.ok and first.value == second.value  # one process
        crashed = run("a", "tests.unit.test_jobs:segfault_job", "3")
        assert crashed.status == "crashed" and "SIGSEGV" in crashed.error
        after = run("a", "os:getpid", "4")
        assert after.ok and after.value != first.value  # the crash ended that process, not the next compile
        other = run("b", "os:getpid", "5")
        assert other.value != after.value  # another backend: its own process
        big = run("b", "tests.unit.test_jobs:allocating_job", "6", mb=400)
        small = run("b", "os:getpid", "7")
        assert big.peak_rss_mb > 350 and small.value != other.value  # the big one was its process's last
        assert small.peak_rss_mb < big.peak_rss_mb - 300, (small.peak_rss_mb, big.peak_rss_mb)
        monkeypatch.setattr(Compiler, "FRESH_AFTER_MB", 10_000)  # now in one process: the peak is reset between jobs
        big, small = run("c", "tests.unit.test_jobs:allocating_job", "8", mb=400), run("c", "os:getpid", "9")
        assert small.peak_rss_mb < big.peak_rss_mb - 300, (small.peak_rss_mb, big.peak_rss_mb)
    finally:
        compiler.stop()
