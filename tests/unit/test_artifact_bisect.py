"""`--bisect` on `--artifact STEP=PATH` items (harness/port/onnx_steps.py): a user's per-step ONNX
with one known defect in one submodule is localized to that submodule, with the kind of
difference and a repro bundle that runs alone; a clean export passes; other formats are judged
whole with the reason."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.unit.conftest import child_pytest_env, shared_references

ROOT = Path(__file__).resolve().parents[2]


def _graph(nodes: list[tuple[str, dict | None]]):
    """A chain of Relu nodes x -> t0 -> t1 ..., each with a name and optional metadata."""
    from onnx import TensorProto, helper

    made = []
    for i, (name, meta) in enumerate(nodes):
        n = helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"], name=name)
        for k, v in (meta or {}).items():
            n.metadata_props.add(key=k, value=v)
        made.append(n)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info(f"t{len(nodes) - 1}", TensorProto.FLOAT, [1])
    return helper.make_model(helper.make_graph(made, "g", [x], [y]))


def _placed(nodes, roots):
    from harness.architecture import build_empty_kmodel
    from harness.port.onnx_steps import step_node_paths

    model = _graph(nodes)  # every path, a shared instance's aliases too, as a hooked run lists them
    paths = [p for p, _ in build_empty_kmodel().named_modules(remove_duplicate=False) if p]
    node_path, how = step_node_paths(model, paths, roots)
    return [node_path(n) for n in model.graph.node], how


def test_torchscript_names_resolve_under_the_detected_prefix():
    # the harness's step wrapper (kmodel is never called: names start at the called module)
    got, how = _placed([("/decoder/encode/conv1/Conv", None), ("/decoder/generator/conv_post/Conv", None),
                        ("/decoder/generator/resblocks.5/convs2.2/Conv", None), ("/Squeeze", None)], ["decoder"])
    assert got == ["decoder.encode.conv1", "decoder.generator.conv_post", "decoder.generator.resblocks.5.convs2.2", ""]
    assert "node names" in how and "3 of 4 nodes placed" in how
    # a user's export of kmodel.decoder itself, and of a wrapper that calls it as `model`
    got, how = _placed([("/generator/conv_post/Conv", None), ("/encode/conv1/Conv", None)], ["decoder"])
    assert got == ["decoder.generator.conv_post", "decoder.encode.conv1"] and "names start at 'decoder'" in how
    got, how = _placed([("/model/generator/conv_post/Conv", None), ("/model/F0_conv/Conv", None)], ["decoder"])
    assert got == ["decoder.generator.conv_post", "decoder.F0_conv"] and "'model' dropped" in how
    # a segment named relative to an outer call (`cnn.0/cnn.0.0`), a later call (`_1`)
    got, _ = _placed([("/text_encoder/cnn.0/cnn.0.0/Conv", None), ("/text_encoder/lstm_1/LSTM", None)],
                     ["text_encoder"])
    assert got == ["text_encoder.cnn.0.0", "text_encoder.lstm"]
    # a shared instance named by its first registration (kokoro's one LeakyReLU is `cnn.0.2` in every
    # block) stays in the block that calls it; an export's own wrapper scope is passed through
    got, _ = _placed([("/text_encoder/cnn.1/cnn.0.2/LeakyRelu", None), ("/text_encoder/cnn.1/cnn.1.0/Conv", None)],
                     ["text_encoder"])
    assert got == ["text_encoder.cnn.1.2", "text_encoder.cnn.1.0"]
    # ... and neither makes a prefix that is also a module's name (kokoro-onnx's `encoder`, ALBERT's
    # `bert.encoder`) a base that swallows every node after it
    got, how = _placed([("/encoder/text_encoder/cnn.0/cnn.0.0/Conv", None), ("/encoder/text_encoder/cnn.1/cnn.0.2/"
                        "LeakyRelu", None), ("/encoder/text_encoder/lstm/LSTM", None), ("/encoder/bert/embeddings/Add",
                                                                                          None)], ["bert", "text_encoder"])
    assert got == ["text_encoder.cnn.0.0", "text_encoder.cnn.1.2", "text_encoder.lstm", "bert.embeddings"], how
    assert "'encoder' dropped" in how
    got, _ = _placed([("/decoder/generator/istft/stft/Conv", None), ("/decoder/generator/conv_post/Conv", None)],
                     ["decoder"])
    assert got == ["decoder.generator.stft", "decoder.generator.conv_post"]


def test_dynamo_metadata_resolves_and_unscoped_nodes_go_to_the_common_module():
    scope = lambda *s: {"pkg.torch.onnx.name_scopes": repr(["", *s, "op"])}  # noqa: E731
    got, how = _placed([("node_conv1d", scope("kmodel.predictor.F0.0", "kmodel.predictor.F0.0.conv1")),
                        ("node_Split_3", None),  # an optimizer's rewrite: no metadata
                        ("node_conv1d_1", scope("kmodel.predictor.F0.0", "kmodel.predictor.F0.0.conv2")),
                        ("node_transpose", scope())],  # the step's own op
                       ["predictor.shared", "predictor.F0.0"])
    assert got == ["predictor.F0.0.conv1", "predictor.F0.0", "predictor.F0.0.conv2", ""]
    assert "pkg.torch.onnx.name_scopes" in how and "'kmodel' dropped" in how
    ns = {"namespace": ": harness.steps.DecoderStep/kmodel.decoder: kokoro.istftnet.Decoder/"
                       "kmodel.decoder.generator: kokoro.istftnet.Generator/conv1d: aten.conv1d.default"}
    got, how = _placed([("node_conv1d", ns)], ["decoder"])
    assert got == ["decoder.generator"] and "exporter metadata (namespace)" in how


def test_other_formats_and_static_items_are_judged_whole_with_the_reason(tmp_path):
    from harness.artifacts import ArtifactItem
    from harness.port.onnx_steps import localize_artifact_item
    from harness.record import Record
    from harness.report import format_bisect
    from harness.verdict import Verdict

    session = SimpleNamespace(report_dir=tmp_path)
    for path, mode, why in (("dec.pte", "dynamic", "ETRecord"), ("dec.so", "dynamic", "no intermediate values"),
                            ("dec.onnx", "static", "exact lengths only")):
        item = ArtifactItem("tiny", "decoder", str(tmp_path / path), mode)
        rec = Record("tiny", "decoder", item.backend, mode, Verdict.FAIL)
        localize_artifact_item(session, item, rec, log=lambda line: None)
        assert why in rec.bisect["error"] and rec.bisect["error"].endswith("judged whole")
        assert format_bisect(rec.bisect).startswith("localization: ")
        assert json.loads((tmp_path / "records" / f"{rec.item_id}.json").read_text())["bisect"] == rec.to_dict()["bisect"]


def _tiny_session(tmp_path: Path, patches=()):
    """A Session on the seeded random model and a short case, with a cache of its own."""
    from harness.cases import load_cases, write_case
    from harness.runner import Session

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    session = Session(weights="random:0", case_ids=["tiny"], report_dir=tmp_path / "reports",
                      extra_patches=tuple(patches))
    session._cases = {c.id: c for c in load_cases(tmp_path / "cases")}
    return session


def _export(session, step_name: str, path: Path, defect: str | None = None, factor: float = -1.0,
            patches=()) -> Path:
    """The tiny case's step exported by torch.onnx (dynamo) from the harness's step wrapper, as a
    user would; `defect`: the submodule whose output is scaled by `factor` during the export."""
    from harness.patches import apply_patches
    from harness.steps import get_step

    inputs = session.traces("tiny").inputs(step_name, "dynamic", "float32")
    km = apply_patches(session.model.kmodel, ["noise_as_input", "dropout_identity", *patches])
    step = get_step(step_name).module(km)
    if defect:
        step.kmodel.get_submodule(defect).register_forward_hook(lambda m, args, out: out * factor)
    torch.onnx.export(step, tuple(inputs.values()), str(path), dynamo=True, input_names=list(inputs))
    return path


@pytest.mark.slow
def test_a_defective_step_onnx_is_localized_and_a_clean_one_passes(tmp_path):
    """Through pytest: `--artifact f0n=bad.onnx --artifact f0n=clean.onnx --bisect` names the
    block whose output was negated during export, as a sign flip; its repro.py exits 1 alone."""
    from harness.plumbing.cache import CACHE_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(shared_references(tmp_path / "cache")))
        session = _tiny_session(tmp_path)
        bad = _export(session, "f0n", tmp_path / "bad.onnx", "predictor.F0.1")
        clean = _export(session, "f0n", tmp_path / "clean.onnx")

    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_parity.py").write_text((ROOT / "tests" / "parity" / "test_parity.py").read_text())
    reports = tmp_path / "reports"
    cmd = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", "--weights=random:0", "--case=tiny",
           f"--cases-dir={tmp_path / 'cases'}", "--mode=dynamic", "-k", "not golden", f"--artifact=f0n={bad}",
           f"--artifact=f0n={clean}", "--bisect", f"--report-dir={reports}"]
    env = child_pytest_env(KOKORO_PARITY_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    out = run.stdout + run.stderr
    print(out[out.find("stages inside"):out.find("repro:")])
    assert "1 failed, 1 passed" in out, out[-4000:]
    assert "first stage whose local error leaves its tolerance: predictor.F0.1" in out, out[-4000:]

    records = {json.loads(p.read_text())["backend"]: json.loads(p.read_text()) for p in (reports / "records").glob("*")}
    assert records["artifact-clean_onnx"]["verdict"] == "pass" and not records["artifact-clean_onnx"]["bisect"]
    b = records["artifact-bad_onnx"]["bisect"]
    assert b["kind"] == "onnx-stages" and b["step"] == "f0n" and b["first_stage"] == "predictor.F0.1"
    stages = {e["stage"]: e for e in b["stages"]}
    assert stages["predictor.F0.1"]["local"]["kind"] == "sign flip"
    before = [e for e in b["stages"][:[e["stage"] for e in b["stages"]].index("predictor.F0.1")] if e["mapped"]]
    assert len(before) >= 10 and all(e["local"]["ok"] and e["chained"]["ok"] for e in before)  # F0.1's own modules
    assert stages["predictor.N_proj"]["chained"]["ok"]  # the N branch never sees the defect
    assert stages["predictor.F0_proj"]["local"]["ok"] and not stages["predictor.F0_proj"]["chained"]["ok"]

    repro = Path(b["repro"])
    alone = subprocess.run([sys.executable, "repro.py"], cwd=repro, capture_output=True, text=True, timeout=300,
                           env={"PATH": "/usr/bin:/bin"})
    assert alone.returncode == 1, alone.stdout + alone.stderr
    assert "stage predictor.F0.1: rel_l2 2.000e+00" in alone.stdout
    meta = json.loads((repro / "meta.json").read_text())  # the one bundle layout: meta.json and REPORT.md too
    assert meta["stage"] == "predictor.F0.1" and meta["rel_l2"] == pytest.approx(2.0, rel=1e-3)
    assert "predictor.F0.1" in (repro / "REPORT.md").read_text()


@pytest.mark.slow
def test_a_decoder_onnx_with_its_own_stft_is_localized_to_the_scaled_conv(tmp_path, monkeypatch):
    """The decoder as ports export it (CustomSTFT: `--with-patch custom_stft`, whose module
    references then carry it too), `decoder.generator.conv_post` x1.5: a grandchild of the step
    named, as a constant gain of +3.52 dB, every stage before it within its floor."""
    from harness.artifacts import ArtifactItem, check_artifact
    from harness.plumbing.cache import CACHE_ENV
    from harness.port.onnx_steps import localize_artifact_item
    from harness.verdict import Verdict

    monkeypatch.setenv(CACHE_ENV, str(shared_references(tmp_path / "cache")))
    session = _tiny_session(tmp_path, ["custom_stft"])
    path = _export(session, "decoder", tmp_path / "decoder.onnx", "decoder.generator.conv_post", 1.5,
                   patches=["custom_stft"])
    item = ArtifactItem("tiny", "decoder", str(path), "dynamic")
    rec = check_artifact(session, item)
    assert rec.verdict is Verdict.FAIL, rec.reason
    b = localize_artifact_item(session, item, rec)
    assert b["first_stage"] == "decoder.generator.conv_post" and "references with custom_stft" in b["names"]
    stages = [e for e in b["stages"] if e["mapped"]]
    named = next(e for e in stages if e["stage"] == "decoder.generator.conv_post")
    assert named["local"]["kind"] == "constant gain x1.5 (+3.52 dB)"
    before = stages[:stages.index(named)]
    bad = [(e["stage"], e["chained"], e.get("local")) for e in before
           if not (e["chained"]["ok"] and (e.get("local") or {"ok": True})["ok"])]
    assert len(before) > 30 and not bad, bad
    assert sum("local" in e for e in before) > 30  # judged locally too, not only chained
    alone = subprocess.run([sys.executable, "repro.py"], cwd=b["repro"], capture_output=True, text=True, timeout=300)
    assert alone.returncode == 1 and "rel_l2 5.000e-01" in alone.stdout, alone.stdout + alone.stderr
