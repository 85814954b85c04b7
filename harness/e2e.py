"""The `e2e` item: tokens to audio the way working ports run Kokoro.

Kokoro cannot be exported whole (the alignment's shape depends on the predicted durations), so
ports run two programs: a *duration stage* (bert .. duration), the alignment built on the host
from *its* durations, and a *synthesizer* (f0n, text_encoder, decoder). In `static` mode this is
the bucketed pipeline of the ports: the token bucket, and a synthesizer compiled per frame bucket
(the smallest of SYNTH_BUCKETS that fits, inputs padded, padding trimmed from the audio). In
`dynamic` mode both programs get the exact lengths, so the item measures the backend alone:
Kokoro's synthesizer is not padding-invariant (its InstanceNorms average over the bucket), and
the static item's error includes that rewrite. A duration that rounds
differently changes the audio's length and everything after it, so when the backend's durations
differ from the reference's, the synthesizer also runs with the reference durations forced, and
that audio is judged (the unforced one is reported beside it).
"""
from __future__ import annotations

import torch

from .metrics.audio import audio_metrics, write_wav
from .metrics.tensor import compare_to_floor
from .model import SAMPLE_RATE, SAMPLES_PER_FRAME
from .record import Record, real_time
from .reference import SYNTH_BUCKETS, pad_inputs, synthesizer_reference
from .steps import get_step, round_durations
from .verdict import Verdict, judge


def pick_bucket(frames: int, buckets=SYNTH_BUCKETS) -> int:
    fits = [b for b in sorted(buckets) if b >= frames]
    if not fits:
        raise ValueError(f"{frames} frames exceed the largest synthesizer bucket ({max(buckets)})")
    return fits[0]


def alignment(pred_dur: torch.Tensor, n_tokens_total: int, n_frames_total: int) -> torch.Tensor:
    """One-hot [1, tokens, frames]; padded tokens and frames are zero rows and columns."""
    frames = int(pred_dur.sum())
    aln = torch.zeros(1, n_tokens_total, n_frames_total)
    aln[0, torch.repeat_interleave(torch.arange(len(pred_dur)), pred_dur), torch.arange(frames)] = 1
    return aln


def run_e2e(session, r, rec: Record) -> Record:
    """Run the two stages of a resolved e2e item (harness.runner.Resolved) and judge its audio."""
    from .patches import affecting
    from .reference import NEUTRAL_PATCHES, REFERENCE_PATCHES

    item, backend, patches, case, traces = r.item, r.backend, r.patches, r.case, r.traces
    chain, n = traces.chain, traces.valid.tokens
    stage = get_step("duration_stage")
    tokens = ({k: chain[k] for k in stage.input_names} if item.mode == "dynamic"
              else pad_inputs(stage, chain, traces.valid, traces.bucket))
    out = session.execute(backend, "duration_stage", tokens, patches, rec, f"{item.id}/duration_stage", "duration_stage.")
    if out is None:
        return rec
    duration, d = out
    pred = round_durations(duration, n)
    pred_ref = torch.tensor(traces.pred_dur)
    differ = int((pred != pred_ref).sum())
    rec.durations = {"tokens": n, "tokens_differ": differ, "max_frames_diff": int((pred - pred_ref).abs().max()),
                     "frames_backend": int(pred.sum()), "frames_reference": int(pred_ref.sum())}

    def synthesize(pred_dur: torch.Tensor, role: str) -> torch.Tensor | None:
        frames = int(pred_dur.sum())
        bucket = frames if item.mode == "dynamic" else pick_bucket(frames)
        rec.durations[f"bucket_{role}"] = bucket
        inputs = {"d": d, "aln": alignment(pred_dur, d.shape[1], bucket), "input_ids": tokens["input_ids"],
                  "input_lengths": tokens["input_lengths"], "text_mask": tokens["text_mask"],
                  "s_pred": tokens["s_pred"], "s_dec": chain["s_dec"],
                  "frame_lengths": torch.tensor([frames]), "rand_ini": chain["case_rand_ini"],
                  "sine_noise": chain["case_sine_noise"][:, : bucket * SAMPLES_PER_FRAME].contiguous(),
                  "source_noise": chain["case_source_noise"][:, : bucket * SAMPLES_PER_FRAME].contiguous()}
        out = session.execute(backend, "synthesizer", inputs, patches, rec, f"{item.id}/synthesizer-{role}",
                              f"synthesizer{bucket}.")
        return None if out is None else out[0][:, : frames * SAMPLES_PER_FRAME]

    audio = synthesize(pred, "backend")
    if audio is None:
        return rec
    rec.real_time = real_time(rec.timings.get("duration_stage.run_s", 0.0) +  # both programs, the backend's durations
                              rec.timings.get(f"synthesizer{rec.durations['bucket_backend']}.run_s", 0.0),
                              audio.shape[-1] / SAMPLE_RATE)
    forced = synthesize(pred_ref, "forced") if differ else audio
    if forced is None:
        return rec

    variant = affecting([p for p in patches if p not in REFERENCE_PATCHES["dynamic"] and p not in NEUTRAL_PATCHES],
                        "synthesizer")
    ref = synthesizer_reference(session.model, case, traces, variant)
    ref32, ref64 = ref["float32"], ref["float64"]
    rec.metrics["audio"] = compare_to_floor(forced, ref32, ref64)
    rec.audio_metrics["audio"] = {**audio_metrics(ref64[0].numpy(), forced[0].numpy()),
                                  "duration_s": forced.shape[-1] / SAMPLE_RATE}
    if differ:
        rec.audio_metrics["audio_unforced"] = audio_metrics(ref64[0].numpy(), audio[0].numpy())
    for role, wav in (("reference", ref32), ("backend", audio), ("backend-forced", forced if differ else None)):
        if wav is not None:
            path = session.report_dir / "audio" / item.id / f"{role}.wav"
            write_wav(path, wav[0].numpy())
            rec.audio[role] = path.relative_to(session.report_dir).as_posix()
    tol = session.profile.for_("e2e", item.backend, item.mode)
    rec.verdict, rec.reason = judge(rec.metrics, tol, rec.audio_metrics, audio_only=True)
    if differ:
        rec.reason += f"; {differ} of {n} durations differ from the reference (judged with them forced)"
    return rec
