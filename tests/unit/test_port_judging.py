"""How a port's stage outputs are judged (harness/port/chain.py), on hand-made tensors: no model,
no artifact, no child process. A NaN fails every row, under every noise rule and for glue."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness.port.chain import judge_end, judge_glue, judge_tensor, UserGlue
from harness.port.portfile import Port, PortSpec, StageSpec
from harness.record import Record
from harness.verdict import Profile, Tolerance, Verdict

TOL = Tolerance()


def _stage(noise: str | None, out: str = "audio") -> StageSpec:
    return StageSpec(name="voc", artifact="voc.onnx", inputs={"x": "asr"}, outputs={"y": out},
                     **({"noise": noise} if noise else {}))


def _ref(value: torch.Tensor) -> dict:
    return {"float32": value.float(), "float64": value.double()}


def _traces() -> SimpleNamespace:
    """Three tokens of two frames each: t_en, the one-hot alignment, asr = t_en @ aln."""
    t_en = torch.randn(1, 512, 3, generator=torch.Generator().manual_seed(0))
    aln = torch.repeat_interleave(torch.eye(3), 2, dim=1)[None]
    return SimpleNamespace(chain={"t_en": t_en, "aln": aln, "asr": t_en @ aln}, captures={}, io={},
                           valid=SimpleNamespace(tokens=3, frames=6), pred_dur=[2, 2, 2])


@pytest.mark.parametrize("noise", ["own", "inputs", "none"])
@pytest.mark.parametrize("share", [1.0, 0.01])
def test_a_nan_stage_output_fails_under_every_noise_rule(noise, share):
    ref = torch.randn(1, 4000, generator=torch.Generator().manual_seed(1))
    value = ref.clone()
    n = int(share * value.numel())
    value.view(-1)[:n] = math.nan
    m = judge_tensor("audio", value, None, TOL, _stage(noise), _ref(ref))
    assert m["ok"] is False
    assert m["why"] == f"NaN: {n} of 4000 values non-finite", m["why"]
    assert m["kind"].startswith("NaN/Inf")


def test_an_inf_or_a_nan_of_another_shape_fails_and_says_so_first():
    ref = torch.randn(1, 512, 6)
    inf = ref.clone()
    inf[0, 0, 0] = math.inf
    m = judge_tensor("asr", inf, None, TOL, _stage(None, "asr"), _ref(ref))
    assert not m["ok"] and m["why"] == "Inf: 1 of 3072 values non-finite"
    longer = torch.full((1, 512, 7), math.nan)
    m = judge_tensor("asr", longer, None, TOL, _stage(None, "asr"), _ref(ref))
    assert not m["ok"] and m["why"].startswith("NaN: 3584 of 3584 values non-finite; shape [1, 512, 7]")


def test_a_clean_stochastic_output_still_goes_to_the_noise_band():
    ref = torch.randn(1, 4000, generator=torch.Generator().manual_seed(1))
    m = judge_tensor("audio", ref * 3, None, TOL, _stage("own"), _ref(ref))
    assert m["ok"] and m["why"].startswith("draws its own noise")


def nan_glue(values):
    return values["asr"] * math.nan


def test_a_nan_from_the_users_glue_fails_its_row():
    traces = _traces()
    row = judge_glue(UserGlue("m:nan_glue", nan_glue), "asr", {}, traces, {}, TOL, _stage("own", "asr"))
    assert row["stage"] == "glue:asr" and not row["local_ok"] and not row["chained_ok"]
    assert row["outputs"]["asr"]["local"]["why"] == "NaN: 3072 of 3072 values non-finite"


def test_a_local_nan_fails_the_item_and_comes_first_in_its_reason():
    stage = _stage("own")
    port = Port(PortSpec(name="p", stages=[stage]), ".", "p.yaml")
    rec = Record("tiny", "port:p", "port", "dynamic", Verdict.SKIPPED)
    ok = {"ok": True, "why": "rel_l2 1e-07 <= 2x fp32 floor", "rel_l2": 1e-7}
    slow = {"ok": False, "why": "rel_l2 0.5 > 2x fp32 floor", "rel_l2": 0.5}
    nan = {"ok": False, "why": "NaN: 10 of 10 values non-finite", "rel_l2": math.nan}
    rec.stages = [{"stage": "front", "outputs": {"asr": {"local": ok, "chained": slow}}},
                  {"stage": "voc", "outputs": {"audio": {"local": nan, "chained": {**ok, "why": "draws its own"}}}}]
    session = SimpleNamespace(profile=Profile.load())
    judge_end(session, port, SimpleNamespace(backend="port", mode="dynamic"), rec, {}, None, None)
    assert rec.verdict is Verdict.FAIL
    assert rec.reason.startswith("voc:audio (local): NaN: 10 of 10 values non-finite; front:asr: rel_l2"), rec.reason


# ---- a stage's noise rule: found from the stage; `noise:` in the port file only overrides ------

def _vocoder(path, random_op: bool, noise_input: bool = False):
    """asr -> audio, with a RandomNormalLike feeding the output (times zero) when `random_op`."""
    from onnx import TensorProto, helper

    F = TensorProto.FLOAT
    nodes = [helper.make_node("ReduceSum", ["x"], ["audio"], axes=[1], keepdims=0)]
    ins = [helper.make_tensor_value_info("x", F, [1, 512, "F"])]
    if random_op:
        nodes = [helper.make_node("ReduceSum", ["x"], ["s"], axes=[1], keepdims=0),
                 helper.make_node("RandomNormalLike", ["s"], ["r"]),
                 helper.make_node("Add", ["s", "r"], ["audio"])]
    if noise_input:
        ins.append(helper.make_tensor_value_info("n", F, [1, "S", 9]))
        nodes.append(helper.make_node("Identity", ["n"], ["n_out"]))
    outs = [helper.make_tensor_value_info("audio", F, [1, "F"])]
    if noise_input:
        outs.append(helper.make_tensor_value_info("n_out", F, [1, "S", 9]))
    model = helper.make_model(helper.make_graph(nodes, "voc", ins, outs), opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    import onnx

    onnx.save(model, str(path))


@pytest.mark.parametrize("random_op,noise_input,given,want", [
    (False, False, None, "none"), (True, False, None, "own"), (False, True, None, "inputs"),
    (False, False, "own", "own"), (True, False, "none", "none")])
def test_a_stage_without_a_random_op_draws_no_noise_unless_the_port_file_says(tmp_path, random_op, noise_input,
                                                                                given, want):
    from harness.port.portfile import load_port

    pytest.importorskip("onnx")
    _vocoder(tmp_path / "voc.onnx", random_op, noise_input)
    ins = "{x: asr, n: sine_noise}" if noise_input else "{x: asr}"
    outs = "{audio: audio, n_out: sine_noise}" if noise_input else "{audio: audio}"
    (tmp_path / "port.yaml").write_text(
        "name: p\nstages:\n  - name: voc\n    artifact: voc.onnx\n" + (f"    noise: {given}\n" if given else "")
        + f"    inputs: {ins}\n    outputs: {outs}\n")
    port = load_port(tmp_path / "port.yaml")
    assert port.stages[0].noise == want
    assert port.found_noise == (set() if given else {"voc"})


def test_a_stage_that_draws_no_noise_is_judged_sample_by_sample():
    """`none` (found or given): the stage's audio against the (zero-noise) reference by its floor,
    so a gain no longer hides in the noise band."""
    from harness.port.noise import noise_inside

    ref = torch.randn(1, 4000, generator=torch.Generator().manual_seed(1))
    drift = ref + 1e-4 * torch.randn(1, 4000, generator=torch.Generator().manual_seed(2))
    refs = {"float32": drift.float(), "float64": ref.double()}
    assert noise_inside(_stage("none")) and not noise_inside(_stage("none", "asr"))
    loud = judge_tensor("audio", ref * 1.5, None, TOL, _stage("none"), refs)
    assert not loud["ok"] and loud["kind"].startswith("constant gain x1.5"), loud
    assert judge_tensor("audio", ref * 1.5, None, TOL, _stage("own"), refs)["ok"]  # the band's, as before
    assert judge_tensor("audio", ref.clone(), None, TOL, _stage("none"), refs)["ok"]
    tail = StageSpec(name="tail", artifact="t.onnx", noise="none", inputs={"h": "decoder.generator.noise_convs.0:in"},
                     outputs={"y": "audio"})
    assert not noise_inside(tail)  # its input carries the case's noise: the plain reference


# ---- the stage table: one word per row, meaning one thing, as the verdict's reason names it ------

def _judged(rel_l2: float, ok: bool, why: str = "", kind: str = "noise-like (SNR 20.0 dB)") -> dict:
    return {"rel_l2": rel_l2, "floor_rel_l2": 1e-6, "ok": ok, "why": why or f"rel_l2 {rel_l2:.2e}", "kind": kind}


def test_each_row_reads_one_word_and_the_defect_is_named_as_the_reason_names_it():
    """front (within) -> a (its own gain: DEFECT) -> b (within locally, a's error chained:
    accumulated) -> voc (draws its own noise: not judged, its chained 1.67 does not read ok)."""
    from harness.record import Record
    from harness.report import item_table

    band = "draws its own noise: judged by the noise band"
    stages = [
        {"stage": "front", "outputs": {"t_en": {"local": _judged(1e-7, True), "chained": _judged(1e-7, True)}}},
        {"stage": "a", "outputs": {"asr": {"local": _judged(0.5, False, kind="constant gain x1.5 (+3.52 dB)"),
                                           "chained": _judged(0.5, False)}}},
        {"stage": "b", "outputs": {"asr": {"local": _judged(1e-7, True), "chained": _judged(0.5, False)}}},
        {"stage": "voc", "outputs": {"audio": {"local": _judged(1.2, True, band), "chained": _judged(1.67, True, band)}}},
    ]
    reason = "b:asr: rel_l2 0.5; first stage whose local error leaves its floor: 'a' (asr: ...)"
    rec = Record("tiny", "port:p", "port", "dynamic", Verdict.FAIL, reason, stages=stages)
    lines = item_table(rec).splitlines()
    words = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in ("front", "a", "b", "voc")}
    assert "within" in words["front"] and "DEFECT" in words["a"] and "constant gain x1.5" in words["a"]
    assert "accumulated" in words["b"] and "DEFECT" not in words["b"]
    assert "not judged: noise band" in words["voc"] and " ok" not in words["voc"]
    assert "defects (local error leaves its floor): a" in lines
    assert not any("LEAVES" in line or "(first)" in line for line in lines)


def test_a_whole_model_row_names_where_the_localization_found_its_defect():
    from harness.record import Record
    from harness.report import item_table

    stages = [{"stage": "whole", "outputs": {"audio": {"local": _judged(0.4, False), "chained": _judged(0.4, False)}}}]
    rec = Record("ja", "e2e", "artifact", "dynamic", Verdict.FAIL, "whole:audio: rel_l2 0.4", stages=stages,
                 bisect={"kind": "onnx-stages", "first_stage": "decoder.generator.istft", "stages": [],
                         "artifact": "m.onnx", "noise": "none drawn"})
    text = item_table(rec)
    assert "defects (local error leaves its floor): whole; localized inside it to decoder.generator.istft" in text
    assert "(first)" not in text


def test_a_whole_model_row_names_every_defect_the_localization_found_in_rank_order():
    from harness.record import Record
    from harness.report import item_table

    stages = [{"stage": "whole", "outputs": {"audio": {"local": _judged(0.4, False), "chained": _judged(0.4, False)}}}]
    rec = Record("ja", "e2e", "artifact", "dynamic", Verdict.FAIL, "whole:audio: rel_l2 0.4", stages=stages,
                 bisect={"kind": "onnx-stages", "first_stage": "decoder.generator.m_source", "stages": [],
                         "artifact": "m.onnx", "noise": "none drawn",
                         "defects": [{"stage": s, "rank": i, "kind": "constant gain", "moves_audio_snr_db": 6.0,
                                      "audio_effect": {}} for i, s in enumerate(("decoder.generator.istft",
                                                                                 "decoder.generator.m_source"), 1)]})
    assert ("localized inside it to decoder.generator.istft, decoder.generator.m_source (ranked by audio effect)"
            in item_table(rec))
