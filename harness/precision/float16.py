"""Eager PyTorch in float16 with module-level float32 islands: the emulation that the float16
floor (harness.reference.float16_outputs) and the island search (harness.precision.search) run.

`Float16Mode` runs eager code in float16 the way `harness.backends.fp16` runs an exported program
(its `_to_dtype`: weights, constants *and* the float32 the code hard-codes become float16), and
`Mixed` keeps the modules of `keep` in float32 with their own float32 weights, on inputs as precise
as they arrive (a step input read through views stays float32), their outputs rounded where float16
code reads them (what Core ML's `op_selector` and the `fp16` backend's `keep_float32_graph` do with
an op-level float32 island). It imports nothing of the harness: the reference and the backends
build on it.
"""
from __future__ import annotations

import copy
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from ..plumbing.errors import UnknownName

FLOOR_VERSION = 1  # bump when the float16 eager recipe changes: it invalidates cached float16 floors
WIDE = (torch.float32, torch.float64)
PREFIX = "kmodel."  # a step module's paths start with it; keep-lists and audits use the KModel's paths


def _strip(path: str) -> str:
    return path[len(PREFIX):] if path.startswith(PREFIX) else path


def _kmodel_path(step_module: torch.nn.Module, path: str) -> bool:
    """Whether `path` is one of the KModel's modules: a step module holds the KModel as `kmodel`,
    and an e2e stage also its own wrappers (`f0n`, `decoder`), which are not KModel paths."""
    return path.startswith(PREFIX) or not hasattr(step_module, "kmodel")


def under(path: str, keep: Iterable[str]) -> bool:
    """Whether module `path` is one of `keep` or inside one of them."""
    return any(path == k or path.startswith(k + ".") for k in keep)


# ---- eager float16 with float32 islands ------------------------------------------------------------

# Ops that only move values (views, reshapes, indexing): no arithmetic, so no rounding of their own.
# Their output keeps its input's precision and is rounded where float16 code reads it; an island
# that reads a step input through them (Generator's `f0[:, None]`) gets it in float32, as the `fp16`
# backend's and Core ML's islands do (`island_nodes`).
DATA_MOVEMENT = frozenset({
    "__getitem__", "unsqueeze", "squeeze", "transpose", "permute", "view", "reshape", "contiguous", "expand",
    "narrow", "select", "flatten", "unflatten", "t", "clone", "detach", "chunk", "split", "unbind"})


def _inplace(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.startswith("__")) or name in (
        "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "copy_")


class Float16Mode(TorchFunctionMode):
    """Every floating tensor that a torch function takes or makes is float16 while the mode is in a
    float16 region, and float32 inside a kept module (`region`): dtype arguments float32 / float64
    become float16 (arange(dtype=...), .to(torch.float32), .float()), as the fp16 backend's graph
    rewrite does. An in-place op's target is never cast (the write must land).

    `emulate=True` computes every op in float32 and rounds its result to float16 (overflow to inf
    included): float16 storage with float32 arithmetic inside an op, which is what float16 convolution
    kernels do (they accumulate in float32) and 10-20x faster than PyTorch's float16 CPU kernels.
    An op with no float16 CPU kernel (MKL's FFT in TorchSTFT) is computed the same way."""

    def __init__(self, dtype=torch.float16, emulate: bool = False):
        super().__init__()
        self.dtype, self.emulate = dtype, emulate
        self.region = [dtype]

    @property
    def low(self) -> bool:
        return self.region[-1] != torch.float32

    def round(self, out):
        """Float results as a float16 region stores them."""
        def r(x):
            if not isinstance(x, torch.Tensor) or x.dtype not in (*WIDE, self.dtype):
                return x
            return x.to(self.dtype).float() if self.emulate else x.to(self.dtype)
        return tree_map(r, out)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        low = self.low
        storage = torch.float32 if (self.emulate or not low) else self.dtype

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                if low and self.emulate and x.dtype != torch.float64:  # a float32 value read by float16 code
                    return x.to(self.dtype).float()
                if x.dtype != storage:
                    return x.to(storage)
            if isinstance(x, torch.dtype) and x in WIDE:
                return storage
            return x

        if func in (torch.Tensor.float, torch.Tensor.double):
            return self.round(args[0]) if low else args[0].float()
        if low and getattr(func, "__name__", "") in DATA_MOVEMENT:
            return func(*args, **kwargs)  # no arithmetic: the values keep the precision they came in
        inplace = _inplace(func)
        if inplace:
            args = (args[0], *tree_map(cast, tuple(args[1:]))) if args else args
        else:
            args = tree_map(cast, tuple(args))
        kwargs = {k: (v if k == "out" else tree_map(cast, v)) for k, v in kwargs.items()}
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError) as e:
            if not low or "Half" not in str(e) or inplace:
                raise
            up = lambda x: x.float() if isinstance(x, torch.Tensor) and x.dtype == self.dtype else x  # noqa: E731
            out = func(*tree_map(up, args), **{k: tree_map(up, v) for k, v in kwargs.items()})
        if low and inplace and self.emulate and isinstance(out, torch.Tensor) and out.dtype in WIDE:
            with torch.no_grad():
                out.copy_(out.to(self.dtype))
            return out
        return self.round(out) if low and not inplace else out


def _cast_module(module: torch.nn.Module, dtype) -> None:
    """Parameters, buffers and plain tensor attributes (TorchSTFT's window) to `dtype`."""
    module.to(dtype)
    for m in module.modules():
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.is_floating_point() and not isinstance(value, torch.nn.Parameter):
                setattr(m, name, value.to(dtype))


def _restore_float32(sub: torch.nn.Module, original: torch.nn.Module) -> None:
    """A kept module's parameters, buffers and tensor attributes as float32 copies of the original's:
    casting the float16 copy back up would keep float16's rounding in the island's weights (the
    `fp16` backend's kept nodes read the float32 weights too)."""
    _cast_module(sub, torch.float32)
    src = {n: t for n, t in [*original.named_parameters(), *original.named_buffers()]}
    with torch.no_grad():
        for name, t in [*sub.named_parameters(), *sub.named_buffers()]:
            if t.is_floating_point() and name in src:
                t.copy_(src[name])
    for path, m in sub.named_modules():
        o = original.get_submodule(path) if path else original
        for name, value in list(vars(m).items()):
            if (isinstance(value, torch.Tensor) and value.is_floating_point()
                    and not isinstance(value, torch.nn.Parameter)):
                setattr(m, name, getattr(o, name).to(torch.float32))


class Mixed:
    """A copy of `module` in float16 with the submodules of `keep` (paths relative to the KModel,
    i.e. without the step's `kmodel.`) in float32. Call it with float32 inputs; it returns float32
    outputs computed in mixed precision."""

    def __init__(self, module: torch.nn.Module, keep: Iterable[str] = (), dtype=torch.float16, emulate: bool = False):
        self.module = copy.deepcopy(module)
        self.keep = sorted(set(keep))
        self.mode = Float16Mode(dtype, emulate)
        _cast_module(self.module, dtype)
        if emulate:  # float16 weights, stored as float32
            _cast_module(self.module, torch.float32)
        originals = dict(module.named_modules())
        found = set()
        for path, sub in self.module.named_modules():
            p = _strip(path)
            # every module inside a kept one is an island too: step code may call a child directly
            # (F0NStep runs predictor.shared and predictor.F0 without predictor.forward), and the
            # backends tag a node by its module path, so a kept parent keeps its children's nodes
            if under(p, self.keep) and _kmodel_path(self.module, path):
                found.add(p)
                _restore_float32(sub, originals[path])
                self._wrap(sub)
        missing = [k for k in self.keep if k not in found]
        if missing:
            raise UnknownName(f"keep-list: no module {', '.join(missing)} in this step")

    def _wrap(self, sub: torch.nn.Module) -> None:
        forward, mode = sub.forward, self.mode

        def island(*args, **kwargs):
            mode.region.append(torch.float32)
            try:
                out = forward(*args, **kwargs)
            finally:
                mode.region.pop()
            # no cast at the boundary: float16 code rounds what it reads, and a kept neighbour reads float32
            # (Core ML's op_selector and the fp16 backend's graph cast only between float16 and float32 ops)
            return out

        sub.forward = island

    def __call__(self, *inputs):
        with torch.no_grad(), self.mode:
            out = self.module(*inputs)
        return tree_map(lambda x: x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, out)
