"""A port stage's own references (issue 21 point 2): a bucketed stage judged against Kokoro's
reference padded to the bucket it ran (its exact-length drift reported beside it), and a
`precision: float16` stage judged against the float16 floor (float16 eager's own error)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from harness.port import splits
from harness.reference import BoundaryError, _stage_plan


def test_a_stage_reference_is_planned_from_its_inputs():
    """Prosody (d, aln, ... -> F0, N, asr) runs en = d^T aln, f0n, the text encoder and asr = t_en aln;
    a stage that starts inside a module has no reference computation: one clear error."""
    have = {"d", "aln", "s_pred", "input_ids", "input_lengths", "text_mask", "frame_lengths"}
    plan = _stage_plan(have, ("F0_pred", "N_pred", "asr"))
    assert plan == [("glue", "en"), ("step", "f0n"), ("step", "text_encoder"), ("glue", "asr")]
    # the synthesizer's own inputs: its fused step (it gives the length-aware modules their lengths)
    synth = have | {"s_dec", "rand_ini", "sine_noise", "source_noise"}
    assert _stage_plan(synth, ("audio",)) == [("step", "synthesizer")]
    with pytest.raises(BoundaryError, match=r"audio cannot be recomputed .*starts inside a module: "
                                            r"decoder\.generator\.conv_post:out"):
        _stage_plan({splits.CONV_POST, "s_dec", "input_ids"}, ("audio",))


# ---- on the tiny case of the random model --------------------------------------------------------

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("buckets"), run_s=300) as s:
        yield s


def _export(session, out: Path, defect=None, only=None) -> Path:
    from harness.reference import module_captures

    if defect is None and only is None:
        return clean_split(session, "kokoro-3stage", out)
    traces = session.traces("tiny")
    module_captures(session.model, session.cases["tiny"], traces, (splits.HAR, splits.CONV_POST))
    return splits.export_split("kokoro-3stage", session.model, traces, out,
                               splits.parse_defect(defect, "kokoro-3stage"), log=lambda line: None, only=only)


def clean_split(session, split: str, out: Path, case_id: str = "tiny") -> Path:
    """`split` exported clean from the session's model on `case_id` into `out` (its port file
    returned): exported once per test run, beside the run's shared references (keyed by the model,
    the case and the split; file-locked), and copied here; the tests of this file and of
    test_port_examples judge the same clean chain."""
    import hashlib
    import os

    from harness.plumbing.cache import lock
    from harness.reference import module_captures
    from tests.unit.conftest import REFERENCES_ENV

    shared = os.environ.get(REFERENCES_ENV)
    traces = session.traces(case_id)
    module_captures(session.model, session.cases[case_id], traces, (splits.HAR, splits.CONV_POST))
    if not shared:
        return splits.export_split(split, session.model, traces, out, None, log=lambda line: None)
    key = hashlib.sha256(repr((split, session.model.name, session.cases[case_id])).encode()).hexdigest()[:16]
    done = Path(shared) / "splits" / key
    with lock(done):
        if not (done / ".complete").exists():
            shutil.rmtree(done, ignore_errors=True)
            splits.export_split(split, session.model, traces, done, None, log=lambda line: None)
            (done / ".complete").write_text("ok\n")
    shutil.copytree(done, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".complete"))
    return out / "port.yaml"


def _prosody(port: Path, extra: str) -> Path:
    """The port file with its prosody stage changed: `extra` lines added after its artifact."""
    text = port.read_text()
    text = re.sub(r"(  - name: prosody\n    artifact: )prosody\.onnx\n", r"\g<1>" + extra.replace("\\", "\\\\"), text)
    port.write_text(text)
    return port


def _run(session, port: Path):
    from harness.port.chain import port_items, run_port_item

    (item,) = port_items(session, [str(port)])
    rec = run_port_item(session, item)
    return rec, {r["stage"]: r for r in rec.stages}


@pytest.mark.slow
def test_a_bucketed_stage_is_judged_against_its_padded_reference(tiny, tmp_path):
    """The 3-stage prosody run at a frame bucket larger than the case (aln padded with zero frames):
    correct, it passes against the reference padded to that bucket, while its exact-length error
    and the padding's own drift are reported beside it (Kokoro's InstanceNorms average over the
    bucket: against the exact-length reference the same stage would leave its floor); exported
    with a gain, it still fails."""
    from harness.verdict import Verdict

    frames = tiny.traces("tiny").valid.frames
    bucket = frames + 24
    clean = _export(tiny, tmp_path / "clean")
    shutil.copy(tmp_path / "clean" / "prosody.onnx", tmp_path / "clean" / f"prosody_{bucket}.onnx")
    port = _prosody(clean, f"prosody_{{frames}}.onnx\n    buckets: [{bucket}]\n")
    rec, rows = _run(tiny, port)
    row = rows["prosody"]
    assert row["bucket"] == {"local": bucket, "chained": bucket}, row
    assert row["reference"] == f"judged against the reference padded to bucket {bucket}"
    assert rec.verdict is Verdict.PASS, rec.reason
    assert row["local_ok"] and row["chained_ok"], row
    f0 = row["outputs"]["F0_pred"]["local"]
    assert f0["reference"] == f"padded to bucket {bucket}"
    # the padding moves Kokoro far beyond its noise floor: judged exact-length, it would leave it
    assert f0["rewrite_drift_rel_l2"] > 10 * f0["floor_rel_l2"], f0
    assert f0["exact_rel_l2"] > 4 * f0["floor_rel_l2"] and f0["rel_l2"] <= 4 * f0["floor_rel_l2"], f0

    shutil.copytree(tmp_path / "clean", tmp_path / "loud")
    _export(tiny, tmp_path / "loud", "prosody=gain:1.1", only={"prosody"})
    shutil.copy(tmp_path / "loud" / "prosody.onnx", tmp_path / "loud" / f"prosody_{bucket}.onnx")
    loud = _prosody(tmp_path / "loud" / "port.yaml", f"prosody_{{frames}}.onnx\n    buckets: [{bucket}]\n")
    rec, rows = _run(tiny, loud)
    assert rec.verdict is Verdict.FAIL
    assert "first stage whose local error leaves its floor: 'prosody'" in rec.reason, rec.reason
    kind = rows["prosody"]["outputs"]["F0_pred"]["local"]["kind"]
    assert kind.startswith("constant gain x1.1"), kind


@pytest.mark.slow
def test_a_float16_stage_is_judged_by_the_float16_floor(tiny, tmp_path):
    """The prosody stage exported with its float inputs rounded to float16: declared float32 it
    leaves its fp32 floor; declared `precision: float16` it is judged against float16 eager's own
    error (the row says so, the fp32 floor beside it) and passes; a gain still fails it."""
    from harness.verdict import Verdict

    _export(tiny, tmp_path / "clean")
    shutil.copytree(tmp_path / "clean", tmp_path / "half")
    half = _export(tiny, tmp_path / "half", "prosody=fp16_inputs", only={"prosody"})
    rec, rows = _run(tiny, half)
    assert not rows["prosody"]["local_ok"], rec.reason

    _prosody(half, "prosody.onnx\n    precision: float16\n")
    rec, rows = _run(tiny, half)
    row = rows["prosody"]
    assert row["precision"] == "float16" and row["local_ok"], row
    for out in ("F0_pred", "N_pred", "asr"):
        m = row["outputs"][out]["local"]
        assert m["floor_precision"] == "float16" and m["floor_rel_l2"] == m["fp16_floor_rel_l2"], m
        assert m["fp16_floor_rel_l2"] > m["fp32_floor_rel_l2"] > 0, m
    # (an output within the absolute tolerance says so instead of naming a floor)
    assert any("float16 floor" in row["outputs"][o]["local"]["why"] for o in ("F0_pred", "N_pred")), row
    assert rows["duration"]["local_ok"] and rec.verdict is Verdict.PASS, rec.reason

    shutil.copytree(tmp_path / "clean", tmp_path / "loud")
    loud = _export(tiny, tmp_path / "loud", "prosody=gain:1.5", only={"prosody"})
    _prosody(loud, "prosody.onnx\n    precision: float16\n")
    rec, rows = _run(tiny, loud)
    assert rec.verdict is Verdict.FAIL and not rows["prosody"]["local_ok"], rec.reason
