"""The forms a keep-list takes in a backend: the keep-list JSON ($KOKORO_PARITY_KEEP_FP32), the
nodes of an exported program that compute in float32 with it (`island_nodes`), the `fp16` backend's
mixed graph (`keep_float32_graph`) and Core ML's `op_selector` (`op_selector_for`). Backends import
this module; it imports no backend.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

import torch.fx

from ..plumbing.files import content_key
from .float16 import under
from ..plumbing.errors import UsageError

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


def node_module_path(node) -> str:
    """The KModel path of an FX node of an exported step (`decoder.generator.m_source`), from its
    `nn_module_stack`; `<top>` for the step's own code. A step holds the KModel as `kmodel`, an e2e
    stage inside wrappers of its own (`decoder.kmodel.decoder.generator`): the path after the last
    `kmodel` is the KModel's, which keep-lists name."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "<top>"
    path = ""
    for entry, _ in stack.values():  # an entry may be relative to its parent (patched forwards)
        path = entry if not path or entry.startswith(path) else f"{path}.{entry}"
    parts = path.removeprefix("L['self'].").split(".")
    if "kmodel" in parts:
        parts = parts[len(parts) - parts[::-1].index("kmodel"):]
    return ".".join(parts) or "<top>"


def read_keep_list(path: str | Path | None = None) -> list[str]:
    """The module paths of a keep-list JSON ($KOKORO_PARITY_KEEP_FP32 when `path` is None); [] when
    neither is set. A bad file is a ValueError naming it."""
    path = path or os.environ.get(KEEP_ENV)
    if not path:
        return []
    try:
        data = json.loads(Path(path).read_text())
        keep = data["keep_fp32"] if isinstance(data, dict) else data
        if not isinstance(keep, list) or not all(isinstance(k, str) for k in keep):
            raise TypeError("field 'keep_fp32' must be a list of module paths")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"keep-list {path} (${KEEP_ENV}): {type(e).__name__}: {e}") from None
    return sorted(set(keep))


def keep_tag(keep: list[str]) -> str:
    """Part of a backend's `version()` (so of its artifact key) when it keeps modules in float32."""
    return f";keep-fp32={content_key('keep', *keep)[:12]}" if keep else ""


def island_nodes(graph, keep: list[str]) -> set:
    """The call_function nodes of an exported step's `graph` that compute in float32 with `keep`: the
    nodes inside the kept modules, and the data-movement nodes (views, reshapes, indexing: no
    arithmetic) between them, so that an island reads a program input or another island's output
    through them unrounded (the Generator's `f0[:, None]` before `f0_upsamp`): a move joins when every
    user is an island node, or when it reads only islands and inputs and an island or the output
    reads it (its float16 users get a cast). The second rule is the emulation's (a move keeps the
    precision it reads): without it the e2e synthesizer's F0, squeezed in the step's own code and
    read by `decoder.F0_conv` (float16) and the generator (kept), reached SineGen rounded to float16:
    audio rel L2 0.082 on the `fp16` backend where the emulation gave 0.017 (docs/precision.md)."""
    moves = {"view", "_unsafe_view", "unsqueeze", "squeeze", "transpose", "permute", "reshape", "expand", "slice",
             "select", "clone", "alias", "t", "getitem", "split", "split_with_sizes", "chunk", "unbind", "flatten",
             "unflatten", "contiguous"}

    def op_name(n) -> str:
        return getattr(n.target, "_opname", None) or getattr(n.target, "__name__", str(n.target))

    nodes = [n for n in graph.nodes if n.op == "call_function"]
    island = {n for n in nodes if any(node_module_path(n) == k or node_module_path(n).startswith(k + ".")
                                      for k in keep)}
    moving = [n for n in nodes if op_name(n) in moves and n not in island]
    grew = True
    while grew:  # to a fixed point: a chain of moves joins whole, from either end
        grew = False
        for n in moving:
            if n in island or not n.users:
                continue
            into = all(u in island for u in n.users)
            out_of = (n.all_input_nodes and all(a in island or a.op in ("get_attr", "placeholder")
                                                for a in n.all_input_nodes)
                      and any(u in island or u.op == "output" for u in n.users))
            if into or out_of:
                island.add(n)
                grew = True
    return island


def op_selector_for(exported_program, keep: list[str]):
    """A Core ML `op_selector` for `ct.transform.FP16ComputePrecision` that keeps in float32 the MIL
    ops converted from nodes inside the `keep` modules. It tags every node with a debug handle
    (coremltools carries `debug_handle` into the op's EXIR_DEBUG_HANDLE scope), so convert *this*
    program object. Returns (op_selector, number of nodes kept)."""
    # optional runtime: coreml extra
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


def not_in_program(graph, keep: list[str]) -> list[str]:
    """The kept modules with no node in an exported program's graph (another program's modules, or
    a module a patch makes): the backends list them in their run audit."""
    paths = {node_module_path(n) for n in graph.nodes if n.op == "call_function"}
    return sorted(k for k in keep if not any(under(p, [k]) for p in paths))


def keep_float32_graph(gm16, gm32, keep: list[str]):
    """The fp16 backend's graph (`gm16`, all float16) with the nodes inside `keep` (`island_nodes`)
    computing in float32: their float inputs cast up (their weights taken from the float32 `gm32`),
    the dtypes they hard-code restored, and their float outputs cast down where a float16 node reads
    them. The graph takes its float inputs in **float32** (as a Core ML model with float32 inputs
    does): an island reads them as they are, float16 nodes through a cast. A kept module with no
    node in the graph is skipped (an e2e keep-list names modules of both its programs), except one
    that a patch makes: a ValueError, the program must be exported with the patch."""
    island = island_nodes(gm16.graph, keep)
    absent = not_in_program(gm16.graph, keep)
    made = sorted(k for k in absent if any(under(k, mods) for mods in ISLAND_MODULES.values()))
    if made:
        raise UsageError(f"keep-list: no node of {', '.join(made)} in the program; a module made by a patch "
                         f"needs the program exported with it (--with-patch {' --with-patch '.join(ISLAND_PATCHES)})")

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
