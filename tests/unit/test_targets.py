"""Remote targets over SSH (harness.plumbing.targets) against a real OpenSSH server on 127.0.0.1.

The server, its host key and the client key are made per module (sshd_helper.py); the target's
Python is a separate virtualenv that sees only the packages given to it (torch and numpy, and
onnxruntime or not) and receives the harness source from the host. Nothing leaves this machine.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import yaml

from .conftest import shared_references
from .sshd_helper import have_openssh, keygen, start_sshd, target_venv

pytestmark = pytest.mark.skipif(not have_openssh()[0], reason=have_openssh()[1])


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """sshd + two target venvs + a targets.yaml naming good and broken targets."""
    root = tmp_path_factory.mktemp("ssh-lab")
    sshd = start_sshd(root / "sshd")
    full = target_venv(root / "venv-full", ["torch", "numpy", "onnxruntime"])
    bare = target_venv(root / "venv-bare", ["torch", "numpy"])
    other_key = keygen(root / "not_authorized")
    wrong_hosts = root / "wrong_known_hosts"
    keygen(root / "other_host")
    wrong_hosts.write_text(f"[127.0.0.1]:{sshd.port} {(root / 'other_host.pub').read_text()}")
    from .sshd_helper import free_port

    targets = {
        "full": sshd.target(full, root / "remote-full"),
        "bare": sshd.target(bare, root / "remote-bare"),
        "wrongkey": sshd.target(full, root / "remote-x", key=other_key),
        "wronghost": sshd.target(full, root / "remote-x", known_hosts=wrong_hosts),
        "refused": {**sshd.target(full, root / "remote-x"), "port": free_port()},
        "nopython": sshd.target(root / "no" / "python", root / "remote-x"),
    }
    path = root / "targets.yaml"
    path.write_text(yaml.safe_dump({"targets": targets}))
    lab = type("Lab", (), dict(root=root, sshd=sshd, file=path, full=full, bare=bare))
    opened = []

    def target(name):
        from harness.plumbing.targets import get_target

        t = get_target(name, path)
        opened.append(t)
        return t

    lab.target = staticmethod(target)
    yield lab
    for t in opened:
        t.close()
    sshd.stop()


def _processes_mentioning(text: str) -> list[int]:
    """Processes whose command line contains `text` (the remote run dirs are unique paths)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text.encode() in (d / "cmdline").read_bytes():
                    found.append(int(d.name))
            except OSError:
                pass
    return found


# ---- the targets file -----------------------------------------------------------------------------

def test_targets_file_errors_name_the_file_and_the_field(tmp_path):
    from harness.plumbing.targets import TargetError, get_target, load_specs

    path = tmp_path / "targets.yaml"
    path.write_text("targets:\n  mac: {kind: ssh, host: m, port: 70000}\n")
    with pytest.raises(TargetError, match=r"targets\.yaml: targets\.mac\.port: Input should be less than"):
        load_specs(path)
    path.write_text("targets:\n  mac: {kind: ssh, host: m, pyton: /x}\n")
    with pytest.raises(TargetError, match=r"targets\.mac\.pyton: Extra inputs are not permitted"):
        load_specs(path)
    path.write_text("targets:\n  mac: {kind: telnet, host: m}\n")
    with pytest.raises(TargetError, match=r"targets\.mac: .*'local', 'ssh'"):
        load_specs(path)
    path.write_text("targets:\n  mac: {kind: ssh, host: m, env: {'OMP THREADS': '1'}}\n")
    with pytest.raises(TargetError, match=r"targets\.mac\.env\.OMP THREADS\.\[key\]: String should match pattern"):
        load_specs(path)
    path.write_text("targets: [\n")
    with pytest.raises(TargetError, match="not valid YAML"):
        load_specs(path)
    path.write_text("targets:\n  mac: {kind: ssh, host: m}\n")
    assert set(load_specs(path)) == {"local", "mac"}
    with pytest.raises(TargetError, match="unknown target 'pi'; known: local, mac"):
        get_target("pi", path)
    with pytest.raises(TargetError, match="not found"):
        load_specs(tmp_path / "missing.yaml")


def test_ssh_command_carries_no_secret_and_quotes_the_script(lab):
    t = lab.target("full")
    cmd = t.ssh_command("echo 'a b'; rm -rf x")
    assert cmd[-1] == "sh -c 'echo '\"'\"'a b'\"'\"'; rm -rf x'"
    assert "BatchMode=yes" in cmd and "-i" in cmd and not any("PRIVATE KEY" in c for c in cmd)


# ---- jobs over ssh ------------------------------------------------------------------------------------

def test_a_targets_env_reaches_its_jobs_and_its_description(lab, tmp_path):
    """sshd gives a job a clean environment: the target's `env:` (CPU kernel pins, threads) is what it gets."""
    t = lab.target("full")
    assert t.spec.env  # the lab's targets carry conftest's pins (sshd_helper.target)
    for key, value in t.spec.env.items():
        r = t.run_job("os:getenv", {"key": key}, tmp_path / key, 30)
        assert r.ok and r.value == value, (r.error, r.log_tail)
    assert t.describe()["env"] == t.spec.env


def test_a_job_ships_its_files_runs_there_and_brings_back_the_same_result(lab, tmp_path):
    t = lab.target("full")
    art = tmp_path / "artifact.bin"
    art.write_bytes(os.urandom(300_000))
    inp = tmp_path / "inputs.bin"
    inp.write_bytes(b"inputs")
    first = t.run_job("shutil:copyfile", {"src": str(art), "dst": str(tmp_path / "w" / "out.bin")}, tmp_path / "w",
                      30, files={"src": "artifact", "dst": "output"})
    assert first.ok, (first.error, first.log_tail)
    assert (tmp_path / "w" / "out.bin").read_bytes() == art.read_bytes()
    assert first.peak_rss_mb > 1 and first.seconds > 0 and first.extra["transport_s"] >= 0
    again = t.run_job("shutil:copyfile", {"src": str(art), "dst": str(tmp_path / "w" / "out2.bin")}, tmp_path / "w",
                      30, files={"src": "artifact", "dst": "output"})
    assert again.ok and again.extra["upload_bytes"] < 100_000 < first.extra["upload_bytes"]  # cached there
    per_run = t.run_job("shutil:copyfile", {"src": str(inp), "dst": str(tmp_path / "w" / "out3.bin")},
                        tmp_path / "w", 30, files={"src": "input", "dst": "output"})
    assert per_run.ok and (tmp_path / "w" / "out3.bin").read_bytes() == b"inputs"
    remote = lab.root / "remote-full"
    assert list((remote / "runs").iterdir()) == []  # nothing left but the cache
    kinds = [p.name[:2] for p in (remote / "cache").iterdir()]  # the artifact once; the harness source
    assert kinds.count("a-") == 1 and "h-" in kinds  # (once per version of it: the tree may change meanwhile)


def test_the_target_is_described_and_its_packages_decide_what_runs(lab):
    from harness.backends import get_backend

    full, bare = lab.target("full"), lab.target("bare")
    ort = get_backend("onnxruntime")
    assert full.runnable(ort) == (True, "")
    ok, why = bare.runnable(ort)
    assert not ok and "on target 'bare'" in why and "onnxruntime" in why
    d = full.describe()
    assert d["name"] == "full" and d["kind"] == "ssh" and d["os"] and d["machine"] and d["python"]
    assert d["runtimes"]["onnxruntime"].startswith("onnxruntime==") and d["packages"]["torch"]
    assert not {"host", "user", "identity_file"} & set(d)  # where, not how to get in


def test_remote_crash_and_timeout_are_the_jobs_outcome_and_leave_nothing(lab, tmp_path):
    t = lab.target("full")
    crashed = t.run_job("os:abort", {}, tmp_path / "a", 30)
    assert crashed.status == "crashed" and "SIGABRT" in crashed.error
    start = time.monotonic()
    hung = t.run_job("subprocess:check_call", {"args": ["sleep", "47.5"]}, tmp_path / "b", 2)
    assert hung.status == "timeout" and "no result after 2 s" in hung.error
    assert time.monotonic() - start < 20
    assert not _processes_mentioning("47.5")
    failed = t.run_job("json:loads", {"s": "{"}, tmp_path / "c", 30)
    assert failed.status == "error" and "JSONDecodeError" in failed.error and "Traceback" in failed.log_tail


def _in_background(fn):
    box = {}

    def work():
        try:
            box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            box["result"] = e

    th = threading.Thread(target=work)
    th.start()
    return th, box


def _wait_for(predicate, seconds=30.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_a_remote_job_killed_there_is_crashed_with_its_signal(lab, tmp_path):
    import signal

    t = lab.target("full")
    th, box = _in_background(lambda: t.run_job("subprocess:check_call", {"args": ["sleep", "48.5"]},
                                               tmp_path / "k", 60))
    pid_file = _wait_for(lambda: next((lab.root / "remote-full" / "runs").glob("*/child.pid"), None))
    os.killpg(int(_wait_for(pid_file.read_text)), signal.SIGKILL)
    th.join(60)
    r = box["result"]
    assert r.status == "crashed" and "SIGKILL" in r.error and "transport_retries" not in r.extra


def test_unreachable_targets_say_why(lab, tmp_path):
    from harness.backends import get_backend
    from harness.plumbing.targets import TargetUnreachable

    eager = get_backend("eager")
    for name, why in (("wrongkey", "authentication failed"), ("wronghost", "host key verification failed"),
                      ("refused", "connection refused"), ("nopython", "Python")):
        ok, reason = lab.target(name).runnable(eager)
        assert not ok and f"target {name!r}" in reason and why in reason, reason
        with pytest.raises(TargetUnreachable):
            lab.target(name).run_job("json:dumps", {"obj": 1}, tmp_path / name, 10)


def test_sshd_gone_mid_job_is_retried_then_crashed_and_the_remote_job_dies(lab, tmp_path):
    """A second server, stopped while a job runs on it: the retry meets a refused connection."""
    sshd = start_sshd(tmp_path / "sshd2")
    path = tmp_path / "targets.yaml"
    path.write_text(yaml.safe_dump({"targets": {"flaky": sshd.target(lab.full, tmp_path / "remote")}}))
    from harness.plumbing.targets import get_target

    t = get_target("flaky", path)
    try:
        th, box = _in_background(lambda: t.run_job("subprocess:check_call", {"args": ["sleep", "49.5"]},
                                                   tmp_path / "j", 60))
        _wait_for(lambda: next((tmp_path / "remote" / "runs").glob("*/child.pid"), None))
        sshd.stop()
        th.join(60)
    finally:
        t.close()
        sshd.stop()
    r = box["result"]
    assert r.status == "crashed" and "transport failure" in r.error and r.extra["transport_retries"] == 1, r
    _wait_for(lambda: not _processes_mentioning("49.5"), 10)  # the remote side saw EOF and killed its job


# ---- items through the runner: the same verdict and metrics there as here ---------------------------

@pytest.fixture(scope="module")
def tiny(lab, tmp_path_factory):
    """A Session on the seeded random model and a one-word case (bert_encoder: small and quick)."""
    from harness.cases import load_cases, write_case
    from harness.plumbing.cache import CACHE_ENV
    from harness.runner import Session

    root = tmp_path_factory.mktemp("tiny-remote")
    write_case(root / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(shared_references(root / "cache", work=True)))  # bert_encoder's: as test_merge's
        s = Session(weights="random:0", case_ids=["tiny"], report_dir=root / "reports", targets_file=str(lab.file))
        s._cases = {c.id: c for c in load_cases(root / "cases")}
        yield s
        s.close()


@pytest.mark.slow  # the tiny case's reference traces and exports: minutes on a busy 2-core machine
@pytest.mark.parametrize("backend", ["eager", "onnxruntime"])
def test_items_on_a_target_get_the_local_verdict_and_metrics_and_say_where_they_ran(tiny, backend):
    from harness.record import read_records
    from harness.runner import Item
    from harness.verdict import Verdict

    if backend == "onnxruntime":
        pytest.importorskip("onnxscript")
    here = tiny.run(Item("tiny", "bert_encoder", backend, "dynamic"))
    there = tiny.run(Item("tiny", "bert_encoder", backend, "dynamic", target="full"))
    assert here.verdict is Verdict.PASS, here.reason
    assert there.verdict is here.verdict and there.metrics == here.metrics, (there.reason, there.log)
    assert there.item_id == f"tiny-bert_encoder-{backend}@full-dynamic" and here.item_id.endswith(f"-{backend}-dynamic")
    assert there.target["name"] == "full" and there.target["os"] == "Linux" and there.target["python"]
    assert here.target["name"] == "local" and there.cache["artifact"] == "hit"  # compiled once, on the host
    assert there.timings["transport_s"] > 0 and there.peak_rss_mb["run"] > 0
    written = {r.item_id for r in read_records(tiny.report_dir / "records")}
    assert {here.item_id, there.item_id} <= written  # two records, two columns
    from harness.report import summary_table

    header = summary_table([here, there]).splitlines()[0]
    assert f"{backend}@full" in header and f" {backend} " in f"{header} "


@pytest.mark.slow
def test_a_target_without_the_backends_package_or_unreachable_skips_and_the_run_goes_on(tiny):
    from harness.runner import Item
    from harness.verdict import Verdict

    pytest.importorskip("onnxscript")
    lacking = tiny.run(Item("tiny", "bert_encoder", "onnxruntime", "dynamic", target="bare"))
    assert lacking.verdict is Verdict.SKIPPED and "on target 'bare'" in lacking.reason
    assert "onnxruntime" in lacking.reason and lacking.audit is not None and lacking.timings.get("run_s") is None
    locked_out = tiny.run(Item("tiny", "bert_encoder", "eager", "dynamic", target="wrongkey"))
    assert locked_out.verdict is Verdict.SKIPPED and "authentication failed" in locked_out.reason
    assert locked_out.target == {"name": "wrongkey", "kind": "ssh", "reachable": False,
                                 "reason": locked_out.target["reason"]}
    after = tiny.run(Item("tiny", "bert_encoder", "eager", "dynamic", target="bare"))  # eager needs only torch
    assert after.verdict is Verdict.PASS, after.reason


def test_a_compile_on_the_target_comes_back_into_the_local_cache(lab, tmp_path, monkeypatch):
    """compile_where = "target" (TVM Metal, ExecuTorch MPS on a Mac): here with eager's compile."""
    import json
    from collections import Counter

    import torch

    from harness.backends import get_backend
    from harness.plumbing.cache import CACHE_ENV
    from harness.plumbing.targets import compile_on_target

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    program = tmp_path / "program.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2), (torch.randn(1, 4),)), str(program))
    make = lambda out: dict(backend="eager", program_path=str(program), out_dir=str(out))  # noqa: E731
    counts = Counter()
    entry, result = compile_on_target(lab.target("full"), get_backend("eager"), "k", make, 120, counts)
    assert result is not None and result.ok, (result.error, result.log_tail)
    assert (entry / "program.pt2").read_bytes() == program.read_bytes()
    assert json.loads((entry / "result.json").read_text())["value"]["artifact_bytes"] == program.stat().st_size
    again, hit = compile_on_target(lab.target("full"), get_backend("eager"), "k", make, 120, counts)
    assert again == entry and hit is None and counts == Counter(artifacts_misses=1, artifacts_hits=1)


# ---- the Apple backends on Linux: registered, lowered as far as Linux allows, skipped with the reason ----

@pytest.mark.skipif(__import__("platform").system() == "Darwin", reason="on macOS they run")
def test_apple_backends_say_precisely_why_they_cannot_run_here():
    import importlib.util

    from harness.backends import backend_names, get_backend

    assert {"et-coreml", "et-mps", "tvm-metal"} <= set(backend_names())
    if importlib.util.find_spec("executorch"):
        ok, why = get_backend("et-mps").available()
        assert not ok and "executorch.backends.apple.mps is not in this executorch wheel" in why
        et = get_backend("et-coreml")
        assert et.run_requires == ("executorch",) and "compute_units=CPU_ONLY" in et.version()
        ok, why = et.runnable()
        assert not ok and "needs macOS" in why
    assert get_backend("et-mps").compile_where == get_backend("tvm-metal").compile_where == "target"
    assert get_backend("et-coreml").compile_where == "host"
    ok, why = get_backend("tvm-metal").available()  # not even attempted here: it crashes (docs/targets.md)
    assert not ok and "macOS target" in why and "SIGSEGV" in why
    ok, why = get_backend("tvm-metal").runnable()
    assert not ok and "TVM's Metal runtime needs macOS" in why


@pytest.mark.slow  # imports executorch and coremltools: 10-25 s
def test_et_coreml_lowers_on_linux_and_its_runtime_lacks_the_delegate(tmp_path):
    pytest.importorskip("executorch")
    pytest.importorskip("coremltools")
    import torch

    from harness.backends import get_backend
    from harness.backends.apple import _et_runtime_has

    program = tmp_path / "program.pt2"
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU()).eval()
    torch.export.save(torch.export.export(model, (torch.randn(2, 8),)), str(program))
    audit = get_backend("et-coreml").compile(program, tmp_path)
    assert (tmp_path / "program.pte").stat().st_size > 0 and audit["delegated_nodes"] >= 1
    ok, why = _et_runtime_has("CoreMLBackend")
    assert not ok and "no CoreMLBackend" in why and "XnnpackBackend" in why


def test_the_harness_options_travel_with_a_job_and_local_paths_do_not(lab, tmp_path, monkeypatch):
    monkeypatch.setenv("KOKORO_PARITY_COREML_COMPUTE_UNITS", "CPU_AND_NE")
    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(tmp_path / "host-cache"))
    t = lab.target("full")
    units = t.run_job("os:getenv", {"key": "KOKORO_PARITY_COREML_COMPUTE_UNITS"}, tmp_path / "a", 30)
    cache = t.run_job("os:getenv", {"key": "KOKORO_PARITY_CACHE"}, tmp_path / "b", 30)
    assert units.value == "CPU_AND_NE" and cache.ok and cache.value is None


def test_an_unknown_target_is_a_usage_error_in_the_cli_and_in_pytest(tmp_path, capsys):
    import subprocess
    import sys

    from harness.cli import main

    from .conftest import child_pytest_env

    path = tmp_path / "targets.yaml"
    path.write_text("targets:\n  mac: {kind: ssh, host: m}\n")
    assert main(["run", "--target", "nope", "--targets-file", str(path), "--backend", "eager"]) == 2
    assert "unknown target 'nope'; known: local, mac" in capsys.readouterr().err
    root = Path(__file__).resolve().parents[2]
    p = subprocess.run([sys.executable, "-m", "pytest", "--target", "mac", f"--targets-file={tmp_path / 'bad.yaml'}",
                        "--co", "-q", "-p", "no:randomly", "--backend", "eager"], cwd=root, capture_output=True,
                       text=True, env=child_pytest_env(), timeout=300)
    assert p.returncode == 4 and "bad.yaml: targets file not found" in p.stderr, p.stderr[-2000:]
