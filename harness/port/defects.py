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

import functools
import math

import numpy as np
import torch

from ..metrics import fmt
from ..metrics.audio import logmel_mad_db, mrstft, rms_ratio_db, snr_db
from ..model import SAMPLE_RATE, SAMPLES_PER_FRAME


def envelope(x, frame: int = SAMPLES_PER_FRAME) -> torch.Tensor:
    """Frame RMS (one alignment frame, 600 samples) of a signal: what the source's phase and noise
    do not hide."""
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64).reshape(-1)
    n = x.numel() // frame * frame or x.numel()
    return x[:n].reshape(-1, min(frame, n)).pow(2).mean(-1).sqrt()


def frame_power(x, frame: int = SAMPLES_PER_FRAME) -> torch.Tensor:
    """|STFT|^2 (frequency x frame) of the signal less its mean (a DC offset, the source's bias, is
    no harmonic: the envelope holds it), a Hann window of two frames every frame, zero-padded at
    the ends (any length): two frames hold 2.5 periods of an F0 of 100 Hz, so its harmonics are
    resolved (bins of 20 Hz). Magnitudes only: the source's random phases leave them alone."""
    x = torch.as_tensor(np.asarray(x), dtype=torch.float64).reshape(-1)
    x = x - x.mean()
    window = torch.hann_window(2 * frame, dtype=torch.float64)
    return torch.stft(x, 2 * frame, hop_length=frame, window=window, center=True, pad_mode="constant",
                      return_complex=True).abs().pow(2)


def mean_frequency(x, frame: int = SAMPLES_PER_FRAME, rate: int = SAMPLE_RATE) -> torch.Tensor:
    """Per frame, the power-weighted mean log2 frequency (octaves above 1 Hz, DC left out): the
    instantaneous frequency, which the phase does not hide. For harmonics of F0 it is log2 F0 plus
    a constant set by their amplitudes (the F0 doubled: +1 wherever voiced); in octaves, the few
    percent a noise (unvoiced) frame's mean moves by from draw to draw stays small beside that."""
    p = frame_power(x, frame)[1:]
    octaves = torch.fft.rfftfreq(2 * frame, 1 / rate, dtype=torch.float64)[1:].log2()
    return (p * octaves[:, None]).sum(0) / p.sum(0).clamp_min(1e-300)


def frequency_shift(got: torch.Tensor, want: torch.Tensor, floor: torch.Tensor) -> str | None:
    """'frequency x2 (+1.00 octave) in 30 of 41 frames': the median move (`mean_frequency`, octaves)
    of the frames that moved farther than any did in another noise draw (`floor`); None if none did."""
    d = got - want
    moved = d.abs() > (floor - want).abs().max()
    if not moved.any():
        return None
    shift = float(d[moved].median())
    return f"frequency x{2 ** shift:.3g} ({shift:+.2f} octave) in {int(moved.sum())} of {d.numel()} frames"


def harmonic_magnitudes(x, frame: int = SAMPLES_PER_FRAME, rate: int = SAMPLE_RATE, bands: int = 40) -> torch.Tensor:
    """Per frame, the magnitude in each of `bands` mel bands (band x frame): how strong each
    harmonic is, phase aside. Linear and unnormalized (energy per band): the loud harmonics weigh,
    not the noise between them, and a noise frame's energy sits in the wide high bands, each the
    mean of many bins (little draw-to-draw spread)."""
    return (_mel(rate, 2 * frame, bands) @ frame_power(x, frame)).sqrt()


@functools.lru_cache(maxsize=4)
def _mel(rate: int, n_fft: int, bands: int) -> torch.Tensor:
    import librosa  # lazy: a slow import (seconds), as in harness.metrics.audio

    return torch.from_numpy(librosa.filters.mel(sr=rate, n_fft=n_fft, n_mels=bands, norm=None)).double()


# What a stage that draws its own noise (the harmonic source) is judged by: what its phase and
# noise do not hide (onnx_stages.judge_own_noise), each against another noise draw as its floor.
OWN_NOISE_MEASURES = {"envelope": envelope, "instantaneous frequency": mean_frequency,
                      "harmonic magnitudes": harmonic_magnitudes}


def without_own_error(chained, local, r32: torch.Tensor, judged_by: str | None = None) -> np.ndarray:
    """The stage's chained output with its own error taken out, in the reference's layout, as its
    local error (fed the reference's inputs) says it is made: a constant gain (a sign flip
    included) is divided out; a stage that draws its own noise (`judged_by` "own noise") is
    rescaled frame by frame by the reference's envelope over its local one (of its measures, the
    one that can be taken out of its chained output); any other error is subtracted
    (`chained - (local - reference)`, to first order the stage without its defect on what its own
    upstream gave it). Never the reference's value itself: that would also take out every defect
    before the stage."""
    chained = torch.as_tensor(np.asarray(chained), dtype=torch.float64).reshape(-1)
    local = torch.as_tensor(np.asarray(local), dtype=torch.float64).reshape(-1)
    want = r32.double().reshape(-1)
    gain = float(local @ want) / max(float(want @ want), 1e-300)
    if judged_by == "own noise":
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
