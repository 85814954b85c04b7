"""The two faces, `pytest` with the plugin and `kokoro-parity`, take the same options with the same
spelling (harness/options.py) and judge and localize every kind of item through the same path
(harness/pipeline.py): the same items give the same records."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import cli, options, plugin
from harness.options import Localize, RunConfig
from tests.unit.conftest import child_pytest_env, shared_references

ROOT = Path(__file__).resolve().parents[2]
PYTEST_ONLY = {"--golden-dir", "--update-golden", "--shard"}


class _Group:
    def __init__(self):
        self.flags = {}

    def addoption(self, flag, **kw):
        self.flags[flag] = kw

    def getgroup(self, name):
        return self

    def addini(self, *a, **kw):
        pass


def _cli_flags(command: str) -> set[str]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {s for a in sub._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def test_both_faces_take_the_run_options_spelled_alike():
    group = _Group()
    plugin.pytest_addoption(group)
    pytest_flags = set(group.flags) - PYTEST_ONLY
    assert pytest_flags == {options.OPTIONS[n].flag for n in options.RUN}
    assert _cli_flags("run") == pytest_flags | {"--step"}  # pytest selects steps with -k
    assert _cli_flags("nightly") >= pytest_flags  # limits included: nightly used to drop them
    bisect = _cli_flags("bisect")
    assert {"--bisect-depth", "--bisect-band-from"} <= bisect and not {"--depth", "--band-from"} & bisect


def test_a_run_configuration_reads_the_same_from_either_face():
    argv = ["--backend", "xnnpack", "--case", "ja", "--mode", "static", "--time-limit", "run=5", "--memory-limit",
            "3", "--with-patch", "length_aware_lstm", "--bisect", "--bisect-depth", "1", "--noise-k", "4",
            "--artifact", "f0n=x.onnx", "--reuse-only"]
    args = cli.build_parser().parse_args(["run", *argv])
    from_cli = RunConfig.from_options(lambda name: getattr(args, name))

    import argparse

    parser = argparse.ArgumentParser()
    options.add_pytest(type("G", (), {"addoption": parser.add_argument})(), options.RUN)
    ns = parser.parse_args(argv)
    from_pytest = RunConfig.from_options(lambda name: getattr(ns, name))
    assert from_cli == from_pytest
    assert from_cli.localize == Localize(depth=1)
    assert from_cli.time_limit == ("run=5",) and from_cli.memory_limit == 3.0 and from_cli.reuse_runs
    assert from_cli.modes == ("static",) and from_cli.backends == ("xnnpack",) and from_cli.case_ids == ("ja",)


# ---- the same items through both faces -------------------------------------------------------

VOLATILE = {"timings", "cache", "peak_rss_mb", "log", "audio", "target", "versions"}


def _strip_paths(value, roots):
    text = json.dumps(value)
    for root in roots:
        text = text.replace(f"{root}/", "<root>/")
    return json.loads(text)


@pytest.mark.slow
def test_face_parity_backend_step_and_artifact_with_bisect(tmp_path):
    """One backend step (eager) and one defective step artifact (an ONNX with a negated block,
    `--bisect`), on the tiny random-weight case: `pytest` and `kokoro-parity run` write the same
    records, field by field, the localization included."""
    from harness.cases import load_cases, write_case
    from harness.patches import apply_patches
    from harness.plumbing.cache import CACHE_ENV
    from harness.runner import Session
    from harness.steps import get_step

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    shared_references(tmp_path / "cache")  # the tiny case's references, computed once per test run
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(tmp_path / "cache"))
        session = Session(weights="random:0", case_ids=["tiny"], report_dir=tmp_path / "unused")
        session._cases = {c.id: c for c in load_cases(tmp_path / "cases")}
        inputs = session.traces("tiny").inputs("f0n", "dynamic", "float32")
        step = get_step("f0n").module(apply_patches(session.model.kmodel, ["noise_as_input", "dropout_identity"]))
        step.kmodel.get_submodule("predictor.F0.1").register_forward_hook(lambda m, a, out: -out)
        bad = tmp_path / "bad.onnx"
        torch.onnx.export(step, tuple(inputs.values()), str(bad), dynamo=True, input_names=list(inputs))

    common = ["--weights=random:0", "--case=tiny", f"--cases-dir={tmp_path / 'cases'}", "--mode=dynamic",
              "--backend=eager", f"--artifact=f0n={bad}", "--bisect"]
    env = child_pytest_env(KOKORO_PARITY_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_parity.py").write_text((ROOT / "tests" / "parity" / "test_parity.py").read_text())
    via_pytest = subprocess.run([sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", *common,
                                 "-k", "f0n and not golden", f"--report-dir={tmp_path / 'a'}"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    via_cli = subprocess.run([sys.executable, "-m", "harness.cli", "run", *common, "--step=f0n",
                              f"--report-dir={tmp_path / 'b'}"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    assert via_pytest.returncode == 1 and via_cli.returncode == 1, via_pytest.stdout[-3000:] + via_cli.stdout[-3000:]

    def records(d):
        return {p.name: json.loads(p.read_text()) for p in (tmp_path / d / "records").glob("*.json")}

    a, b = records("a"), records("b")
    assert set(a) == set(b) == {"tiny-f0n-eager-dynamic.json", "tiny-f0n-artifact-bad_onnx-dynamic.json"}
    for name in a:
        left = _strip_paths({k: v for k, v in a[name].items() if k not in VOLATILE}, [tmp_path / "a", tmp_path])
        right = _strip_paths({k: v for k, v in b[name].items() if k not in VOLATILE}, [tmp_path / "b", tmp_path])
        for key in left:
            assert left[key] == right[key], f"{name}: {key} differs between the faces"
    localized = a["tiny-f0n-artifact-bad_onnx-dynamic.json"]["bisect"]
    assert localized["kind"] == "onnx-stages" and localized["first_stage"] == "predictor.F0.1"
