"""Defects ranked by what each does to the audio: one scoring for the stages inside a whole-model
ONNX (onnx_stages.rank_defects) and for a port chain's stages (chain: `rank_chain_defects`).

A defect is taken out alone: its stage's output without its own error (`without_own_error`: to
first order the stage fixed, on what its own upstream gave it) runs on to the audio. Its effect is
how far it moves the audio: the SNR of the audio with it against the audio without it (lower: a
larger effect). `score_defects` ranks by it, a stage whose output holds NaN or Inf first, those
that could not be measured last (with why); both audios' distances to the reference (no PESQ) are
recorded beside it. `defects_reason` is the verdict's reason for both.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..metrics import fmt
from ..metrics.audio import logmel_mad_db, mrstft, rms_ratio_db, snr_db
from ..model import SAMPLES_PER_FRAME


def envelope(x, frame: int = SAMPLES_PER_FRAME) -> torch.Tensor:
    """Frame RMS (one alignment frame, 600 samples) of a signal: what the source's phase and noise
    do not hide."""
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64).reshape(-1)
    n = x.numel() // frame * frame or x.numel()
    return x[:n].reshape(-1, min(frame, n)).pow(2).mean(-1).sqrt()


def without_own_error(chained, local, r32: torch.Tensor, judged_by: str | None = None) -> np.ndarray:
    """The stage's chained output with its own error taken out, in the reference's layout, as its
    local error (fed the reference's inputs) says it is made: a constant gain (a sign flip
    included) is divided out; a stage judged by its envelope (it draws its own noise) is rescaled
    frame by frame by the reference's envelope over its local one; any other error is subtracted
    (`chained - (local - reference)`, to first order the stage without its defect on what its own
    upstream gave it). Never the reference's value itself: that would also take out every defect
    before the stage."""
    chained = torch.as_tensor(np.asarray(chained), dtype=torch.float64).reshape(-1)
    local = torch.as_tensor(np.asarray(local), dtype=torch.float64).reshape(-1)
    want = r32.double().reshape(-1)
    gain = float(local @ want) / max(float(want @ want), 1e-300)
    if judged_by == "envelope":
        scale = envelope(want) / envelope(local).clamp_min(1e-30)
        frame = max(1, math.ceil(chained.numel() / scale.numel()))
        fixed = chained * scale.repeat_interleave(frame)[:chained.numel()]
    elif gain != 0 and float((local - gain * want).pow(2).sum()) < 0.05 * float((local - want).pow(2).sum()):
        fixed = chained / gain  # the same rule as differences.difference_kind's "constant gain"
    else:
        fixed = chained - (local - want)
    return fixed.reshape(r32.shape).numpy()


def effect_metrics(want: np.ndarray, audio) -> dict:
    """The audio metrics of the noise band that need no PESQ run, against the reference's audio."""
    a = np.asarray(audio, dtype=np.float64).reshape(-1)
    return {"snr_db": snr_db(want, a), "logmel_mad_db": logmel_mad_db(want, a), "mrstft": mrstft(want, a),
            "rms_ratio_db": rms_ratio_db(want, a)}


def score_defects(found: list[dict], pairs: dict, want: np.ndarray) -> list[dict]:
    """`found`: each defect as {"stage", "kind", "local_rel_l2", "floor_rel_l2", "nonfinite"} (and
    "unranked": why, when it could not be taken out); `pairs`: {stage: (audio with it, audio
    without it)}; `want`: the reference's audio. Each gets `moves_audio_snr_db`, `audio_effect`
    ({metric: {"with", "without"}} against the reference) and its `rank`, in rank order."""
    want = np.asarray(want, np.float64).reshape(-1)
    out = []
    for d in found:
        with_it, without = pairs.get(d["stage"], (None, None))
        moved, effect = math.nan, {}
        if with_it is not None and np.isfinite(without).all():
            moved = effect_metrics(np.asarray(without, np.float64), with_it)["snr_db"]
            if np.size(with_it) == np.size(without) == want.size:
                before, after = effect_metrics(want, with_it), effect_metrics(want, without)
                effect = {m: {"with": before[m], "without": after[m]} for m in before}
        elif with_it is None and "unranked" not in d and not d["nonfinite"]:
            d = {**d, "unranked": "its run without the defect failed"}
        out.append({**d, "moves_audio_snr_db": moved, "audio_effect": effect})
    out.sort(key=lambda d: (not d["nonfinite"], d["moves_audio_snr_db"] if math.isfinite(d["moves_audio_snr_db"])
                            else math.inf))
    for i, d in enumerate(out, 1):
        d["rank"] = i
    return out


def defects_reason(defects: list[dict]) -> str:
    """'2 defects: a (kind; SNR x -> y dB without it); b (...)', ranked by audio effect."""
    return f"{len(defects)} defect{'s' if len(defects) > 1 else ''}: " + "; ".join(
        f"{d['stage']} ({d['kind']}; {effect_text(d)})" for d in defects)


def effect_text(d: dict) -> str:
    """'moves the audio by SNR 6.02 dB (SNR to the reference -7.96 -> 6.02 dB, log-mel distance
    3.5 -> 0.1 dB without it)'; a defect that could not be taken out says why."""
    moved = d.get("moves_audio_snr_db", math.nan)
    if not math.isfinite(moved):
        return f"not ranked: {d['unranked']}" if d.get("unranked") else "audio effect not measured"
    text = f"moves the audio by SNR {fmt(moved)} dB"
    parts = []
    for key, name in (("snr_db", "SNR"), ("logmel_mad_db", "log-mel distance")):
        e = d["audio_effect"].get(key)
        if e and math.isfinite(e["with"]) and math.isfinite(e["without"]):
            parts.append(f"{name}{'' if parts else ' to the reference'} {fmt(e['with'])} -> {fmt(e['without'])} dB")
    return text + (f" ({', '.join(parts)} without it)" if parts else "")
