"""Memory admission: compiles wait for the memory their last run peaked at (harness.plumbing.admission)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from harness.plumbing import admission


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(tmp_path / "cache"))


def test_ledger_keeps_the_largest_peak():
    assert admission.recorded_peak_mb("compile/xnnpack/f0n") == 0
    admission.record_peak_mb("compile/xnnpack/f0n", 4300)
    admission.record_peak_mb("compile/xnnpack/f0n", 1200)
    admission.record_peak_mb("compile/xnnpack/f0n", None)
    assert admission.recorded_peak_mb("compile/xnnpack/f0n") == 4300


def test_unknown_job_and_lone_job_are_admitted_at_once():
    with admission.admitted("never-seen", available=lambda: 0) as waited:
        assert waited < 1
    admission.record_peak_mb("huge", 10**6)  # larger than any machine: alone, it still runs
    with admission.admitted("huge", available=lambda: 1000) as waited:
        assert waited < 1
        assert admission.reserved_mb() == 10**6
    assert admission.reserved_mb() == 0


def test_second_job_waits_until_the_first_releases_its_memory():
    admission.record_peak_mb("lowering", 4000)
    free = lambda: 6000  # noqa: E731 - room for one 4 GB lowering, not two
    order = []
    release = threading.Event()

    def first():
        with admission.admitted("lowering", available=free):
            order.append("first in")
            release.wait(5)
            order.append("first out")

    t = threading.Thread(target=first)
    t.start()
    while not order:
        time.sleep(0.01)
    waits = []
    threading.Timer(0.5, release.set).start()
    with admission.admitted("lowering", poll_s=0.05, available=free, on_wait=lambda need, room: waits.append(room)):
        order.append("second in")
    t.join()
    assert order == ["first in", "first out", "second in"]
    assert waits and all(room < 4000 for room in waits)


def test_reservation_of_a_dead_process_is_ignored(tmp_path):
    admission.record_peak_mb("lowering", 4000)
    code = ("from harness.plumbing import admission\nimport os\n"
            "with admission.admitted('lowering', available=lambda: 6000):\n    os._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ})
    assert list((tmp_path / "cache" / "admission").glob("*.reservation"))  # left behind by os._exit
    assert admission.reserved_mb() == 0
    with admission.admitted("lowering", available=lambda: 6000) as waited:
        assert waited < 1
