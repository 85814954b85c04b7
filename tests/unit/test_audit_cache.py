"""The op audit is kept with the program: computed once per program and audit, whichever backend
of those that share it compiles first (xnnpack, portable; onnxruntime, tvm-onnx)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.backends import Backend, audit_of, get_backend

CALLS: list[str] = []


class CountingAudit(Backend):
    name = "counting-a"

    def audit(self, program_path: Path) -> dict:
        CALLS.append(self.name)
        return {"ops": {"aten.foo": 1}}


class SameAudit(CountingAudit):
    name = "counting-b"  # inherits the audit: shares it


class OtherAudit(Backend):
    name = "counting-c"

    def audit(self, program_path: Path) -> dict:
        CALLS.append(self.name)
        return {"other": True}


class FailingAudit(Backend):
    name = "counting-failing"

    def audit(self, program_path: Path) -> dict:
        CALLS.append(self.name)
        raise RuntimeError("no such op table")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    from harness.plumbing.cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    CALLS.clear()


def test_backends_sharing_an_audit_compute_it_once_per_program(tmp_path):
    program, audits = tmp_path / "program.pt2", tmp_path / "audits"
    first, hit_a = audit_of(CountingAudit(), program, str(audits))
    second, hit_b = audit_of(SameAudit(), program, str(audits))
    other, hit_c = audit_of(OtherAudit(), program, str(audits))
    assert CALLS == ["counting-a", "counting-c"]
    assert first == second == {"ops": {"aten.foo": 1}} and other == {"other": True}
    assert (hit_a, hit_b, hit_c) == (False, True, False)
    assert len(list(audits.glob("*.json"))) == 2

    elsewhere, hit = audit_of(CountingAudit(), tmp_path / "other.pt2", str(tmp_path / "other-audits"))
    assert hit is False and CALLS[-1] == "counting-a"  # another program: its own audit


def test_a_failing_audit_is_recorded_not_kept_and_no_dir_means_no_cache(tmp_path):
    audits = tmp_path / "audits"
    for _ in range(2):
        audit, hit = audit_of(FailingAudit(), tmp_path / "p.pt2", str(audits))
        assert audit == {"audit_error": "RuntimeError: no such op table"} and hit is False
    assert CALLS == ["counting-failing"] * 2 and not list(audits.glob("*.json"))
    audit, hit = audit_of(CountingAudit(), tmp_path / "p.pt2")
    assert hit is None and audit == {"ops": {"aten.foo": 1}}


class PidAudit(Backend):
    name = "pid-audit"

    def audit(self, program_path: Path) -> dict:
        import os

        return {"pid": os.getpid()}


class DyingAudit(Backend):
    name = "dying-audit"

    def audit(self, program_path: Path) -> dict:
        import os

        os._exit(3)


def test_the_audit_runs_beside_the_compile_in_its_own_process(tmp_path):
    import os

    from harness.backends import audit_beside

    wait = audit_beside(PidAudit(), tmp_path / "p.pt2", str(tmp_path / "audits"))
    audit, cached = wait()
    assert audit["pid"] != os.getpid() and cached is False
    assert audit_beside(PidAudit(), tmp_path / "p.pt2", str(tmp_path / "audits"))() == (audit, True)  # kept: read
    died, cached = audit_beside(DyingAudit(), tmp_path / "p.pt2", str(tmp_path / "audits"))()
    assert died == {"audit_error": "the audit's process died (exit code 3)"} and cached is None


def test_real_backends_that_share_an_audit_have_one_key():
    import os

    from harness.backends import NO_WORKAROUND_ENV

    key = lambda name: get_backend(name).audit_key()  # noqa: E731
    said = {n: (type(get_backend(n)).audit.__module__, sorted(get_backend(n).disabled_workarounds()))
            for n in ("xnnpack", "portable")}  # what the key is made of, where they differ
    assert key("xnnpack") == key("portable") and key("xnnpack") is not None, (said, os.environ.get(NO_WORKAROUND_ENV))
    assert key("onnxruntime") == key("tvm-onnx") != key("xnnpack")
    assert key("eager") is None  # no audit: nothing to keep


@pytest.mark.slow
def test_two_backends_of_one_program_audit_it_once(tmp_path):
    """xnnpack then portable compile the same program through the runner: the second reads the
    first's audit (counted like the program and artifact caches), and both records carry it."""
    import torch

    from harness.record import Record
    from harness.runner import Session
    from harness.verdict import Verdict

    program_dir = tmp_path / "program"
    program_dir.mkdir()
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.GELU())
    torch.export.save(torch.export.export(module, (torch.randn(2, 8),)), str(program_dir / "program.pt2"))
    session = Session(report_dir=tmp_path / "reports")
    records = {}
    for name in ("xnnpack", "portable"):
        rec = Record("t", "linear", name, "dynamic", Verdict.SKIPPED)
        assert session.artifact(get_backend(name), "linear", program_dir, f"test-{tmp_path.name}", rec) is not None
        records[name] = rec
    assert session.counts["audits_misses"] == 1 and session.counts["audits_hits"] == 1
    assert session.counts["compiles"] == 2
    xnn, portable = records["xnnpack"].audit, records["portable"].audit
    assert "non_core_aten_ops" in xnn and xnn["non_core_aten_ops"] == portable["non_core_aten_ops"]
    assert portable["kernels"] == "portable" and xnn["delegate_coverage"] > 0  # each compile's own part stays
    kept = list((program_dir / "audits").glob("*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text()) == {"non_core_aten_ops": xnn["non_core_aten_ops"]}
