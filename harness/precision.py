"""Float16 judged by its own floor, and the float32 islands that make a float16 port sound right.

- `Float16Mode` runs eager PyTorch in float16 the way `harness.backends.fp16` runs an exported
  program (its `_to_dtype`: weights, constants *and* the float32 the code hard-codes become float16),
  with module-level mixed precision: the modules of `keep` run in float32 with their own float32
  weights, on inputs as precise as they arrive (a step input read through views stays float32), and
  their outputs are rounded where float16 code reads them (what Core ML's `op_selector` and the
  `fp16` backend's `keep_float32_graph` do with an op-level float32 island).
- `float16_outputs` gives a step's outputs in float16 eager: the float16 floor of
  `harness.reference.float16_outputs` is their error against float64.
- `search` finds the smallest set of modules to keep in float32 so that the float16 run is
  *shippable* (`harness.verdict.shippable`) on every selected case: the per-module error and range
  audit ranks the candidates, a greedy pass adds the one of most measured benefit until every case
  is shippable, and a pruning pass drops those no longer needed.
- `write_keep_list` emits the result in the two forms porters use: a keep-list JSON (read by the
  `fp16` and `coreml-fp16` backends through $KOKORO_PARITY_KEEP_FP32) and a standalone Python file
  with a Core ML `op_selector` for `ct.transform.FP16ComputePrecision`.
"""
from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .backends.fp16 import node_module_path  # noqa: F401 - also inlined into the op_selector file

# Semantics-preserving patches that turn code a module's forward runs inline into submodules, so that a
# keep-list can name it: the vocoder's STFT (`decoder.generator.stft.analysis`) and iSTFT (`.synthesis`).
# A keep-list naming their modules needs the backend's program exported with them (`--with-patch`).
ISLAND_PATCHES = ("stft_islands",)
ISLAND_MODULES = {"stft_islands": ("decoder.generator.stft.analysis", "decoder.generator.stft.synthesis")}


def patches_for(keep: Iterable[str]) -> list[str]:
    """The ISLAND_PATCHES that a keep-list's modules need (the backend's program exported with them)."""
    return [p for p, mods in ISLAND_MODULES.items() if any(under(k, mods) for k in keep)]
KEEP_ENV = "KOKORO_PARITY_KEEP_FP32"  # a keep-list JSON: the fp16 / coreml-fp16 backends keep its modules in float32
KEEP_SCHEMA = "kokoro-parity/keep-fp32/1"
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
            raise KeyError(f"keep-list: no module {', '.join(missing)} in this step")

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


def float16_outputs(step, km: torch.nn.Module, inputs: dict[str, torch.Tensor], keep: Iterable[str] = (),
                    emulate: bool = True) -> dict:
    """`step` (harness.steps.Step) of `km` in float16 eager (with `keep` in float32) on float32
    `inputs`: {output name: float32 tensor}."""
    from .reference import as_outputs

    return as_outputs(step, Mixed(step.module(km), keep, emulate=emulate)(*inputs.values()))


# ---- the per-module audit -------------------------------------------------------------------------

FP16_MAX = 65504.0


def module_audit(module: torch.nn.Module, inputs: list, depth: int = 4, dtype=torch.float16,
                 emulate: bool = True) -> list[dict]:
    """Per submodule (up to `depth` levels below the KModel): its largest float32 activation against
    float16's 65,504, and its *local* float16 error: the module alone in float16 on its exact float32
    inputs, against its float32 output (relative L2; inf when float16 is non-finite); and its
    `producers`, the modules whose outputs (or views of them) it reads. Sorted worst first."""
    rows: dict[str, dict] = {}
    hooks = []
    made: dict[int, str] = {}  # storage of a module's output -> the first module that made it
    keep_alive = []  # outputs kept referenced, so that no storage is reused within the audit

    def storages(obj) -> set[int]:
        # tree_flatten, not tree_map: a PackedSequence (the duration LSTMs' input) cannot be rebuilt
        return {x.untyped_storage().data_ptr() for x in tree_flatten(obj)[0]
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()}

    def rel(a, b) -> float:
        a, b = a.double(), b.double()
        if not torch.isfinite(a).all():
            return math.inf
        n = float(b.norm())
        return float((a - b).norm()) / n if n else float((a - b).norm() != 0)

    for path, sub in module.named_modules():
        p = _strip(path)
        if not path or path == "kmodel" or p.count(".") >= depth or not _kmodel_path(module, path):
            continue

        def hook(m, args, kwargs, out, p=p):
            floats = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if p in rows or not floats:
                return
            peak = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in floats)
            row = {"module": p, "type": type(m).__name__, "max_abs_fp32": peak, "of_fp16_max": peak / FP16_MAX,
                   "params": sum(q.numel() for q in m.parameters())}
            try:
                half = Mixed(_detached(m), dtype=dtype, emulate=emulate)
                local = [t for t in tree_flatten(half(*args, **kwargs))[0]
                         if isinstance(t, torch.Tensor) and t.is_floating_point()]
                # the worst of its outputs: the STFT's phase, not its magnitude, is what float16 breaks
                row["local_rel_l2"] = max(rel(lo, fo) for lo, fo in zip(local, floats))
            except Exception as e:  # noqa: BLE001 - a module that cannot run alone is still listed
                row["local_rel_l2"], row["local_error"] = math.nan, f"{type(e).__name__}: {e}"[:160]
            row["producers"] = sorted({made[s] for s in storages((args, kwargs)) if s in made} - {p})
            for s in storages(out):
                made.setdefault(s, p)
            keep_alive.append(out)
            rows[p] = row

        hooks.append(sub.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            module(*inputs)
    finally:
        for h in hooks:
            h.remove()
    return sorted(rows.values(), key=_audit_order)


def _audit_order(r: dict) -> tuple:
    """Worst local float16 error first (a module that cannot run alone last), then the largest range."""
    return -(r["local_rel_l2"] if not math.isnan(r["local_rel_l2"]) else -1), -r["of_fp16_max"]


def _detached(m: torch.nn.Module) -> torch.nn.Module:
    """A copy of a submodule without the audit's hooks."""
    c = copy.deepcopy(m)
    for s in c.modules():
        s._forward_hooks.clear()
        s._forward_hooks_with_kwargs.clear() if hasattr(s, "_forward_hooks_with_kwargs") else None
    return c


# ---- the forms a keep-list takes in a backend -----------------------------------------------------

def read_keep_list(path: str | Path | None = None) -> list[str]:
    """The module paths of a keep-list JSON ($KOKORO_PARITY_KEEP_FP32 when `path` is None); [] when
    neither is set. A bad file is a ValueError naming it."""
    import os

    path = path or os.environ.get(KEEP_ENV)
    if not path:
        return []
    try:
        data = json.loads(Path(path).read_text())
        keep = data["keep_fp32"] if isinstance(data, dict) else data
        if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
            raise TypeError("field 'keep_fp32' must be a list of module paths")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"keep-list {path} (${KEEP_ENV}): {type(e).__name__}: {e}") from None
    return sorted(set(keep))


def keep_tag(keep: list[str]) -> str:
    """Part of a backend's `version()` (so of its artifact key) when it keeps modules in float32."""
    from .plumbing.files import content_key

    return f";keep-fp32={content_key('keep', *keep)[:12]}" if keep else ""


def island_nodes(graph, keep: list[str]) -> set:
    """The call_function nodes of an exported step's `graph` that compute in float32 with `keep`: the
    nodes inside the kept modules, and the data-movement nodes (views, reshapes, indexing: no
    arithmetic) whose every user is one of them, so that an island reads a program input or another
    island's output through them unrounded (the Generator's `f0[:, None]` before `f0_upsamp`)."""
    moves = {"view", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "permute", "reshape", "expand", "slice",
             "select", "clone", "alias", "t", "getitem", "split", "split_with_sizes", "chunk", "unbind", "flatten",
             "unflatten", "contiguous"}

    def op_name(n) -> str:
        return getattr(n.target, "_opname", None) or getattr(n.target, "__name__", str(n.target))

    nodes = [n for n in graph.nodes if n.op == "call_function"]
    island = {n for n in nodes if any(node_module_path(n) == k or node_module_path(n).startswith(k + ".")
                                      for k in keep)}
    for n in reversed(nodes):  # users first: a chain of moves into an island joins whole
        if n not in island and op_name(n) in moves and n.users and all(u in island for u in n.users):
            island.add(n)
    for n in nodes:  # and a chain from an island to the program's outputs (its outputs stay float32)
        if (n not in island and op_name(n) in moves and n.all_input_nodes and n.users
                and all(a in island or a.op == "get_attr" for a in n.all_input_nodes)
                and all(u in island or u.op == "output" for u in n.users)):
            island.add(n)
    return island


def op_selector_for(exported_program, keep: list[str]):
    """A Core ML `op_selector` for `ct.transform.FP16ComputePrecision` that keeps in float32 the MIL
    ops converted from nodes inside the `keep` modules. It tags every node with a debug handle
    (coremltools carries `debug_handle` into the op's EXIR_DEBUG_HANDLE scope), so convert *this*
    program object. Returns (op_selector, number of nodes kept)."""
    from coremltools.converters.mil.mil.scope import ScopeSource

    island = island_nodes(exported_program.graph, keep)
    kept = set()
    for i, node in enumerate(exported_program.graph.nodes, start=1):
        node.meta["debug_handle"] = i
        if node in island:
            kept.add(i)

    def op_selector(op) -> bool:
        """True: the op is cast to float16; False: it stays in float32."""
        handles = op.scopes.get(ScopeSource.EXIR_DEBUG_HANDLE, []) if hasattr(op, "scopes") else []
        return not any(h in kept for h in handles if h is not None)

    return op_selector, len(kept)


def keep_float32_graph(gm16, gm32, keep: list[str]):
    """The fp16 backend's graph (`gm16`, all float16) with the nodes inside `keep` (`island_nodes`)
    computing in float32: their float inputs cast up (their weights taken from the float32 `gm32`),
    the dtypes they hard-code restored, and their float outputs cast down where a float16 node reads
    them. The graph takes its float inputs in **float32** (as a Core ML model with float32 inputs
    does): an island reads them as they are, float16 nodes through a cast. A kept module with no
    node in the graph is a ValueError (a module that a patch makes needs the program exported with it)."""
    import torch.fx

    island = island_nodes(gm16.graph, keep)
    found = {k for n in island for k in keep if under(node_module_path(n), [k])}
    if set(keep) - found:
        raise ValueError(f"keep-list: no node of {', '.join(sorted(set(keep) - found))} in the program; a module "
                         f"made by a patch needs the program exported with it (--with-patch "
                         f"{' --with-patch '.join(ISLAND_PATCHES)})")

    def kept_node(n) -> bool:
        return n in island

    def is_float(n) -> bool:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.is_floating_point()
        if n.op == "get_attr":
            return isinstance(v := _attr(gm32, n.target), torch.Tensor) and v.is_floating_point()
        return False

    g = gm16.graph
    originals = {n.name: n for n in gm32.graph.nodes}
    kept = {n for n in g.nodes if kept_node(n)}
    up_attrs: dict[str, torch.fx.Node] = {}
    casts: dict[tuple[str, Any], torch.fx.Node] = {}

    def cast(a, n, dtype):
        key = (a.name, dtype)
        if key not in casts:
            with g.inserting_after(a):
                casts[key] = g.call_function(torch.ops.aten._to_copy.default, (a,), {"dtype": dtype})
        n.replace_input_with(a, casts[key])

    for n in list(g.nodes):
        if n in kept:
            o = originals.get(n.name)
            if o is not None:  # the dtypes of the original (float32) node
                n.args = tuple(oa if isinstance(oa, torch.dtype) else a for a, oa in zip(n.args, o.args))
                if "dtype" in o.kwargs:
                    n.kwargs = {**n.kwargs, "dtype": o.kwargs["dtype"]}
            for a in list(n.all_input_nodes):
                if a in kept or a.op == "placeholder" or not is_float(a):  # inputs arrive in float32
                    continue
                if a.op == "get_attr":  # its float32 weights, not the float16 ones cast back
                    if a.target not in up_attrs:
                        name = a.target.replace(".", "_") + "_fp32"
                        setattr(gm16, name, _attr(gm32, a.target))
                        with g.inserting_after(a):
                            up_attrs[a.target] = g.get_attr(name)
                    n.replace_input_with(a, up_attrs[a.target])
                else:
                    cast(a, n, torch.float32)
        elif n.op != "output":
            for a in list(n.all_input_nodes):
                if (a in kept or a.op == "placeholder") and is_float(a):
                    cast(a, n, torch.float16)
    g.lint()
    gm16.recompile()
    return gm16


def _attr(gm, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ---- the search ---------------------------------------------------------------------------------

@dataclass
class Target:
    """One case's step, as the search runs it: the float32 step module (the reference's patches and
    the backend's semantics-changing ones), its float32 inputs and the float64 reference outputs."""

    case: str
    step: Any  # harness.steps.Step
    module: torch.nn.Module
    inputs: list
    fp64: dict[str, torch.Tensor]
    valid: Callable[[str, torch.Tensor], torch.Tensor]


# `--step e2e`: the two programs of the e2e item (harness.e2e), judged as ports run them: the
# duration stage by its durations, the synthesizer by its audio with the reference's durations
# (so a duration that rounds differently is counted once, at its stage, not again as audio).
E2E_STAGES = ("duration_stage", "synthesizer")


def targets_for(model, case_ids: list[str] | None, step: str, mode: str = "dynamic",
                patches: Iterable[str] | None = None) -> list[Target]:
    """The search's targets: one per case (per case and stage for `e2e`), with the patches of the
    `fp16` backend's programs and ISLAND_PATCHES (bit-exact; they make code that a module runs as
    methods keepable)."""
    from .backends.fp16 import Fp16Backend
    from .cases import case_dirs, configured_dirs, load_cases
    from .patches import affecting, apply_patches
    from .reference import NEUTRAL_PATCHES, REFERENCE_PATCHES, load_traces, references_for
    from .steps import get_step

    if step == "e2e" and mode != "dynamic":
        raise ValueError("--step e2e: dynamic mode only (the e2e item's static buckets pad the synthesizer, a "
                         "rewrite of its own; search the static decoder with --step decoder --mode static)")
    steps = E2E_STAGES if step == "e2e" else (step,)
    patches = tuple((*Fp16Backend.patches, *ISLAND_PATCHES) if patches is None else patches)
    out = []
    for case in load_cases(case_dirs(configured_dirs()), only=case_ids):
        traces = load_traces(model, case)
        for name in steps:
            s = get_step(name)
            # an e2e stage gets the patches of both (a keep-list names modules of either; a patch
            # that cannot change a stage leaves it as it is)
            variant = tuple(dict.fromkeys(p for n in steps for p in affecting(
                [p for p in patches if p not in REFERENCE_PATCHES[mode] and p not in NEUTRAL_PATCHES], n)))
            km = apply_patches(model.kmodel, (*REFERENCE_PATCHES[mode], *variant))
            if step == "e2e":  # the stages' inputs are the chain's, exact lengths: nothing to trim
                inputs = [traces.chain[k] for k in s.input_names]
                fp64 = _e2e_fp64(model, case, traces, s, km, inputs, variant)
                valid = lambda n, t: t  # noqa: E731
            else:
                inputs = list(traces.inputs(name, mode, "float32").values())
                fp64 = references_for(model, case, traces, name, mode, patches).fp64
                valid = lambda n, t, traces=traces, name=name: traces.valid_region(name, n, t)  # noqa: E731
            out.append(Target(case.id if len(steps) == 1 else f"{case.id}:{name}", s, s.module(km), inputs, fp64, valid))
    return out


def _e2e_fp64(model, case, traces, step, km, inputs, variant) -> dict[str, torch.Tensor]:
    """float64 outputs of an e2e stage: the synthesizer's is the e2e item's own (cached), the
    duration stage's is one cheap float64 pass here."""
    from .patches import to_float64
    from .reference import as_outputs, synthesizer_reference

    if step.name == "synthesizer":
        return {"audio": synthesizer_reference(model, case, traces, tuple(variant))["float64"]}
    with torch.no_grad():
        return as_outputs(step, step.module(to_float64(copy.deepcopy(km)))(
            *[x.double() if x.is_floating_point() else x for x in inputs]))


@dataclass
class Evaluation:
    case: str
    keep: list[str]
    shippable: bool | None
    why: str
    badness: float  # 0 when shippable; how far from the bars otherwise (the search minimizes it)
    metrics: dict[str, dict[str, float]]  # per output: rel_l2, nan_rate, and the audio bars' metrics
    seconds: float


AUDIO_KEYS = ("pesq", "mcd_db", "rms_ratio_db")


def evaluate(target: Target, keep: Iterable[str], tol, emulate: bool = True) -> Evaluation:
    """Run the target's step in float16 with `keep` in float32 and judge it by the shippable bar."""
    from .metrics.audio import audio_metrics
    from .metrics.tensor import error_metrics
    from .reference import as_outputs
    from .verdict import shippable

    start = time.perf_counter()
    keep = sorted(keep)
    outs = as_outputs(target.step, Mixed(target.module, keep, emulate=emulate)(*target.inputs))
    metrics, audio, durations = {}, {}, {}
    for spec in target.step.outputs:
        n = spec.name
        o, r = target.valid(n, outs[n]), target.valid(n, target.fp64[n])
        e = error_metrics(o, r)
        metrics[n] = {"rel_l2": e["rel_l2"], "nan_rate": e["nan_rate"]}
        if "samples" in spec.axes.values():
            a = audio_metrics(r[0].double().numpy(), o[0].double().numpy())
            audio[n] = a
            metrics[n].update({k: a[k] for k in AUDIO_KEYS})
        if n == "duration":
            durations[n] = (o, r)
    ok, why = shippable(tol, audio, durations)
    bad = 0.0
    for a in audio.values():
        if a.get("nan_rate") or a.get("inf_rate") or math.isnan(a["pesq"]) or math.isnan(a["mcd_db"]):
            bad += 100.0
            continue
        bad += (max(0.0, tol.min_pesq - a["pesq"]) + max(0.0, a["mcd_db"] - tol.max_mcd_db)
                + max(0.0, abs(a["rms_ratio_db"]) - tol.max_level_db))
    for o, r in durations.values():
        o = o.double()
        if not torch.isfinite(o).all():  # worse than every duration rounding differently
            bad += 100.0 + o.numel()
            continue
        rr = lambda x: torch.round(x).clamp(min=1)  # noqa: E731
        bad += float((rr(o) != rr(r.double())).sum())
    if ok is None:  # no audio, no duration: not a search this tool can do
        raise ValueError(f"step {target.step.name!r} has no audio or duration output: nothing to judge as shippable "
                         f"(use decoder, generator or duration)")
    return Evaluation(target.case, keep, ok, why, 0.0 if ok else bad, metrics, round(time.perf_counter() - start, 1))


def candidates(audit: list[dict], root: str) -> list[str]:
    """Modules worth trying, worst local float16 error first: not the step itself, not a module
    whose error one of its descendants already explains (>= half of it), not an exact one."""
    rows = [r for r in audit if r["module"] != root and r["local_rel_l2"] > 0]
    out = []
    for r in rows:
        own = r["local_rel_l2"]
        explained = any(d["module"].startswith(r["module"] + ".") and d["local_rel_l2"] >= 0.5 * own for d in rows)
        if not explained:
            out.append(r["module"])
    return out


def block_of(path: str) -> str:
    """The block a module belongs to: the innermost ancestor that is an element of a ModuleList or
    Sequential (`predictor.F0.1.conv1` -> `predictor.F0.1`), else the module itself. A chain kept
    per block reads as a porter's sentence ("the F0 blocks in float32") and skips no inner layer."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return path


def upstream(keep: Iterable[str], audit: list[dict], root: str) -> list[str]:
    """Everything the kept modules read, transitively (the audit's `producers`), lifted to blocks:
    a float32 island fed by a float16 chain gets its input rounded at every link (SineGen integrates
    an F0 that `predictor.shared` -> `F0` -> `F0_proj` -> `f0_upsamp` computes), and keeping one link
    alone changes nothing, so the greedy pass needs the whole chain as one candidate."""
    by_module = {r["module"]: r for r in audit}
    keep = list(keep)
    seen: set[str] = set()
    todo = [p for k in keep for p in by_module.get(k, {}).get("producers", [])]
    while todo:
        p = todo.pop()
        if p in seen or p == root or under(p, keep) or p not in by_module:
            continue
        seen.add(p)
        todo += by_module[p].get("producers", [])
    return _normalize(block_of(p) for p in seen if not any(k.startswith(p + ".") for k in keep))


def _children(module: torch.nn.Module) -> dict[str, list[str]]:
    """Module path -> its children's paths (KModel paths, as keep-lists name them)."""
    out: dict[str, list[str]] = {}
    for path, sub in module.named_modules():
        p = _strip(path)
        out[p] = [f"{p}.{n}" if p else n for n, _ in sub.named_children()]
    return out


def enclosing(keep: Iterable[str], children: Mapping[str, list[str]], root: str) -> list[str]:
    """Parents of two or more kept modules that still run code of their own in float16: the ops of
    a parent's `forward` between its kept children (the Generator's sums, activations and the
    exp/sin before the iSTFT) are on the signal's main path, and no child kept alone covers them.
    Innermost first; a parent whose every child is already kept adds nothing and is left out."""
    keep = list(keep)
    out = []
    for k in keep:
        parts = k.split(".")
        for i in range(len(parts) - 1, 0, -1):
            p = ".".join(parts[:i])
            if p == root or under(p, keep) or p in out:
                continue
            if sum(1 for o in keep if o.startswith(p + ".")) >= 2 and not all(
                    under(c, keep) for c in children.get(p, [])):
                out.append(p)
    return sorted(out, key=lambda p: -p.count("."))


def _normalize(keep: Iterable[str]) -> list[str]:
    """Drop modules inside another kept one."""
    keep = sorted(set(keep))
    return [k for k in keep if not any(k != o and k.startswith(o + ".") for o in keep)]


@dataclass
class SearchResult:
    step: str
    cases: list[str]
    keep: list[str]
    reached: bool  # shippable on every case with `keep`
    before: list[Evaluation]
    after: list[Evaluation]
    audit: list[dict]
    rounds: list[dict] = field(default_factory=list)
    share: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    emulate: bool = True


def search(targets: list[Target], tol, depth: int = 5, top_k: int = 4, max_rounds: int = 8, emulate: bool = True,
           log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """The smallest set of modules to keep in float32 so that every target is shippable: the audit
    ranks the candidates (module alone in float16, local error), a greedy pass adds the candidate of
    most measured benefit (the one that lowers the worst case's distance to the bars most; top_k
    single modules tried per round, plus the kept modules' whole upstream chain as one candidate and
    the innermost parent of kept modules that runs code of its own), then a pruning pass drops every
    module the set no longer needs.

    Longer than 80 lines on purpose: audit, greedy rounds and pruning share `keep`, `current` and
    the per-step rankings, and read as one algorithm top to bottom; split, they would pass all
    of that state back and forth."""
    start = time.perf_counter()
    step = targets[0].step

    def run_all(keep, stop_on_fail: bool = False):
        evs = []
        for t in targets:
            e = evaluate(t, keep, tol, emulate)
            evs.append(e)
            log(f"  {e.case}: keep {e.keep or '-'}: {'SHIPPABLE' if e.shippable else 'not shippable'} "
                f"({e.why}) [{e.seconds} s]")
            if stop_on_fail and not e.shippable:
                break
        return evs

    log(f"float16 everywhere, {len(targets)} case(s):")
    before = current = run_all([])
    smallest = smallest_per_step(targets)
    audits: dict[str, list[dict]] = {}  # per step (two for e2e): a case is helped only by modules its step runs
    ranked: dict[str, list[str]] = {}
    for small in smallest:
        log(f"audit: each module (<= {depth} levels) alone in float16 on its float32 inputs ({small.case}, the "
            f"smallest)")
        audits[small.step.name] = module_audit(small.module, small.inputs, depth, emulate=emulate)
        ranked[small.step.name] = candidates(audits[small.step.name], small.step.module_path)
        log("  candidates: " + ", ".join(ranked[small.step.name][:top_k * 3]))
    audit = sorted((r for rows in audits.values() for r in rows), key=_audit_order)
    tree = {t.step.name: _children(t.module) for t in smallest}
    root = step.module_path
    keep: list[str] = []
    rounds = []
    stuck: set[int] = set()  # cases no candidate of their step helps: the search goes on with the others
    while not all(e.shippable for e in current) and sum(1 for r in rounds if r.get("kept")) < max_rounds:
        open_cases = [i for i in range(len(targets)) if not current[i].shippable and i not in stuck]
        if not open_cases:
            break
        worst = max(open_cases, key=lambda i: current[i].badness)
        in_step = audits[targets[worst].step.name]
        # the modules that feed a kept one first: an island's input arrives rounded to float16 otherwise
        # (SineGen integrates its F0: a float16 F0 is a frequency error that the phase accumulates)
        by_module = {r["module"]: r for r in in_step}
        feeding = [p for k in keep for p in by_module.get(k, {}).get("producers", [])
                   if not under(p, keep) and not any(k.startswith(p + ".") for k in keep) and p != root
                   and p in by_module]
        singles = list(dict.fromkeys([*feeding, *(c for c in ranked[targets[worst].step.name]
                                                  if not under(c, keep))]))[:top_k]
        # an option is a set of modules: one module, or the kept modules' whole upstream chain
        options = [(c,) for c in singles]
        chain = tuple(upstream(keep, in_step, root))
        if len(chain) > 1 and chain not in options:
            options.append(chain)
        options += [(p,) for p in enclosing(keep, tree[targets[worst].step.name], root) if (p,) not in options][:1]
        if not options:
            log(f"  no candidate left for {targets[worst].case}")
            stuck.add(worst)
            continue
        label = lambda o: o[0] if len(o) == 1 else "upstream chain [" + ", ".join(o) + "]"  # noqa: E731
        log(f"round {len(rounds) + 1}: on {targets[worst].case} (distance {current[worst].badness:.3f}), trying "
            + "; ".join(label(o) for o in options))
        tried = {}
        for o in options:
            e = evaluate(targets[worst], _normalize([*keep, *o]), tol, emulate)
            tried[o] = e
            log(f"  + {label(o)}: distance {e.badness:.3f} ({e.why}) [{e.seconds} s]")
            if e.badness == 0:  # shippable on this case: no other option can do better
                break
        best = min(tried, key=lambda o: (tried[o].badness, len(o)))
        rounds.append({"case": targets[worst].case, "tried": {",".join(o): e.badness for o, e in tried.items()},
                       "chosen": ",".join(best)})
        if tried[best].badness >= current[worst].badness - 1e-6:
            log(f"  no candidate lowers {targets[worst].case}'s distance: on with the other cases")
            stuck.add(worst)
            continue
        keep = _normalize([*keep, *best])
        rounds[-1]["kept"] = True
        ranked = {name: [c for c in rows if not under(c, keep)] for name, rows in ranked.items()}
        log(f"  keep {label(best)}")
        current = run_all(keep)
    if all(e.shippable for e in current) and len(keep) > 1:
        log("pruning:")
        for k in list(keep):
            trial = [x for x in keep if x != k]
            evs = run_all(trial, stop_on_fail=True)
            if len(evs) == len(targets) and all(e.shippable for e in evs):
                keep, current = trial, evs
                log(f"  dropped {k}: not needed")
    result = SearchResult(step_label(targets), [t.case for t in targets], keep, all(e.shippable for e in current),
                          before, current, audit, rounds, emulate=emulate)
    result.share = share_of(smallest, keep)
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def verify(targets: list[Target], keep: Iterable[str], tol, emulate: bool = True,
           log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """A given float32 set judged on every target, no search: to check a set found on some cases on
    others (en_long), or a set a porter already ships. Before: float16 everywhere."""
    start = time.perf_counter()
    keep = _normalize(keep)
    results = {}
    for label, k in (("float16 everywhere", []), (f"keeping {', '.join(keep) or 'nothing'}", keep)):
        log(f"{label}, {len(targets)} case(s):")
        evs = results[label] = []
        for t in targets:
            e = evaluate(t, k, tol, emulate)
            evs.append(e)
            log(f"  {e.case}: {'SHIPPABLE' if e.shippable else 'not shippable'} ({e.why}) [{e.seconds} s]")
    before, after = results.values()
    result = SearchResult(step_label(targets), [t.case for t in targets], keep, all(e.shippable for e in after),
                          before, after, audit=[], emulate=emulate)
    result.share = share_of(smallest_per_step(targets), keep)
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def smallest_per_step(targets: list[Target]) -> list[Target]:
    """One target per step (two for `e2e`), the one with the fewest input elements: the audit's and
    the FLOP count's input."""
    size = lambda t: sum(x.numel() for x in t.inputs if isinstance(x, torch.Tensor))  # noqa: E731
    by_step: dict[str, Target] = {}
    for t in targets:
        if t.step.name not in by_step or size(t) < size(by_step[t.step.name]):
            by_step[t.step.name] = t
    return list(by_step.values())


def step_label(targets: list[Target]) -> str:
    """`e2e` for the e2e item's two stages, else the step's name (it names the emitted files)."""
    names = {t.step.name for t in targets}
    return "e2e" if names == set(E2E_STAGES) else targets[0].step.name


def share_of(targets: Target | list[Target], keep: list[str]) -> dict[str, Any]:
    """The kept modules' share of the steps' parameters (those of the modules that ran: a step module
    holds the whole KModel) and of their FLOPs (torch.utils.flop_counter: matmuls and convolutions),
    on each step's smallest inputs in float32, summed over the steps."""
    from torch.nn.modules.module import register_module_forward_hook
    from torch.utils.flop_counter import FlopCounterMode

    targets = [targets] if isinstance(targets, Target) else targets
    params: dict[str, int] = {}  # KModel path of a parameter -> elements
    total = kept = 0
    for target in targets:
        ran: set[int] = set()
        hook = register_module_forward_hook(lambda m, a, o: ran.add(id(m)))
        counter = FlopCounterMode(display=False)
        try:
            with torch.no_grad(), counter:
                target.module(*target.inputs)
        finally:
            hook.remove()
        for path, sub in target.module.named_modules():
            if id(sub) in ran and _kmodel_path(target.module, path):
                params.update((_strip(f"{path}.{n}"), q.numel()) for n, q in sub.named_parameters(recurse=False))
        counts = counter.get_flop_counts()
        total += sum(counts.get("Global", {}).values())
        # the outermost counted module inside the keep-list: a kept parent whose forward step code
        # skips (F0NStep calls predictor.shared) has no count of its own, its children do
        paths = {_strip(name.split(".", 1)[1]): sum(ops.values()) for name, ops in counts.items() if "." in name}
        kept += sum(n for p, n in paths.items() if under(p, keep) and not any(
            q != p and p.startswith(q + ".") and under(q, keep) for q in paths))
    total_p = sum(params.values())
    kept_p = sum(n for p, n in params.items() if under(p.rsplit(".", 1)[0], keep))
    return {"params": kept_p, "params_total": total_p, "params_share": kept_p / total_p if total_p else 0.0,
            "flops": kept, "flops_total": total, "flops_share": kept / total if total else 0.0}


# ---- emitting the result ------------------------------------------------------------------------

OP_SELECTOR_HEADER = '''"""Core ML float32 islands for Kokoro's {step} (kokoro-parity precision, {date}).

Keep these modules in float32 and the rest in float16 with coremltools' FP16ComputePrecision:

    import coremltools as ct
    from keep_fp32_op_selector import KEEP_FP32, op_selector_for

    program = ...  # the torch.export program of the step (module paths as in KModel: decoder.generator...)
    selector, n_kept = op_selector_for(program, KEEP_FP32)
    mlmodel = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17,
                         compute_precision=ct.transform.FP16ComputePrecision(op_selector=selector))

`op_selector_for` tags each FX node with a debug handle, which coremltools carries into each MIL op's
EXIR_DEBUG_HANDLE scope; an op from a node inside a kept module stays float32.
"""
KEEP_FP32 = {keep!r}


'''


def write_keep_list(result: SearchResult, out_dir: Path) -> dict[str, Path]:
    """The keep-list JSON (for $KOKORO_PARITY_KEEP_FP32: the fp16 and coreml-fp16 backends) and a
    standalone Core ML op_selector file."""
    import inspect

    from .plumbing.files import atomic_write_json, atomic_write_text

    out_dir = Path(out_dir)
    data = {"schema": KEEP_SCHEMA, "step": result.step, "cases": result.cases, "keep_fp32": result.keep,
            "with_patch": patches_for(result.keep),  # the patches the backend's program needs for these modules
            "reached": result.reached, "share": result.share, "emulated_float16": result.emulate,
            "before": [e.__dict__ for e in result.before], "after": [e.__dict__ for e in result.after]}
    paths = {"keep_list": out_dir / f"keep_fp32-{result.step}.json",
             "op_selector": out_dir / f"keep_fp32_op_selector-{result.step}.py"}
    atomic_write_json(paths["keep_list"], data)
    src = (OP_SELECTOR_HEADER.format(step=result.step, date=time.strftime("%Y-%m-%d"), keep=result.keep)
           + inspect.getsource(node_module_path) + "\n\n" + inspect.getsource(island_nodes) + "\n\n"
           + inspect.getsource(op_selector_for))
    atomic_write_text(paths["op_selector"], src)
    return paths
