"""mlx-audio's Kokoro (`mlx_audio.tts.models.kokoro`, an MLX rewrite) as a rewrite adapter.

mlx-audio keeps Kokoro's module names and, at module boundaries, Kokoro's channels-first layout;
only its convolutions are channels-last (MLX's `conv1d` takes [batch, length, channels]) and its
weight-normalized ones take the convolution function as an argument. So most modules are called
as they are (`call`); a convolution gets its input transposed in and its output transposed back.

Weights: the torch `KModel`'s state dict, named as the official checkpoint names it, goes through
mlx-audio's own `Model.sanitize` (its transpositions of convolution weights, its LSTM renaming)
and `load_weights(strict=True)`, as `mlx_audio.utils.load_model` loads a converted checkpoint.
mlx-audio's InstanceNorm has no affine parameters (Kokoro's has a weight and a bias): those keys
are dropped when they are the identity (weight 1, bias 0) and reported when they are not.
Nothing is downloaded: the model is built from the harness model's own config.
"""
from __future__ import annotations

import contextlib
import importlib.util
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from .adapter import Adapter
from ..architecture import kokoro_config
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
mx = deferred_import("mlx.core")
mlx_utils = deferred_import("mlx.utils")
mlx_kokoro = deferred_import("mlx_audio.tts.models.kokoro.kokoro")
mlx_call = deferred_import("harness.rewrite.mlx_call")  # imports mlx at its top; copied whole into bundles

PACKAGES = ("mlx", "mlx_audio")
INSTALL = "pip install -e '.[mlx]'"

# Kokoro module path (`*`: one part of it) -> how its mlx-audio counterpart is called. Kokoro's
# LSTMs run on packed sequences: the harness unpacks them (batch 1, exact lengths: the whole
# sequence), and mlx-audio's LSTM takes the plain one. Not mapped: the dropouts and activations.
# The generator's AdaINs have their InstanceNorm mapped too (mlx-audio's has no affine parameters:
# the load checks Kokoro's are the identity), so an AdaIN that differs is told from its normalization.
MODULES = {
    "bert": "bert",
    "bert.embeddings": "embeddings",
    "bert.encoder.embedding_hidden_mapping_in": "call",
    "bert.encoder.albert_layer_groups.0.albert_layers.0.ffn": "call",  # the shared layer's first run
    "bert.encoder.albert_layer_groups.0.albert_layers.0.activation": "call",
    "bert.encoder.albert_layer_groups.0.albert_layers.0.ffn_output": "call",
    "bert.encoder.albert_layer_groups.0.albert_layers.0.full_layer_layer_norm": "call",
    "bert_encoder": "call",
    "predictor.text_encoder": "call",
    "predictor.text_encoder.lstms.[024]": "call",  # LSTM
    "predictor.text_encoder.lstms.[135]": "call",  # AdaLayerNorm
    "predictor.lstm": "call",
    "predictor.duration_proj": "call",
    "predictor.shared": "call",
    "predictor.F0.*": "call",
    "predictor.N.*": "call",
    "predictor.F0.*.norm[12]": "call",
    "predictor.N.*.norm[12]": "call",
    "predictor.F0_proj": "conv",
    "predictor.N_proj": "conv",
    "text_encoder": "call",
    "text_encoder.cnn.*.0": "weighted_conv",
    "text_encoder.cnn.*.1": "channels_last",  # Kokoro's LayerNorm over channels; mlx.nn.LayerNorm's last axis
    "text_encoder.lstm": "call",
    "decoder": "call",
    "decoder.F0_conv": "weighted_conv",
    "decoder.N_conv": "weighted_conv",
    "decoder.asr_res.0": "weighted_conv",
    "decoder.encode": "call",
    "decoder.decode.*": "call",
    "decoder.encode.norm[12]": "call",
    "decoder.decode.*.norm[12]": "call",
    "decoder.decode.3.pool": "pool",
    "decoder.generator": "call",
    "decoder.generator.m_source": "call",
    "decoder.generator.m_source.l_sin_gen": "call",  # the harmonics: its phase is a cumulative sum over every sample
    "decoder.generator.m_source.l_linear": "call",  # the harmonics merged (then tanh)
    "decoder.generator.noise_convs.*": "conv",
    "decoder.generator.noise_res.*": "call",
    "decoder.generator.noise_res.*.adain[12].*": "call",
    "decoder.generator.noise_res.*.adain[12].*.norm": "call",  # the AdaIN's InstanceNorm (channels-first in both)
    "decoder.generator.ups.*": "weighted_conv_transpose",
    "decoder.generator.resblocks.*": "call",
    "decoder.generator.resblocks.*.adain[12].*": "call",
    "decoder.generator.resblocks.*.adain[12].*.norm": "call",
    "decoder.generator.conv_post": "weighted_conv",
}
# Sub-callables: the generator's STFT of the harmonic source and its inverse STFT of the output
# (both sides' `transform(x) -> (magnitude, phase)` and `inverse(magnitude, phase)`, Kokoro's layout).
CALLS = {
    "decoder.generator.stft.transform": "call",
    "decoder.generator.stft.inverse": "call",
}


class MlxAudio(Adapter):
    name = "mlx-audio"
    modules = MODULES
    calls = CALLS

    def missing(self) -> str | None:
        absent = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
        return f"{' and '.join(absent)} not installed ({INSTALL})" if absent else None

    def load(self, kmodel: torch.nn.Module):
        model = mlx_kokoro.Model(mlx_kokoro.ModelConfig.from_dict({**kmodel_config(kmodel)}))
        weights = {f"{top}.{k}": mx.array(v.detach().float().numpy())
                   for top in ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
                   for k, v in getattr(kmodel, top).state_dict().items()}
        weights = model.sanitize(weights)
        wanted = dict(mlx_utils.tree_flatten(model.parameters()))
        dropped = {k: v for k, v in weights.items() if k not in wanted}
        model.load_weights([(k, v) for k, v in weights.items() if k in wanted], strict=True)
        mx.eval(model.parameters())
        model.eval()
        model.load_notes = dropped_notes(dropped)
        return model

    def run(self, model, path: str, convention: str, args: tuple, kwargs: dict) -> torch.Tensor:
        out = mlx_call.call(mlx_call.counterpart(model, path), path, convention,
                            [to_numpy(v) for v in args], {k: to_numpy(v) for k, v in kwargs.items()})
        return torch.from_numpy(out)

    @contextlib.contextmanager
    def noise(self, values: dict[str, torch.Tensor]) -> Iterator[None]:
        """Kokoro's noise drawn in place of mlx-audio's (`mlx_call.kokoro_noise`)."""
        with mlx_call.kokoro_noise({k: v.float().numpy() for k, v in values.items()}):
            yield

    def repro(self, model, path: str, convention: str, out_dir: Path) -> dict:
        """The module's weights as this adapter loaded them and the model's config; the bundle's
        runner is `mlx_call.py`, the file the adapter itself calls modules through."""
        mlx_call.save_module(model, path, kokoro_config(), out_dir)
        shutil.copyfile(mlx_call.__file__, out_dir / "mlx_call.py")
        return {"runner": "mlx_call", "packages": ["numpy", "mlx", "mlx_audio"],
                "built": ("mlx-audio's `Model` is built from `config.json` (random weights, nothing downloaded); the "
                          f"module's own weights, `{mlx_call.WEIGHTS}` (mlx-audio's names and layout, as the "
                          "adapter's load converted the Kokoro checkpoint through mlx-audio's `sanitize`), are loaded "
                          "into its counterpart with `load_weights(strict=True)`")}

    def chained(self, model, phonemes: str, ref_s: torch.Tensor, speed: float, noise: dict, conventions: dict,
                save) -> bool:
        """mlx-audio's own forward pass with Kokoro's noise, each mapped module's first output saved."""
        with mlx_call.intermediates(model, conventions, save), self.noise(noise):
            model(phonemes, mlx_call.mx.array(ref_s.float().numpy()), speed=speed)
        return True

    def synthesize(self, model, phonemes: str, ref_s: torch.Tensor, speed: float):
        out = model(phonemes, mx.array(ref_s.float().numpy()), speed=speed, return_output=True)
        return (torch.from_numpy(np.array(out.audio.astype(mx.float32))).reshape(-1),
                torch.from_numpy(np.array(out.pred_dur)).long().reshape(-1))


def kmodel_config(kmodel: torch.nn.Module) -> dict:
    """The config the harness built `kmodel` from (harness.architecture), as mlx-audio's
    ModelConfig takes it."""
    return kokoro_config()


def to_numpy(value):
    """A Kokoro input as numpy (float tensors as float32), anything else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().float().numpy() if value.is_floating_point() else value.detach().numpy()


def dropped_notes(dropped: dict) -> list[str]:
    """What the load left out: Kokoro's InstanceNorm affine parameters, which mlx-audio's
    InstanceNorm does not have; a note for any that is not the identity (the rewrite ignores it)."""
    notes = []
    for key, value in sorted(dropped.items()):
        v = np.array(value)
        identity = (key.endswith(".norm.weight") and np.all(v == 1)) or (key.endswith(".norm.bias") and np.all(v == 0))
        if not identity:
            notes.append(f"{key}: the rewrite has no such parameter and this one is not the identity")
    if dropped and not notes:
        notes.append(f"{len(dropped)} InstanceNorm affine parameters dropped (all the identity)")
    return notes


ADAPTER = MlxAudio()
