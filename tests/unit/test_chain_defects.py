"""A port chain with more than one defective stage: each defect taken out alone (its stage's
outputs without their own error, the later stages run chained on from there) and ranked by what it
does to the audio, as inside a whole-model ONNX (harness/port/defects.py). Stages are small ONNX
graphs built here on the tiny case of the random model: text (replays t_en) -> a (asr -> asr) ->
voc (asr -> audio, linear in asr: the reference audio times asr's projection on the
reference's)."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import helper, numpy_helper  # noqa: E402

from tests.unit.test_port import F, I64, _save, port_session, replay, transform  # noqa: E402, F401


def vocoder(path: Path, asr: np.ndarray, audio: np.ndarray, gain: float) -> Path:
    """audio = gain * reference audio * <asr, reference asr> / |reference asr|^2; it takes the
    case's initial phases (times zero), so the reference audio with the case's noise judges it."""
    inits = [numpy_helper.from_array((asr / float((asr.astype(np.float64) ** 2).sum())).astype(np.float32), "r"),
             numpy_helper.from_array((gain * audio).astype(np.float32), "base"),
             numpy_helper.from_array(np.zeros((), np.float32), "zero")]
    nodes = [helper.make_node("Mul", ["x", "r"], ["xr"]),
             helper.make_node("ReduceSum", ["xr"], ["p"], keepdims=0),
             helper.make_node("ReduceSum", ["phases"], ["s"], keepdims=0),
             helper.make_node("Mul", ["s", "zero"], ["z"]),
             helper.make_node("Add", ["p", "z"], ["q"]),
             helper.make_node("Mul", ["base", "q"], ["audio"])]
    return _save(path, nodes, [helper.make_tensor_value_info("x", F, list(asr.shape)),
                               helper.make_tensor_value_info("phases", F, [1, 9])],
                 [helper.make_tensor_value_info("audio", F, list(audio.shape))], inits)


def _chain(session, tmp_path: Path, a: str, voc_gain: float) -> Path:
    from harness.port.tensors import reference

    traces = session.traces("tiny")
    chain = traces.chain
    replay(tmp_path / "text.onnx", {"ids": (I64, [1, "T"])}, "t_en", chain["t_en"].numpy())
    transform(tmp_path / "a.onnx", "x", "y", [1, 512, "F"], a)
    vocoder(tmp_path / "voc.onnx", chain["asr"].numpy(), reference("audio", traces, "float32").numpy(), voc_gain)
    path = tmp_path / "port.yaml"
    path.write_text("name: ranked\nstages:\n"
                    "  - {name: text, artifact: text.onnx, inputs: {ids: input_ids}, outputs: {t_en: t_en}}\n"
                    "  - {name: a, artifact: a.onnx, inputs: {x: asr}, outputs: {y: asr}}\n"
                    "  - {name: voc, artifact: voc.onnx, inputs: {x: asr, phases: rand_ini}, outputs: {audio: audio}}\n")
    return path


def _run_counting(session, spec: str, monkeypatch) -> tuple:
    """The item's record and the roles of every stage run."""
    import harness.port.chain as chain_mod

    roles, run = [], chain_mod.run_stage

    def counted(session, port, stage, values, rec, item, role, *a, **k):
        roles.append((stage.name, role))
        return run(session, port, stage, values, rec, item, role, *a, **k)

    monkeypatch.setattr(chain_mod, "run_stage", counted)
    (item,) = chain_mod.port_items(session, [spec])
    return chain_mod.run_port_item(session, item), roles


@pytest.mark.slow  # no export, but the tiny case's references (minutes on two shared cores), as test_port's chains
def test_two_defects_in_a_chain_are_ranked_by_their_audio_effect(port_session, tmp_path, monkeypatch):
    """`a` x1.5 and `voc` x-1: with both, the audio is -1.5 times the reference's. Without `a`'s
    gain it is -1 times (moved by SNR 20 log10(1 / 0.5) = 6.02 dB); without `voc`'s sign flip,
    +1.5 times (moved by 20 log10(1.5 / 3) = -6.02 dB): `voc` is named first though it comes
    later in the chain. Only the stages after `a` run again (voc, once)."""
    from harness.report import item_table
    from harness.verdict import Verdict

    rec, roles = _run_counting(port_session, str(_chain(port_session, tmp_path, "gain", -1.0)), monkeypatch)
    assert rec.verdict is Verdict.FAIL, rec.reason
    assert [r for r in roles if r[1].startswith("without-")] == [("voc", "without-a")], (roles, rec.stages)
    rows = {r["stage"]: r for r in rec.stages}
    assert not rows["a"]["local_ok"] and not rows["voc"]["local_ok"] and rows["text"]["local_ok"]
    assert rows["voc"]["defect"]["rank"] == 1 and rows["a"]["defect"]["rank"] == 2, rows
    assert "defect" not in rows["text"]
    voc, a = rows["voc"]["defect"], rows["a"]["defect"]
    assert math.isclose(voc["moves_audio_snr_db"], -6.02, abs_tol=0.05), voc
    assert math.isclose(a["moves_audio_snr_db"], 6.02, abs_tol=0.05), a
    # to the reference: -1.5x is 20 log10(1 / 2.5) = -7.96 dB; +1.5x 6.02 dB; -1x -6.02 dB
    assert math.isclose(voc["audio_effect"]["snr_db"]["with"], -7.96, abs_tol=0.05), voc
    assert math.isclose(voc["audio_effect"]["snr_db"]["without"], 6.02, abs_tol=0.05), voc
    assert math.isclose(a["audio_effect"]["snr_db"]["without"], -6.02, abs_tol=0.05), a
    assert "2 defects: voc (sign flip" in rec.reason and "; a (constant gain x1.5" in rec.reason, rec.reason
    assert "moves the audio by SNR -6.02 dB (SNR to the reference -7.96 -> 6.02 dB" in rec.reason, rec.reason
    assert "first stage whose local error" not in rec.reason, rec.reason
    print(f"\n{rec.reason}")  # `-s`: the measured ranking
    assert "ranked by audio effect: voc, a" in item_table(rec), item_table(rec)


@pytest.mark.slow
def test_a_single_defect_in_a_chain_runs_nothing_more(port_session, tmp_path, monkeypatch):
    from harness.verdict import Verdict

    rec, roles = _run_counting(port_session, str(_chain(port_session, tmp_path, "gain", 1.0)), monkeypatch)
    assert rec.verdict is Verdict.FAIL, rec.reason
    assert not [r for r in roles if r[1] not in ("local", "chained")], roles
    assert "first stage whose local error leaves its floor: 'a'" in rec.reason, rec.reason
    assert not any("defect" in r for r in rec.stages)


def test_defects_are_scored_alike_nonfinite_first_unmeasured_last_with_why():
    """defects.score_defects, the one scoring of a chain's and a whole-model ONNX's defects."""
    from harness.port.defects import defects_reason, score_defects

    want = np.sin(np.arange(4800) / 7.0)
    found = [{"stage": s, "kind": k, "local_rel_l2": 0.5, "floor_rel_l2": 1e-6, "nonfinite": s == "nan"}
             for s, k in (("front", "constant gain x1.5 (+3.52 dB)"), ("glue:aln", "shift by +1 samples"),
                          ("voc", "sign flip"), ("nan", "NaN/Inf (3 values)"))]
    found[1]["unranked"] = "a host glue's value is computed where a stage reads it: not fed in its place"
    pairs = {"front": (-1.5 * want, -want), "voc": (-1.5 * want, 1.5 * want)}
    ranked = score_defects(found, pairs, want)
    assert [d["stage"] for d in ranked] == ["nan", "voc", "front", "glue:aln"]
    assert [d["rank"] for d in ranked] == [1, 2, 3, 4]
    assert math.isclose(ranked[1]["moves_audio_snr_db"], -6.02, abs_tol=0.01)
    assert math.isclose(ranked[2]["audio_effect"]["snr_db"]["without"], -6.02, abs_tol=0.01)
    reason = defects_reason(ranked)
    assert reason.startswith("4 defects: nan (NaN/Inf (3 values); audio effect not measured); "
                             "voc (sign flip; moves the audio by SNR -6.02 dB (SNR to the reference -7.96 -> 6.02 dB"), \
        reason
    assert reason.endswith("glue:aln (shift by +1 samples; not ranked: a host glue's value is computed where a stage "
                           "reads it: not fed in its place)"), reason
