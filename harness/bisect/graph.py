"""The step's program as an FX graph: carve subprograms, evaluate them in fp32 and fp64, and give
exported subprograms the step's node names back. Graph surgery only: no backend, no search."""
from __future__ import annotations

import copy
import math
import operator
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .. import progress


class BisectError(RuntimeError):
    """Bisection itself could not proceed (not a finding about the backend)."""


def is_tensor(node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def is_float(node) -> bool:
    return is_tensor(node) and node.meta["val"].is_floating_point()


def _mutates(node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def source_line(node) -> str:
    """The last frame of the node's stack trace inside kokoro, transformers' models (ALBERT) or the
    harness's patched forwards, else the last one outside torch, as `kokoro/istftnet.py:31 in forward: <code>`."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    frames = []
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith('File "'):
            path, _, rest = s[6:].partition('", line ')
            lineno, _, func = rest.partition(", in ")
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].strip().startswith("File") else ""
            frames.append((path, lineno, func, code))
    if not frames:
        return ""
    # transformers too: ALBERT's own line (modeling_albert.py), not kokoro's wrapper calling it
    inside = [f for f in frames if any(s in f[0] for s in ("/kokoro/", "/harness/patches/", "/transformers/models/"))]
    outside_torch = [f for f in frames if "site-packages/torch/" not in f[0]]
    path, lineno, func, code = (inside or outside_torch or frames)[-1]
    short = path.split("site-packages/")[-1]
    short = "harness/" + short.split("/harness/")[-1] if "/harness/" in short else short
    return f"{short}:{lineno} in {func}: {code}"


def module_stack(node) -> list[tuple[str, str]]:
    """(full path, type) from the outermost module in; a patched forward (kokoro's
    DurationEncoder) records its children relative to itself, so relative paths are joined."""
    out: list[tuple[str, str]] = []
    prev_raw, prev_base = None, ""
    for raw, typ in (node.meta.get("nn_module_stack") or {}).values():
        base = ""
        if out and out[-1][0] and raw and not raw.startswith(out[-1][0] + "."):
            if prev_raw and raw.startswith(prev_raw + "."):
                base = prev_base  # relative to the same module as the entry before
            else:
                base = out[-1][0] + "."
        out.append((base + raw, str(typ)))
        prev_raw, prev_base = raw, base
    return out


def module_path(node) -> str:
    stack = module_stack(node)
    return strip_kmodel(stack[-1][0]) if stack else ""



def strip_kmodel(path: str) -> str:
    return path[len("kmodel."):] if path.startswith("kmodel.") else path


class StepGraph:
    """The step's program as an unlifted FX graph: carve subprograms, evaluate references."""

    def __init__(self, program_path: Path, inputs: list):
        self.program = torch.export.load(str(program_path))
        self.gm = self.program.module()
        self.nodes = list(self.gm.graph.nodes)
        self.pos = {n.name: i for i, n in enumerate(self.nodes)}
        self.node = {n.name: n for n in self.nodes}
        placeholders = [n.name for n in self.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs):
            raise BisectError(f"program has {len(placeholders)} inputs, the item {len(inputs)}")
        self.inputs = dict(zip(placeholders, inputs))
        out = next(n for n in self.nodes if n.op == "output")
        self.outputs = [a.name for a in pytree.tree_leaves(out.args) if hasattr(a, "op")]
        self._values: dict[str, dict[str, Any]] = {}

    def closure(self, outputs: list[str], stop) -> tuple[set[str], list[str]]:
        """Nodes that `outputs` need, stopping at placeholders and at tensor-valued `stop` nodes
        (the subprogram's inputs, returned in graph order). A non-tensor stop is replaced by its
        inputs, and a value mutated in place inside is pulled inside (no input mutation)."""
        stop = set(stop)
        while True:
            keep, boundary, stack = set(), set(), list(outputs)
            while stack:
                name = stack.pop()
                if name in keep:
                    continue
                keep.add(name)
                n = self.node[name]
                if n.op == "placeholder" or (name in stop and name not in outputs and is_tensor(n)):
                    boundary.add(name)
                    continue
                if name in stop:
                    stop.update(a.name for a in n.all_input_nodes if a.op != "get_attr")
                stack.extend(a.name for a in n.all_input_nodes)
            mutated = {n.args[0].name for n in (self.node[k] for k in keep - boundary)
                       if _mutates(n) and n.args and hasattr(n.args[0], "op")}
            pull = {b for b in boundary & mutated if self.node[b].op != "placeholder"}
            if not pull:
                return keep, sorted(boundary, key=self.pos.__getitem__)
            for b in pull:
                stop.discard(b)
                stop.update(a.name for a in self.node[b].all_input_nodes if a.op != "get_attr")

    def carve(self, outputs: list[str], stop=()):
        """A standalone GraphModule computing `outputs` from the closure's inputs; node names and
        metadata (module stack, source lines) are the step's."""
        keep, inputs = self.closure(outputs, stop)
        graph = fx.Graph()
        env, out = {}, {}
        # an output that a later node of the subprogram mutates in place (the generator's
        # `xs += resblock(x)`) is returned as it was when computed: a copy taken at once
        mutated = {n.args[0].name for n in self.nodes if n.name in keep and _mutates(n) and n.args
                   and hasattr(n.args[0], "op")}
        for name in inputs:
            n = self.node[name]
            env[n] = graph.placeholder(name)
            env[n].meta = dict(n.meta)
        for n in self.nodes:
            if n.name in keep and n not in env:
                env[n] = graph.node_copy(n, lambda a: env[a])
                if n.name in mutated and n.name in outputs:
                    out[n.name] = graph.create_node("call_function", torch.ops.aten.clone.default, (env[n],),
                                                    name=f"{n.name}__at_its_time")
                    out[n.name].meta = dict(n.meta)
        graph.output(tuple(out.get(o, env[self.node[o]]) for o in outputs))
        return fx.GraphModule(self.gm, graph), inputs

    def values32(self, names: list[str]) -> list:
        """fp32 reference values of step nodes (the FX interpreter on the item's inputs)."""
        return self.values(names, "float32")

    def values(self, names: list[str], dtype: str = "float32") -> list:
        """Reference values of step nodes computed from the step's own inputs in `dtype` (float32:
        what eager computes; float64: the reference), each node evaluated once per dtype."""
        cache = self._values.setdefault(dtype, {})
        missing = [n for n in dict.fromkeys(names) if n not in cache and n not in self.inputs]
        if missing:  # from the values already known (the same ops on the same inputs: the same values)
            with progress.phase(f"bisecting (references of {len(missing)} nodes in {dtype})"):
                gm, inputs = self.carve(missing, list(cache))
                if any(i not in cache and i not in self.inputs for i in inputs):  # a value mutated in place
                    gm, inputs = self.carve(missing)  # was pulled inside: from the step's inputs then
                args = [cache[i] if i in cache else self.inputs[i] for i in inputs]
                for name, v in zip(missing, evaluate(gm, args, dtype)):
                    cache[name] = v
        own = lambda n: self.inputs[n].double() if dtype == "float64" and self.inputs[n].is_floating_point() \
            else self.inputs[n]  # noqa: E731
        return [own(n) if n in self.inputs else cache[n] for n in names]

    def persisting(self, taps: list[str], failing: set[str], ends: set[str]) -> list[str]:
        """The failing taps whose error reaches a failing `end` through failing taps, in graph order.

        A tap's error persists when a tap it feeds (the nearest ones downstream, through untapped
        nodes) fails and persists too, or when it is an end itself. So a value that leaves the
        rule but is absorbed on the way (SineGen's phase on XNNPACK: 4x its floor, the audio at
        0.95x) is not read as the divergence, and a branch that the error never enters (the
        noise path beside a faulty resblock) does not break the chain either."""
        tapped, last = set(taps), max((self.pos[t] for t in taps), default=-1)
        reached: dict[str, bool] = {}
        for name in sorted(taps, key=self.pos.__getitem__, reverse=True):
            if name not in failing:
                reached[name] = False
                continue
            ok, stack, seen = name in ends, [u for u in self.node[name].users], set()
            while stack and not ok:
                u = stack.pop()
                if u.name in seen or self.pos.get(u.name, last + 1) > last:
                    continue
                seen.add(u.name)
                if u.name in tapped:
                    ok = reached.get(u.name, False)
                else:
                    stack.extend(u.users)
            reached[name] = ok
        return [t for t in sorted(taps, key=self.pos.__getitem__) if reached[t]]

    def jumps(self, taps: list[str], metrics: dict[str, dict]) -> dict[str, float]:
        """How much each tap's error (its ratio to its fp32 floor) grows over the largest of its
        nearest tapped (or input) ancestors': a NaN made from finite inputs jumps infinitely, a value
        that carries its inputs' error along jumps ~1."""
        def ratio(name: str) -> float:
            m = metrics.get(name)
            if m is None:
                return 1.0  # an input of the step, or an untapped value: exact
            if m.get("nan_rate") or m.get("new_nonfinite") or m.get("inf_rate"):
                return math.inf
            r = m.get("floor_ratio", 1.0)
            return math.inf if r is None or math.isnan(r) else max(r, 1.0)

        tapped, out = set(taps), {}
        for name in taps:
            up, stack, seen = [], list(self.node[name].all_input_nodes), set()
            while stack:
                a = stack.pop()
                if a.name in seen or a.op == "get_attr":
                    continue
                seen.add(a.name)
                if a.name in tapped or a.op == "placeholder":
                    up.append(ratio(a.name))
                else:
                    stack.extend(a.all_input_nodes)
            before, now = max(up, default=1.0), ratio(name)
            out[name] = 1.0 if math.isinf(before) else now / before
        return out

    def nbytes(self, name: str) -> int:
        """The size of a node's value from its traced metadata (a symbolic size by its hint)."""
        val = self.node[name].meta.get("val")
        if not hasattr(val, "shape"):
            return 0
        count = 1
        for d in val.shape:
            count *= int(d) if isinstance(d, int) else int(d.node.hint or 1)
        return count * val.element_size()


def _as_float64(gm):
    gm = copy.deepcopy(gm)
    promote = lambda a: torch.float64 if a is torch.float32 else a  # noqa: E731
    for node in gm.graph.nodes:
        if node.op == "call_function":  # zeros(..., dtype=float32), to(float32): traced at fp32
            node.args = torch.fx.node.map_aggregate(node.args, promote)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, promote)
        if node.op != "get_attr":
            continue
        owner_path, _, attr = node.target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        value = getattr(owner, attr)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            if isinstance(value, torch.nn.Parameter):
                setattr(owner, attr, torch.nn.Parameter(value.detach().double(), requires_grad=False))
            else:
                setattr(owner, attr, value.double())
    gm.recompile()
    return gm


def evaluate(gm, inputs: list, dtype: str) -> list:
    """Run a carved GraphModule with torch.fx.Interpreter; float64 casts parameters, constants and
    float inputs, and turns the float32 that tracing baked into ops (LSTM states, casts) into float64."""
    if dtype == "float64":
        gm = _as_float64(gm)
    args = [(t.double() if dtype == "float64" and t.is_floating_point() else t).clone() for t in inputs]
    with torch.no_grad():
        out = fx.Interpreter(gm).run(*args)
    return [o.detach() for o in out]


def restore_names(program, carved) -> bool:
    """Give the exported subprogram's nodes the step's names (export numbers them afresh), so a
    node is called the same in the step, in every probe, in the repro and in a backend's log.
    The map is export's own provenance (node.meta["from_node"]); getitems of a multi-output op
    map by index, and those export adds for unused outputs get a name no step node has.
    Returns whether every carved node found its name."""
    src = {n.name: n for n in carved.graph.nodes if n.op == "call_function"}
    getitems = {(n.args[0].name, n.args[1]): n.name for n in src.values()
                if n.target is operator.getitem and hasattr(n.args[0], "name")}
    dst = [n for n in program.graph.nodes if n.op == "call_function"]
    want = {}
    for n in dst:
        origin = [f.name for f in (n.meta.get("from_node") or [])]
        if not origin:
            continue
        if n.target is operator.getitem:
            parent = want.get(n.args[0].name)
            if parent is not None:
                want[n.name] = getitems.get((parent, n.args[1]), f"{parent}__out{n.args[1]}")
        elif origin[0] in src and src[origin[0]].target == n.target:
            want[n.name] = origin[0]
    if len(set(want.values())) != len(want):
        return False
    renamed = {}
    for i, n in enumerate(dst):  # through temporary names, so no rename collides
        renamed[f"__bisect_{i}"] = n.name
        n._rename(f"__bisect_{i}")
    namespace = program.graph._graph_namespace  # fx renumbers suffix-less names: set them directly
    new = {}
    for n in dst:
        old = renamed[n.name]
        name = want.get(old)
        if name is None:
            n._rename(old if old not in src else f"{old}__export")
        else:
            n.name = name
            namespace._used_names.add(name)
            namespace._obj_to_name[n] = name
        new[old] = n.name
    for spec in program.graph_signature.output_specs:
        if spec.arg is not None and getattr(spec.arg, "name", None) in new:
            spec.arg.name = new[spec.arg.name]
    program.graph_module.recompile()
    return set(src) <= {n.name for n in dst}



def module_boundaries(graph: StepGraph, roots: set[str], depth: int, skip_types: tuple[str, ...] = ()) -> list[dict]:
    """The modules `depth` levels below `roots` (by nn_module_stack), each with its member nodes'
    float outputs, its inputs from outside (`stop`), and its last position, in completion order."""
    members: dict[str, set] = {}
    types: dict[str, str] = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        stack = module_stack(n)
        for i, (path, _) in enumerate(stack):
            if path in roots:
                for sub, typ in stack[i + 1:i + 1 + depth]:
                    members.setdefault(sub, set()).add(n.name)
                    types[sub] = str(typ)
                break
    out = []
    node, pos = graph.node, graph.pos
    for path, names in members.items():
        if types[path].startswith(skip_types):
            continue
        outs = [x for x in sorted(names, key=pos.__getitem__) if is_float(node[x])
                and (x in graph.outputs or any(u.name not in names for u in node[x].users))]
        if not outs:
            continue
        stop = sorted({a.name for x in names for a in node[x].all_input_nodes
                       if a.name not in names and a.op != "get_attr"}, key=pos.__getitem__)
        out.append({"path": path, "type": types[path], "outputs": outs, "stop": stop,
                    "end": max(pos[x] for x in names), "last": max(outs, key=pos.__getitem__)})
    return sorted(out, key=lambda m: m["end"])
