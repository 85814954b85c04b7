"""Calling mlx-audio's Kokoro modules the way Kokoro's are called, with mlx, mlx-audio and numpy
only: the mlx-audio adapter's conventions (harness.rewrite.mlx_audio) and Kokoro's noise drawn in
place of mlx-audio's. A repro bundle ships this file unchanged beside its repro.py (`run_saved`),
so the adapter and the bundle call a module the same way.
It imports nothing of the harness (the bundle has no harness): its errors are plain ValueErrors.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

try:  # optional runtime: mlx-audio (the `mlx` extra); the adapter checks it before calling here
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.kokoro.kokoro import Model, ModelConfig
except ImportError:
    mx = tree_flatten = Model = ModelConfig = None

WEIGHTS, CONFIG = "weights.safetensors", "config.json"


def counterpart(model, path: str):
    """mlx-audio's object at a Kokoro module path: attributes, and list items for the indices."""
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() and isinstance(obj, (list, tuple)) else getattr(obj, part)
    return obj


def to_mx(value):
    """A Kokoro input (a numpy array) as mlx-audio takes it: floats as float32, integers as int32."""
    if not isinstance(value, np.ndarray):
        return value
    if value.dtype == np.bool_:
        return mx.array(value)
    if np.issubdtype(value.dtype, np.floating):
        return mx.array(value.astype(np.float32))
    return mx.array(value.astype(np.int32))


def call(module, path: str, convention: str, args: list, kwargs: dict) -> np.ndarray:
    """mlx-audio's `module` (the counterpart of Kokoro's `path`) on Kokoro's inputs (numpy, Kokoro's
    layout), by the adapter's convention; its first output as float32 numpy in Kokoro's layout."""
    a = [to_mx(v) for v in args]
    kw = {k: to_mx(v) for k, v in kwargs.items()}
    if convention in ("call", "pool"):
        out = module(*a, **kw) if convention == "call" else module(a[0].swapaxes(2, 1), mx.conv_transpose1d)
    elif convention == "bert":  # Kokoro's CustomAlbert returns the last hidden state only
        out = module(a[0], attention_mask=kw.get("attention_mask", a[1] if len(a) > 1 else None))
    elif convention == "embeddings":  # position and token type ids: both sides' defaults
        out = module(a[0] if a else kw["input_ids"])
    elif convention in ("conv", "channels_last"):  # mlx.nn.Conv1d, mlx.nn.LayerNorm: channels-last
        out = module(a[0].swapaxes(2, 1))
    elif convention in ("weighted_conv", "weighted_conv_transpose"):
        out = module(a[0].swapaxes(2, 1), mx.conv1d if convention == "weighted_conv" else mx.conv_transpose1d)
    else:
        raise ValueError(f"mlx-audio adapter: unknown convention {convention!r} for {path}")
    return kokoro_layout(out, convention)


def kokoro_layout(out, convention: str) -> np.ndarray:
    """A module's first output in Kokoro's layout, float32 numpy: the channels-last conventions
    transposed back; `pool` sliced as AdainResBlk1d._residual slices the unpadded transposed conv."""
    first = out[0] if isinstance(out, (tuple, list)) else out
    if convention == "pool":
        first = first[:, 1:, :]
    if convention in ("conv", "channels_last", "weighted_conv", "weighted_conv_transpose", "pool"):
        first = first.swapaxes(2, 1)
    mx.eval(first)
    return np.array(first.astype(mx.float32))


@contextlib.contextmanager
def intermediates(model, conventions: dict[str, str], save: Callable[[str, np.ndarray], None]) -> Iterator[None]:
    """During this context, the counterpart of each path of `conventions` hands its first call's
    output (Kokoro's layout) to `save`: the classes' `__call__` wrapped, matched by object."""
    by_id = {id(counterpart(model, p)): p for p in conventions}
    classes = {type(counterpart(model, p)) for p in conventions}
    real, own = {c: c.__call__ for c in classes}, {c for c in classes if "__call__" in c.__dict__}
    seen: set[str] = set()

    def wrapped(cls):
        def call_and_save(self, *args, **kwargs):
            out = real[cls](self, *args, **kwargs)
            path = by_id.get(id(self))
            if path is not None and path not in seen:
                seen.add(path)
                save(path, kokoro_layout(out, conventions[path]))
            return out
        return call_and_save

    for cls in classes:
        cls.__call__ = wrapped(cls)
    try:
        yield
    finally:
        for cls in classes:
            if cls in own:
                cls.__call__ = real[cls]
            else:
                del cls.__call__


@contextlib.contextmanager
def kokoro_noise(values: dict[str, np.ndarray]) -> Iterator[None]:
    """mlx-audio draws `mx.random.uniform` (SineGen's initial phases, [batch, 9]) and
    `mx.random.normal` (SineGen's noise [batch, samples, 9], the NSF source's [batch, samples,
    1]); during this context they return Kokoro's numbers of the same shape."""
    by_shape = {tuple(v.shape): mx.array(np.asarray(v, dtype=np.float32)) for v in values.values()}
    real = mx.random.uniform, mx.random.normal

    def drawn(shape, *_, **kw):
        key = tuple(kw.get("shape", shape))
        if key not in by_shape:
            raise RuntimeError(f"mlx-audio drew random numbers of shape {key}: no Kokoro noise input has it "
                               f"({sorted(by_shape)})")
        return by_shape[key]

    mx.random.uniform = lambda low=0, high=1, shape=(), *a, **kw: drawn(kw.pop("shape", shape), **kw)
    mx.random.normal = lambda shape=(), *a, **kw: drawn(shape, **kw)
    try:
        yield
    finally:
        mx.random.uniform, mx.random.normal = real


def save_module(model, path: str, config: dict, out_dir: Path) -> None:
    """What `run_saved` needs of module `path`: its weights as the adapter loaded them (mlx-audio's
    own names and layout, safetensors) and the model's config."""
    mx.save_safetensors(str(out_dir / WEIGHTS), dict(tree_flatten(counterpart(model, path).parameters())))
    (out_dir / CONFIG).write_text(json.dumps(config, indent=1))


def run_saved(here: Path, meta: dict, args: list, kwargs: dict, noise: dict) -> np.ndarray:
    """A repro bundle's module, alone: mlx-audio's Model built from config.json (nothing loaded),
    the module's own saved weights loaded into its counterpart (strict), called on the saved inputs."""
    model = Model(ModelConfig.from_dict(json.loads((here / CONFIG).read_text())))
    module = counterpart(model, meta["module"])
    module.load_weights(str(here / WEIGHTS), strict=True)
    mx.eval(module.parameters())
    model.eval()
    with kokoro_noise(noise):
        return call(module, meta["module"], meta["convention"], args, kwargs)
