"""The noise band: how far the vocoder's random noise alone moves each audio metric.

Kokoro's SineGen and NSF source draw random numbers, so an artifact that draws its own noise (or
none: the packaged whole-model ONNX adds none) cannot match the reference sample for sample, and a
relative L2 on its waveform means nothing. The reference decoder is run K times on the reference's
own inputs (exact lengths, the reference durations) with K noise seeds (`patches.sample_noise`,
seed = case seed + k; k = 0 is the reference chain's audio), and every audio metric of run k
against run 0 gives the spread that noise alone produces. An artifact's metric passes inside
that band widened by the tolerance profile's `band_margin` (a fraction of the band's width) on
the side that matters. A zero-noise run is kept as well: an artifact that adds no noise is then
compared with it sample by sample (its error is the artifact's own).

A stage's noise rule (`stage_noise`) is found from the stage itself, as the whole-model
localization finds it (`onnx_graph.draws_noise`): `inputs` when a noise tensor is among its
inputs, `own` when its graph draws random numbers, else `none`; `noise:` in a port file only
overrides. A `none` stage whose noise would arise inside it (its outputs are noise-dependent, its
inputs are not) is judged against the zero-noise reference (`zero_noise_reference`).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import onnx
import torch

from ..metrics.audio import audio_metrics
from ..model import SAMPLES_PER_FRAME
from ..patches import apply_patches, sample_noise, to_float64
from ..plumbing import cache
from ..plumbing.files import atomic_write, content_key
from ..reference import REFERENCE_PATCHES, numerics
from ..steps import get_step
from . import tensors
from .onnx_graph import draws_noise

BAND_VERSION = 1
DEFAULT_K = 16
# metric -> the side that matters: a PESQ below the band fails, a PESQ above it does not.
DIRECTIONS = {"pesq": "higher", "mcd_db": "lower", "logmel_mad_db": "lower", "logmel_corr": "higher",
              "mrstft": "lower", "rms_ratio_db": "both"}


def _decoder_audio(km, chain: dict, noise: dict) -> torch.Tensor:
    step = get_step("decoder")
    with torch.no_grad():
        return step.module(km)(chain["asr"], chain["F0_pred"], chain["N_pred"], chain["s_dec"],
                               noise["rand_ini"], noise["sine_noise"], noise["source_noise"])


def noise_band(model, case, traces, k: int = DEFAULT_K) -> dict:
    """{"metrics": {metric: [values of runs 1..K-1 vs run 0]}, "band": {metric: [lo, hi]},
    "zero_noise_audio": the reference audio with every noise input zero, "k": K}; cached."""
    key = content_key("noise-band", BAND_VERSION, model.digest, case.digest, numerics(), k)

    def build(tmp):
        km = apply_patches(model.kmodel, REFERENCE_PATCHES["dynamic"])
        chain = traces.chain
        n = traces.valid.frames * SAMPLES_PER_FRAME
        ref0 = chain["audio"][0].double().numpy()
        values: dict[str, list[float]] = {m: [] for m in DIRECTIONS}
        for i in range(1, k):
            noise = sample_noise(case.seed + i, n)
            audio = _decoder_audio(km, chain, noise)
            m = audio_metrics(ref0, audio[0].double().numpy())
            for name in DIRECTIONS:
                values[name].append(float(m[name]))
        zero = {name: torch.zeros_like(chain[name]) for name in ("rand_ini", "sine_noise", "source_noise")}
        zero_audio = _decoder_audio(km, chain, zero)
        out = {"metrics": values, "k": k, "zero_noise_audio": zero_audio,
               "zero_noise_metrics": audio_metrics(ref0, zero_audio[0].double().numpy())}
        atomic_write(tmp / "band.pt", lambda f: torch.save(out, f))

    entry, _ = cache.get_or_build("noise_band", key, build)
    out = torch.load(entry / "band.pt", weights_only=False)
    out["band"] = {m: _range(v) for m, v in out["metrics"].items()}
    return out


def _range(values: list[float]) -> list[float]:
    finite = [v for v in values if not math.isnan(v)]
    return [min(finite), max(finite)] if finite else [math.nan, math.nan]


# ---- a stage's noise rule, found from the stage ---------------------------------------------------

def stage_noise(stage, root: Path) -> str:
    """`own`, `inputs` or `none` for a stage the port file says nothing about: a noise tensor among
    its inputs, else random ops in its graph (an ONNX's Random* ops; a format the harness cannot
    read without its runtime, or a missing file, is assumed to draw its own)."""
    if stage.noise is not None:
        return stage.noise
    if any(r.tensor in tensors.NOISE for r in stage.inputs.values()):
        return "inputs"
    if stage.step is not None:
        return "none"  # a harness step is exported with its noise as inputs (noise_as_input)
    files = stage.files(root)
    if not files or files[0].suffix.lower() != ".onnx" or not files[0].is_file():
        return "own"

    return "own" if any(draws_noise(onnx.load(str(f), load_external_data=False)) for f in files) else "none"


def noise_inside(stage) -> bool:
    """Whether the stage's noise would arise inside it: it outputs a noise-dependent tensor (the
    audio) and takes none (no noise, no audio, no module reference inside the generator, where the
    harmonic source's output flows)."""
    def carries(name: str) -> bool:
        t = tensors.VOCAB.get(name)
        return t.stochastic if t is not None else name.startswith("decoder.generator.")

    return (any(carries(r.tensor) for r in stage.outputs.values())
            and not any(carries(r.tensor) for r in stage.inputs.values()))


def zero_noise_reference(session, case_id: str) -> dict[str, torch.Tensor]:
    """{"float32", "float64"}: the reference decoder's audio on the case's reference inputs with
    every noise input zero (what a stage that draws no noise computes), once per session and case."""
    memo = session.zero_noise_references
    if case_id not in memo:
        chain = session.traces(case_id).chain
        km32 = apply_patches(session.model.kmodel, REFERENCE_PATCHES["dynamic"])
        km64 = to_float64(copy.deepcopy(km32))
        zero = {n: torch.zeros_like(chain[n]) for n in tensors.NOISE}
        inputs64 = {k: chain[k].double() for k in ("asr", "F0_pred", "N_pred", "s_dec")}
        default = torch.get_default_dtype()
        try:  # what kokoro allocates with torch.zeros follows the default dtype
            torch.set_default_dtype(torch.float64)
            audio64 = _decoder_audio(km64, inputs64, {k: v.double() for k, v in zero.items()})
        finally:
            torch.set_default_dtype(default)
        memo[case_id] = {"float32": _decoder_audio(km32, chain, zero), "float64": audio64}
    return memo[case_id]


def session_k(session) -> int:
    return int(session.noise_k or DEFAULT_K)
