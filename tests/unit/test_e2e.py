"""The e2e item, the harness's own two-stage port (harness/data/ports/e2e.yaml) run by the port
chain: its port file, bucket choice, padding and trimming, host alignment, the audio verdict; and
(slow, the tiny case of the random model) whole items: the stage rows, durations forced when they
differ, a NaN failing the audio, a real backend's static item."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from harness.e2e import alignment, e2e_port
from harness.port.chain import choose_buckets, pad_to_bucket, trim
from harness.port.portfile import PortError
from harness.reference import SYNTH_BUCKETS, Lengths
from harness.steps import get_step
from harness.verdict import Tolerance, Verdict, judge


def test_the_e2e_port_is_the_two_harness_steps():
    port = e2e_port()
    dur, synth = port.stages
    assert (dur.step, synth.step) == ("duration_stage", "synthesizer") and dur.artifact is None
    for stage in port.stages:  # every step input and output mapped to the Kokoro tensor of its name
        step = get_step(stage.step)
        assert {k: v.tensor for k, v in stage.inputs.items()} == {n: n for n in step.input_names}
        assert {k: v.tensor for k, v in stage.outputs.items()} == {n: n for n in step.output_names}
    assert dur.bucket_units == {"tokens": "case"}
    assert synth.bucket_units == {"tokens": "case", "frames": list(SYNTH_BUCKETS)}  # the reference's buckets


def test_smallest_frame_bucket_that_fits():
    synth = e2e_port().stages[1]
    assert [synth.bucket_for(f, "frames") for f in (1, 120, 121, 1600)] == [120, 120, 200, 1600]
    with pytest.raises(PortError, match="stage 'synthesizer', field 'buckets': 1601 frames exceed the largest bucket 1600"):
        synth.bucket_for(1601, "frames")


def _traces(tokens=6, frames=36, bucket_tokens=8):
    """What bucketing reads of a case's traces: its valid lengths, its buckets, its noise draw."""
    g = torch.Generator().manual_seed(0)
    chain = {"case_sine_noise": torch.randn(1, 1600 * 600, 9, generator=g),
             "case_source_noise": torch.randn(1, 1600 * 600, 1, generator=g)}
    return SimpleNamespace(valid=Lengths(tokens, frames), bucket=Lengths(bucket_tokens, 128), chain=chain)


def test_static_synthesizer_inputs_are_padded_to_the_case_tokens_and_the_frame_bucket():
    traces, synth = _traces(), e2e_port().stages[1]
    aln = alignment(torch.tensor([6, 6, 6, 6, 6, 6]), 6, 36)
    values = {"d": torch.randn(1, 6, 640), "aln": aln, "input_ids": torch.arange(1, 7)[None],
              "text_mask": torch.zeros(1, 6, dtype=torch.bool), "input_lengths": torch.tensor([6]),
              "frame_lengths": torch.tensor([36]), "sine_noise": traces.chain["case_sine_noise"][:, :36 * 600]}
    chosen = choose_buckets(synth, values, traces)
    assert chosen == {"tokens": 8, "frames": 120}
    padded = pad_to_bucket(synth, values, chosen, traces)
    assert padded["aln"].shape == (1, 8, 120) and padded["aln"][0, :6, :36].equal(aln[0])
    assert padded["aln"][0, 6:].sum() == 0 and padded["aln"][0, :, 36:].sum() == 0  # zero rows and columns
    assert padded["d"].shape == (1, 8, 640) and padded["d"][0, 6:].abs().sum() == 0
    assert padded["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6, 0, 0]
    assert padded["text_mask"][0].tolist() == [False] * 6 + [True] * 2  # padding is masked
    assert padded["input_lengths"].tolist() == [6] and padded["frame_lengths"].tolist() == [36]  # valid lengths
    assert padded["sine_noise"].equal(traces.chain["case_sine_noise"][:, :120 * 600])  # the bucket's own prefix
    audio = torch.randn(1, 120 * 600)
    assert trim("audio", audio, {"samples": 36 * 600}).equal(audio[:, :36 * 600])  # the padding trimmed
    long = {**values, "aln": alignment(torch.full((6,), 30), 6, 180)}
    assert choose_buckets(synth, long, traces)["frames"] == 200
    with pytest.raises(PortError, match=r"stage 'synthesizer', field 'buckets': 9 tokens exceed the case's bucket \(8\)"):
        choose_buckets(synth, {**values, "input_ids": torch.arange(9)[None]}, traces)


def test_alignment_is_one_hot_with_zero_padding():
    pred = torch.tensor([2, 1, 3])
    aln = alignment(pred, n_tokens_total=5, n_frames_total=8)
    assert aln.shape == (1, 5, 8)
    assert aln[0, :, :6].sum(0).eq(1).all()  # each valid frame belongs to exactly one token
    assert aln[0].sum(1).tolist() == [2, 1, 3, 0, 0] and aln[0, :, 6:].sum() == 0


def audio(pesq=4.5, mcd=0.1, nan=0.0):
    return {"pesq": pesq, "mcd_db": mcd, "nan_rate": nan, "inf_rate": 0.0}


def test_audio_quality_bars():
    tol = Tolerance()
    clean = {"audio": {"rel_l2": 0.01, "floor_rel_l2": 0.01, "nan_rate": 0, "inf_rate": 0, "new_nonfinite": 0}}
    assert judge(clean, tol, {"audio": audio()}, audio_only=True)[0] is Verdict.PASS
    v, why = judge(clean, tol, {"audio": audio(pesq=3.2)}, audio_only=True)
    assert v is Verdict.FAIL and "PESQ 3.20 < 4.0" in why
    assert judge(clean, tol, {"audio": audio(mcd=0.9)}, audio_only=True)[0] is Verdict.FAIL
    assert judge(clean, tol, {"audio": audio(pesq=math.nan)}, audio_only=True)[0] is Verdict.FAIL
    assert judge(clean, Tolerance(min_pesq=3.0), {"audio": audio(pesq=3.2)}, audio_only=True)[0] is Verdict.PASS
    # the unforced audio (other durations) is reported, not judged
    assert judge(clean, tol, {"audio": audio(), "audio_unforced": audio(pesq=1.0)}, audio_only=True)[0] is Verdict.PASS


def test_audio_only_still_fails_on_nan():
    bad = {"audio": {"rel_l2": math.nan, "nan_rate": 1.0, "inf_rate": 0, "new_nonfinite": 10}}
    assert judge(bad, Tolerance(), {"audio": audio()}, audio_only=True)[0] is Verdict.FAIL


# ---- slow: whole e2e items on the tiny case of the random model --------------------------------

@pytest.fixture(scope="module")
def e2e_session(tmp_path_factory):
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("e2e"), run_s=600) as s:
        yield s


_PATCHED: dict = {}  # (model, patches) -> the patched model: a deep copy of 82M parameters each
_RUNS: dict = {}  # (model, patches, step) -> [(inputs, outputs)]: eager on the same inputs, the same values


@pytest.fixture(scope="module", autouse=True)
def forget_the_modules_runs():
    """The patched models and runs are this module's: about 2.4 GB that a worker would otherwise
    keep for the rest of the suite."""
    yield
    _PATCHED.clear()
    _RUNS.clear()


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x.dtype, x.shape) == (y.dtype, y.shape) and torch.equal(x, y) if isinstance(x, torch.Tensor)
        else type(x) is type(y) and x == y for x, y in zip(a, b))


def in_process(session, calls: list, defect=None):
    """`Session.execute` run in this process by eager PyTorch on the item's patched model, the
    backend's outputs optionally changed by `defect(step, outputs)`: the chain, its buckets and the
    e2e verdict are the code under test, a known defect the input (the real export and compile
    path: test_a_real_backends_static_item). The module's items share each patched model, and a
    step run again on equal inputs by the same patched model gives the values it gave (eager is
    deterministic), so those are computed once for the module."""
    import time

    from harness.patches import apply_patches

    def execute(backend, step, inputs, patches, rec, run_name, tag=""):
        start = time.perf_counter()
        key = (session.model.kmodel, tuple(patches))
        if key not in _PATCHED:
            _PATCHED[key] = apply_patches(session.model.kmodel, patches)
        args = list(inputs.values())
        runs = _RUNS.setdefault((*key, step), [])
        out = next((o for a, o in runs if _same(a, args)), None)
        if out is None:
            with torch.no_grad():
                out = get_step(step).module(_PATCHED[key])(*args)
            out = list(out) if isinstance(out, (tuple, list)) else [out]
            runs.append(([a.clone() if isinstance(a, torch.Tensor) else a for a in args], out))
        out = [o.clone() if isinstance(o, torch.Tensor) else o for o in out]  # the kept values never change
        rec.timings[f"{tag}run_s"] = time.perf_counter() - start
        calls.append((step, tag, {k: tuple(v.shape) for k, v in inputs.items()}))
        return defect(step, out) if defect else out

    return execute


def _run(session, monkeypatch, mode, defect=None):
    from harness.runner import Item

    calls = []
    monkeypatch.setattr(session, "execute", in_process(session, calls, defect))
    return session.run(Item("tiny", "e2e", "eager", mode)), calls


@pytest.mark.slow
def test_an_e2e_item_has_a_row_per_stage_judged_locally_and_chained(e2e_session, monkeypatch):
    traces = e2e_session.traces("tiny")
    tokens, frames = traces.valid.tokens, traces.valid.frames
    for mode in ("dynamic", "static"):
        rec, calls = _run(e2e_session, monkeypatch, mode)
        assert rec.item_id == f"tiny-e2e-eager-{mode}" and rec.verdict is Verdict.PASS, rec.reason
        assert [r["stage"] for r in rec.stages] == ["duration_stage", "synthesizer"]
        assert [r["step"] for r in rec.stages] == ["duration_stage", "synthesizer"]
        assert set(rec.stages[0]["outputs"]) == {"duration", "d"} and set(rec.stages[1]["outputs"]) == {"audio"}
        for row in rec.stages:
            assert isinstance(row["local_ok"], bool) and isinstance(row["chained_ok"], bool)
            for m in row["outputs"].values():
                assert m["local"]["rel_l2"] >= 0 and m["chained"]["rel_l2"] >= 0 and "kind" in m["chained"]
        # the duration stage runs once (its local run is the app's), the synthesizer locally and chained
        assert [(step, tag) for step, tag, _ in calls] == [("duration_stage", "duration_stage.local."),
                                                           ("synthesizer", "synthesizer.local."),
                                                           ("synthesizer", "synthesizer.chained.")]
        synth_in = calls[2][2]
        bucket = 120 if mode == "static" else frames
        assert synth_in["aln"] == (1, 8 if mode == "static" else tokens, bucket)
        assert synth_in["sine_noise"] == (1, bucket * 600, 9) and calls[0][2]["input_ids"][1] == synth_in["aln"][1]
        assert rec.durations == {"tokens": tokens, "tokens_differ": 0, "max_frames_diff": 0, "frames_backend": frames,
                                 "frames_reference": frames, "bucket_backend": bucket}
        assert rec.audio_metrics["audio"]["duration_s"] == frames * 600 / 24000  # the padding trimmed
        assert set(rec.audio) == {"reference", "backend"} and "audio_unforced" not in rec.audio_metrics
        assert set(rec.metrics) == {"audio"}  # the verdict is the audio's
        assert rec.real_time["run_s"] == pytest.approx(rec.timings["duration_stage.local.run_s"]
                                                       + rec.timings["synthesizer.chained.run_s"])
        if mode == "static":
            assert rec.stages[1]["bucket"] == {"local": 120, "chained": 120}
        else:  # exact lengths on an exact backend: every stage at its floor
            assert all(r["local_ok"] and r["chained_ok"] for r in rec.stages), rec.stages
            assert rec.metrics["audio"]["floor_ratio"] == pytest.approx(1, abs=0.01)


@pytest.mark.slow
def test_a_length_aware_static_item_is_judged_by_a_length_aware_stage_reference(e2e_session, monkeypatch):
    """With both length-aware patches the static program computes the exact lengths' semantics on its
    bucket; its stage's padded reference must too (the fused synthesizer step, which gives the modules
    the frame lengths, not f0n + decoder): every stage at its floor, as in the dynamic mode."""
    monkeypatch.setattr(e2e_session, "extra_patches", ("length_aware_lstm", "length_aware_norm"))
    rec, _ = _run(e2e_session, monkeypatch, "static")
    assert rec.verdict is Verdict.PASS, rec.reason
    assert rec.stages[1]["bucket"] == {"local": 120, "chained": 120}
    assert all(r["local_ok"] and r["chained_ok"] for r in rec.stages), rec.stages
    assert rec.stages[1]["outputs"]["audio"]["local"]["rel_l2"] < 1e-5


@pytest.mark.slow
def test_a_backend_that_compiles_here_but_cannot_run_converts_every_stage(e2e_session, monkeypatch):
    """Core ML off macOS: the duration stage converts and cannot run; the synthesizer is still
    converted (on the reference's inputs), so the item says every stage converts; a stage that does
    not convert is the verdict."""
    from harness.runner import Item

    calls = []

    def execute(backend, step, inputs, patches, rec, run_name, tag=""):
        calls.append(step)
        if step == "synthesizer" and fail_synth:
            rec.verdict, rec.reason = Verdict.COMPILE_ERROR, "Unsupported fx node and_1"
        else:
            rec.verdict, rec.reason = Verdict.SKIPPED, "compiled; Core ML prediction needs macOS (this is Linux)"
        return None

    monkeypatch.setattr(e2e_session, "execute", execute)
    fail_synth = False
    rec = e2e_session.run(Item("tiny", "e2e", "eager", "dynamic"))
    assert calls == ["duration_stage", "synthesizer"]
    assert rec.verdict is Verdict.SKIPPED and "needs macOS" in rec.reason
    assert rec.reason.endswith("every stage compiled: duration_stage, synthesizer"), rec.reason
    calls.clear()
    fail_synth = True
    rec = e2e_session.run(Item("tiny", "e2e", "eager", "dynamic"))
    assert calls == ["duration_stage", "synthesizer"]
    assert rec.verdict is Verdict.COMPILE_ERROR and "Unsupported fx node" in rec.reason


@pytest.mark.slow
def test_durations_that_differ_are_forced_in_the_judged_audio(e2e_session, monkeypatch, tmp_path):
    """A backend whose second duration rounds one frame longer: the synthesizer's local run (the
    reference's durations) is judged and passes; the app's longer audio is reported beside it."""
    def one_frame_longer(step, out):
        if step == "duration_stage":
            out[0] = out[0].clone()
            out[0][0, 1] += 1.0
        return out

    rec, _ = _run(e2e_session, monkeypatch, "dynamic", one_frame_longer)
    frames = e2e_session.traces("tiny").valid.frames
    assert rec.verdict is Verdict.PASS, rec.reason
    assert f"1 of {e2e_session.traces('tiny').valid.tokens} durations differ from the reference (judged with them forced" in rec.reason
    assert rec.durations["tokens_differ"] == 1 and rec.durations["frames_backend"] == frames + 1
    assert rec.durations["bucket_forced"] == frames and rec.durations["bucket_backend"] == frames + 1
    assert rec.audio_metrics["audio_unforced"]["length_ratio"] == pytest.approx((frames + 1) / frames, rel=1e-3)
    assert set(rec.audio) == {"reference", "backend", "backend-forced"}
    dur, synth = rec.stages
    assert not dur["local_ok"] and dur["outputs"]["duration"]["local"]["rel_l2"] > 0.01
    assert synth["local_ok"] and not synth["chained_ok"]  # forced: clean; chained: one frame longer
    assert synth["outputs"]["audio"]["chained"]["kind"] == "length +600 samples"


@pytest.mark.slow
def test_a_float16_backends_e2e_item_is_judged_by_the_float16_floor_and_says_shippable(e2e_session, monkeypatch):
    """As a float16 step: the verdict against float16 eager's own e2e error (the duration stage in
    float16 feeding the synthesizer its `d`), the fp32 floor beside it, the audio bars and the
    durations as `shippable`. The random model's float16 SineGen overflows (as the real en_long's
    does): no float16 floor, so a finite result is "better than float16 allows" and what decides is
    `shippable`; a NaN passes neither."""
    from harness.e2e import float16_floor_audio
    from harness.runner import Item

    half_level = lambda step, out: [o * 0.5 for o in out] if step == "synthesizer" else out  # noqa: E731
    for defect, ships, why in ((None, True, "<= tolerance"), (half_level, False, "finite where float16 eager is not")):
        monkeypatch.setattr(e2e_session, "execute", in_process(e2e_session, [], defect))
        rec = e2e_session.run(Item("tiny", "e2e", "fp16", "dynamic"))
        m = rec.metrics["audio"]
        assert rec.precision == "float16" and m["floor_precision"] == "float16"
        assert m["fp16_floor_nan_rate"] > 0 and math.isnan(m["floor_rel_l2"]) and m["fp32_floor_rel_l2"] < 1e-4
        assert rec.verdict is Verdict.PASS and why in rec.reason, rec.reason
        assert rec.shippable is ships, rec.shippable_reason
        assert "durations: 0 of" in rec.shippable_reason
    floor = float16_floor_audio(e2e_session, "tiny", ())
    assert floor.shape[-1] == e2e_session.traces("tiny").valid.frames * 600  # cached, the exact lengths
    monkeypatch.setattr(e2e_session, "execute", in_process(e2e_session, [], lambda step, out: [
        o.clone().index_fill_(-1, torch.tensor([100]), math.nan) for o in out] if step == "synthesizer" else out))
    rec = e2e_session.run(Item("tiny", "e2e", "fp16", "dynamic"))
    assert rec.verdict is Verdict.FAIL and rec.shippable is False


@pytest.mark.slow
def test_a_nan_in_the_audio_fails_the_item_at_the_synthesizer(e2e_session, monkeypatch):
    def nan(step, out):
        if step == "synthesizer":
            out[0] = out[0].clone()
            out[0][0, 100] = math.nan
        return out

    rec, _ = _run(e2e_session, monkeypatch, "dynamic", nan)
    assert rec.verdict is Verdict.FAIL and "non-finite" in rec.reason
    assert "first stage whose local error leaves its floor: 'synthesizer'" in rec.reason, rec.reason
    assert rec.stages[0]["local_ok"] and not rec.stages[1]["local_ok"]


@pytest.mark.slow
def test_a_real_backends_static_item(e2e_session):
    """The eager control backend through export, compile and run in child processes (the cache):
    the static e2e item passes with its bucketed programs, one per stage and bucket."""
    from harness.runner import Item

    rec = e2e_session.run(Item("tiny", "e2e", "eager", "static"))
    assert rec.verdict is Verdict.PASS, rec.reason
    assert [r["stage"] for r in rec.stages] == ["duration_stage", "synthesizer"]
    assert rec.stages[1]["bucket"] == {"local": 120, "chained": 120}
    assert {"duration_stage.local.program", "synthesizer.local.program", "synthesizer.chained.program"} <= set(rec.cache)
    assert rec.cache["synthesizer.chained.program"] == "hit"  # the same bucket as the local run: one export
    assert rec.real_time["run_s"] == pytest.approx(rec.timings["duration_stage.local.run_s"]
                                                   + rec.timings["synthesizer.chained.run_s"])
    assert (e2e_session.report_dir / rec.audio["backend"]).is_file()


def test_a_stage_of_the_e2e_item_is_not_an_item_of_its_own(tmp_path):
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path) as s:
        with pytest.raises(ValueError, match="--step synthesizer: a stage of the e2e item.*--step e2e"):
            s.items(["eager"], ["synthesizer"])
        with pytest.raises(ValueError, match="--step nope: unknown step; steps: bert"):
            s.items(["eager"], ["nope"])
        assert [i.step for i in s.items(["eager"], ["e2e"], ("dynamic",))] == ["e2e"]
