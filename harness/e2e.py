"""The `e2e` item: tokens to audio the way working ports run Kokoro, as the harness's own two-stage
port (harness/data/ports/e2e.yaml) run by the port chain (harness.port.chain.run_chain).

Kokoro cannot be exported whole (the alignment's shape depends on the predicted durations), so
ports run two programs: a *duration stage* (bert .. duration), the alignment built on the host
from *its* durations, and a *synthesizer* (f0n, text_encoder, decoder). Both stages name harness
steps, exported and compiled for the item's backend with its patches. In `static` mode the chain
runs the port file's buckets (the case's token bucket; the smallest frame bucket that fits,
inputs padded, padding trimmed from the audio); in `dynamic` mode the exact lengths, so the item
measures the backend alone (Kokoro's synthesizer is not padding-invariant: its InstanceNorms
average over the bucket, and the static item's error includes that rewrite).

What is judged: the audio only, by the `e2e` profile. The synthesizer's *chained* run (the
backend's own durations and `d`) is the app's run; its *local* run (the reference's durations and
boundary tensors) plays the role of "durations forced". When the backend's rounded durations
equal the reference's, the chained audio is judged (it is sample-aligned with the reference);
when some differ, the audio's length and everything after the first difference move, so the local
run is judged instead (a one-frame rounding change does not fail the audio) and the chained one is
reported beside it (`audio_unforced`). Every stage's local and chained errors are in `rec.stages`.

A float16 backend's item is judged, like a float16 step, against the float16 floor: float16
eager's own e2e audio (`float16_floor_audio`) against float64; whether a listener gets usable audio
is its `shippable` bar (the audio bars and every duration rounding as the reference's).
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from . import progress
from .backends import precision_of
from .metrics.audio import audio_metrics, write_wav
from .metrics.tensor import compare_to_floor, error_metrics
from .model import SAMPLE_RATE
from .patches import affecting, apply_patches, graph_code_digest
from .plumbing import cache
from .plumbing.files import atomic_write, content_key
from .port.chain import HarnessSteps, glue, run_chain
from .port.portfile import PortError, load_port
from .precision.float16 import FLOOR_VERSION, Mixed
from .precision.search import float16_d
from .record import Record
from .reference import NEUTRAL_PATCHES, REFERENCE_PATCHES, TRACE_VERSION, as_outputs, numerics, synthesizer_reference
from .steps import get_step
from .verdict import Verdict, apply_float16_floor, judge, shippable

E2E_PORT = Path(__file__).parent / "data" / "ports" / "e2e.yaml"


def alignment(pred_dur: torch.Tensor, n_tokens_total: int, n_frames_total: int) -> torch.Tensor:
    """One-hot [1, tokens, frames]; padded tokens and frames are zero rows and columns (the
    benchmarks build padded alignments with it; the chain's host glue is harness.port.chain.glue)."""
    frames = int(pred_dur.sum())
    aln = torch.zeros(1, n_tokens_total, n_frames_total)
    aln[0, torch.repeat_interleave(torch.arange(len(pred_dur)), pred_dur), torch.arange(frames)] = 1
    return aln


@functools.lru_cache(maxsize=1)
def e2e_port():
    """The shipped port file of the e2e item, validated like a user's."""
    return load_port(E2E_PORT)


def run_e2e(session, r, rec: Record) -> Record:
    """Run a resolved e2e item (harness.runner.Resolved) through the port chain and judge its audio."""
    port = e2e_port()  # not in rec.audit: the backend's audit (the dashboard lists it); rows name their steps
    try:
        variant = synthesizer_variant(rec.patches)
        refs = {"audio": synthesizer_audio(session, r.item.case, variant)} if variant else None

        run_chain(session, port, r.item, rec, HarnessSteps(r.backend, r.patches, r.item.mode == "static"),
                  end=functools.partial(judge_e2e, precision=precision_of(r.backend)), profile_step="e2e",
                  references=refs)
    except PortError as e:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, f"{port.source}: {e}"
    return rec


def synthesizer_variant(patches: list[str]) -> tuple[str, ...]:
    """The backend's patches that change the synthesizer's semantics (e.g. custom_stft)."""
    return tuple(affecting([p for p in patches if p not in REFERENCE_PATCHES["dynamic"] and p not in NEUTRAL_PATCHES],
                           "synthesizer"))


def synthesizer_audio(session, case_id: str, variant: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """{"float32", "float64"}: the synthesizer in eager PyTorch on the reference's exact lengths
    and alignment, with `variant` (cached: harness.reference.synthesizer_reference)."""
    return synthesizer_reference(session.model, session.cases[case_id], session.traces(case_id), variant)


def float16_floor_audio(session, case_id: str, variant: tuple[str, ...]) -> torch.Tensor:
    """float16 eager's e2e audio (the emulation of harness.precision.float16, as a step's float16
    floor): the duration stage in float16, the synthesizer fed its `d` on the reference's alignment
    (the reference's `d` when the float16 durations round differently: the item's local run), as the
    item runs a float16 backend. Cached per case and variant."""
    model, case, traces = session.model, session.cases[case_id], session.traces(case_id)
    key = content_key("float16-e2e", TRACE_VERSION, FLOOR_VERSION, model.digest, case.digest, numerics(),
                      variant, graph_code_digest(tuple(variant)) if variant else "")

    def build(tmp):
        km = apply_patches(model.kmodel, (*REFERENCE_PATCHES["dynamic"], *variant))
        dur, synth, chain = get_step("duration_stage"), get_step("synthesizer"), traces.chain
        with progress.phase("references in float16", subject=f"{case_id} e2e"):
            d = float16_d(dur, dur.module(km), [chain[k] for k in dur.input_names], (), True, chain["duration"])
            inputs = {k: chain[k] for k in synth.input_names}
            if d is not None:  # else the reference's `d`: the item's local run
                inputs["d"] = d.reshape(inputs["d"].shape)
            audio = as_outputs(synth, Mixed(synth.module(km), emulate=True)(*inputs.values()))["audio"]
        atomic_write(tmp / "audio.pt", lambda f: torch.save(audio.float(), f))

    entry, _ = cache.get_or_build("variants", key, build)
    return torch.load(entry / "audio.pt", weights_only=True)


def judge_e2e(session, port, item, rec: Record, chained: dict, traces, case, local: dict,
              precision: str = "float32") -> None:
    """The e2e verdict (the chain's `end`): durations compared, the judged audio (module docstring)
    against the synthesizer's eager reference with the backend's semantics-changing patches (a
    CustomSTFT rewrite makes its own reference variant), the WAVs written. A float16 backend
    (`precision`): the verdict against the float16 floor, the audio bars as `shippable`."""
    n = traces.valid.tokens
    pred, pred_ref = glue("pred_dur", chained, traces), torch.tensor(traces.pred_dur)
    differ = int((pred != pred_ref).sum())
    buckets = next(r for r in rec.stages if r["stage"] == port.stages[-1].name).get("bucket", {})
    frames_bucket = lambda role, frames: buckets.get(role, frames)  # noqa: E731 (dynamic: the exact frames)
    rec.durations = {"tokens": n, "tokens_differ": differ, "max_frames_diff": int((pred - pred_ref).abs().max()),
                     "frames_backend": int(pred.sum()), "frames_reference": int(pred_ref.sum()),
                     "bucket_backend": frames_bucket("chained", int(pred.sum()))}
    audio = chained["audio"]
    judged = local["audio"] if differ else audio
    if differ:
        rec.durations["bucket_forced"] = frames_bucket("local", int(pred_ref.sum()))

    ref = synthesizer_audio(session, item.case, synthesizer_variant(rec.patches))
    ref32, ref64 = ref["float32"], ref["float64"]
    rec.metrics["audio"] = compare_to_floor(judged, ref32, ref64)
    rec.precision = precision
    if precision == "float16":
        fp16 = float16_floor_audio(session, item.case, synthesizer_variant(rec.patches))
        apply_float16_floor(rec.metrics["audio"], error_metrics(fp16, ref64), precision)
    rec.audio_metrics["audio"] = {**audio_metrics(ref64[0].numpy(), judged[0].numpy()),
                                  "duration_s": judged.shape[-1] / SAMPLE_RATE}
    if differ:
        rec.audio_metrics["audio_unforced"] = audio_metrics(ref64[0].numpy(), audio[0].numpy())
    for role, wav in (("reference", ref32), ("backend", audio), ("backend-forced", judged if differ else None)):
        if wav is not None:
            path = session.report_dir / "audio" / item.id / f"{role}.wav"
            write_wav(path, wav[0].numpy())
            rec.audio[role] = path.relative_to(session.report_dir).as_posix()
    tol = session.profile.for_("e2e", item.backend, item.mode)
    if precision == "float16":  # as a float16 step: "within the float16 floor", and shippable or not
        rec.verdict, rec.reason = judge(rec.metrics, tol, None)
        rec.shippable, rec.shippable_reason = shippable(tol, rec.audio_metrics, {"durations": (pred, pred_ref)})
    else:
        rec.verdict, rec.reason = judge(rec.metrics, tol, rec.audio_metrics, audio_only=True)
    if differ:
        rec.reason += (f"; {differ} of {n} durations differ from the reference (judged with them forced: "
                       f"the synthesizer's local run)")
