"""Bisection: from a failing item to the first diverging module and op, and a standalone repro.

Everything happens on the step's exported graph, in one name space. A *probe* carves a
subprogram out of it (the ancestors of some nodes, stopping at chosen nodes that become inputs
fed with their fp32 reference values), exports it, compiles and runs it on the backend through
the same child-process jobs and cache as an item, and compares every output with the FX
interpreter's fp32 and fp64 values of the same subprogram on the same inputs: torch's
noise-floor rule (harness.verdict.comparator), applied per node.

- Module level: each module below the step's module (children and grandchildren by
  nn_module_stack) carved at its boundary, fed its captured inputs, in completion order.
- Op level: binary search over the float nodes of the first failing module (or of the step) in
  topological order. The probe cut after node k outputs k and every value still live after it,
  so an error made anywhere before the cut is seen at it: the first failing cut is the node.
- Local or accumulated: node k alone on exact inputs. If that passes, the error is accumulated,
  and the shortest window ending at k that still fails (binary search on its start) is the repro.
A probe that crashes or does not compile counts as failing: it is a finding, not an error here.
"""
from __future__ import annotations

import inspect
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from .files import atomic_write_json, atomic_write_text, content_key

BISECT_VERSION = 4  # bump when carving or exporting probes changes: it invalidates cached probes
BISECTABLE = ("fail", "run_error", "crashed", "compile_error")
SKIP_MODULE_TYPES = ("torch.nn.modules.activation.", "torch.nn.modules.dropout.",
                     "torch.nn.modules.linear.Identity")
KEY_METRICS = ("rel_l2", "floor_rel_l2", "floor_ratio", "max_abs", "cosine", "nan_rate", "new_nonfinite")


class BisectError(RuntimeError):
    """Bisection itself could not proceed (not a finding about the backend)."""


def _is_tensor(node) -> bool:
    import torch

    return isinstance(node.meta.get("val"), torch.Tensor)


def _is_float(node) -> bool:
    return _is_tensor(node) and node.meta["val"].is_floating_point()


def _mutates(node) -> bool:
    import torch

    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


def source_line(node) -> str:
    """The last frame of the node's stack trace inside kokoro or the harness's patched forwards,
    else the last one outside torch, as `kokoro/istftnet.py:31 in forward: <code>`."""
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
    inside = [f for f in frames if "/kokoro/" in f[0] or "/harness/patches/" in f[0]]
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
    return _strip(stack[-1][0]) if stack else ""


def _short(m: dict) -> dict:
    return {k: m[k] for k in KEY_METRICS if k in m}


class StepGraph:
    """The step's program as an unlifted FX graph: carve subprograms, evaluate references."""

    def __init__(self, program_path: Path, inputs: list):
        import torch
        from torch.utils import _pytree as pytree

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
        self._values32: dict[str, Any] = {}

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
                if n.op == "placeholder" or (name in stop and name not in outputs and _is_tensor(n)):
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
        import torch.fx as fx

        keep, inputs = self.closure(outputs, stop)
        graph = fx.Graph()
        env = {}
        for name in inputs:
            n = self.node[name]
            env[n] = graph.placeholder(name)
            env[n].meta = dict(n.meta)
        for n in self.nodes:
            if n.name in keep and n not in env:
                env[n] = graph.node_copy(n, lambda a: env[a])
        graph.output(tuple(env[self.node[o]] for o in outputs))
        return fx.GraphModule(self.gm, graph), inputs

    def values32(self, names: list[str]) -> list:
        """fp32 reference values of step nodes (the FX interpreter on the item's inputs)."""
        missing = [n for n in names if n not in self._values32 and n not in self.inputs]
        if missing:
            gm, inputs = self.carve(missing)
            for name, v in zip(missing, evaluate(gm, [self.inputs[i] for i in inputs], "float32")):
                self._values32[name] = v
        return [self.inputs[n] if n in self.inputs else self._values32[n] for n in names]


def _as_float64(gm):
    import copy

    import torch

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
    import torch
    import torch.fx as fx

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
    import operator

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


def step_program(session, item, backend, inputs: dict) -> tuple[Path, str]:
    """The item's exported program (the runner's cache entry; exported here on a miss)."""
    import torch

    from .patches import canonical
    from .programs import PROGRAM_VERSION
    from .runner import _save_inputs

    patches = list(canonical((*backend.patches, *getattr(session, "extra_patches", ()))))
    shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()]
    key = content_key("program", PROGRAM_VERSION, item.step, shapes, patches, session.model.digest,
                      torch.__version__)
    program_dir, result = session._cached_job(
        "programs", key, "exports", "harness.programs:export_step", session.limits.export_s,
        lambda tmp: dict(weights=session.weights, expected_digest=session.model.digest, step=item.step,
                         patches=patches, inputs_path=str(_save_inputs(tmp, inputs)),
                         out_path=str(tmp / "program.pt2")))
    if result is not None and not result.ok:
        raise BisectError(f"the step does not export: {result.error}")
    return program_dir, key


class Bisector:
    """One item's localization: module table, op bisection, local/accumulated, repro bundle.

    Works on a program file and its inputs, so tests can bisect a program they exported
    themselves; `for_item` builds one from a runner Session and an Item."""

    def __init__(self, program_path: Path, program_key: str, inputs: list, backend: str, tol, step: str,
                 report_dir: Path, item_id: str, limits=None, depth: int = 2,
                 log: Callable[[str], None] | None = None):
        from .backends import get_backend
        from .runner import Limits
        from .steps import get_step
        from .verdict import comparator

        self.program_key, self.item_id, self.depth = program_key, item_id, depth
        self.log = log or (lambda msg: None)
        self.backend = get_backend(backend)
        self.step = get_step(step)
        self.tol = tol
        self.check = comparator(tol)
        self.limits = limits or Limits()
        self.report_dir = Path(report_dir)
        self.graph = StepGraph(Path(program_path), list(inputs))
        self.counts: Counter = Counter()
        self.probes: list[dict] = []
        self.run_root = self.report_dir / "runs" / item_id / "bisect"

    @classmethod
    def for_item(cls, session, item, depth: int = 2, log=None) -> "Bisector":
        from .backends import get_backend

        backend = get_backend(item.backend)
        inputs = session.traces(item.case).inputs(item.step, item.mode, "float32")
        program_dir, key = step_program(session, item, backend, inputs)
        return cls(program_dir / "program.pt2", key, list(inputs.values()), item.backend,
                   session.profile.for_(item.step, item.backend, item.mode), item.step, session.report_dir,
                   item.id, session.limits, depth, log)

    def _compile_and_run(self, probe_key: str, program_path: Path, inputs_path: Path, run_dir: Path):
        """Compile (through the artifact cache) and run, in child processes; on a cache miss both
        happen in one child, which halves the interpreter start-ups of a bisection. Returns
        (stage that failed or None, JobResult, compiled now?)."""
        from . import cache
        from .jobs import run_job

        key = content_key("artifact", probe_key, self.backend.name, self.backend.version())
        entry = cache.entry("artifacts", key)
        outputs_path = run_dir / "outputs.pt"
        run_dir.mkdir(parents=True, exist_ok=True)
        outputs_path.unlink(missing_ok=True)
        run_kwargs = dict(backend=self.backend.name, inputs_path=str(inputs_path), outputs_path=str(outputs_path))
        if cache.lookup("artifacts", key):
            result = run_job("harness.backends:run_job",
                             dict(run_kwargs, artifact_path=str(entry / self.backend.artifact_name)),
                             run_dir, self.limits.run_s)
            return (None if result.ok else "run"), result, False
        outcome = {}

        def build(tmp: Path) -> None:
            outcome["result"] = run_job("harness.bisect:compile_run_job",
                                        dict(run_kwargs, program_path=str(program_path), out_dir=str(tmp)),
                                        tmp, self.limits.compile_s + self.limits.run_s)
            if not (tmp / "compiled.json").exists():
                raise _JobFailed()  # nothing to cache

        try:
            cache.get_or_build("artifacts", key, build)
        except _JobFailed:
            return "compile", outcome["result"], True
        result = outcome["result"]
        return (None if result.ok else "run"), result, True

    # -- one probe ------------------------------------------------------------------------
    def probe(self, phase: str, label: str, outputs: list[str], stop=()) -> dict:
        """Compile and run the subprogram computing `outputs` (inputs: `stop`) on the backend,
        and judge each output against its own fp32/fp64 references."""
        import torch

        from . import cache
        from .metrics.tensor import compare_to_floor

        start = time.monotonic()
        gm, in_names = self.graph.carve(outputs, stop)
        inputs = self.graph.values32(in_names)
        key = content_key("bisect-probe", BISECT_VERSION, self.program_key, outputs, in_names)

        def build(tmp: Path) -> None:
            with torch.no_grad():
                program = torch.export.export(gm, tuple(inputs), strict=False)
            if not restore_names(program, gm):
                raise BisectError("export renamed nodes beyond recovery")
            torch.export.save(program, str(tmp / "program.pt2"))
            torch.save([t.contiguous() for t in inputs], tmp / "inputs.pt")
            atomic_write_json(tmp / "probe.json", {"outputs": outputs, "inputs": in_names})

        t0 = time.monotonic()
        try:
            entry, _ = cache.get_or_build("bisect", key, build)
        except Exception as e:  # noqa: BLE001 - the harness's own limit, reported as such
            raise BisectError(f"cannot export the subprogram for {label}: {type(e).__name__}: {e}") from e
        n_ops = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        rec = {"phase": phase, "label": label, "outputs": outputs, "n_inputs": len(in_names), "n_ops": n_ops,
               "key": key, "metrics": {}, "failing": []}
        timing = {"export_s": round(time.monotonic() - t0, 2)}
        run_dir = self.run_root / key[:16]
        failed, result, compiled = self._compile_and_run(key, entry / "program.pt2", entry / "inputs.pt", run_dir)
        timing["compile_run_s"] = round(result.seconds, 2)
        rec["timing"] = timing
        rec["compile"] = "miss" if compiled else "hit"
        self.counts["compiles" if compiled else "compile_hits"] += 1
        self.counts[f"{phase}_compiles"] += compiled
        self.counts["runs"] += failed != "compile"
        if failed:
            status = {"crashed": "crashed", "timeout": "timeout"}.get(result.status, f"{failed}_error")
            return self._done(rec, start, status, f"{failed}: {result.error}", log=result.log_tail)
        got = torch.load(run_dir / "outputs.pt", weights_only=True)
        (run_dir / "outputs.pt").unlink()
        if len(got) != len(outputs):
            return self._done(rec, start, "run_error", f"run: {len(got)} outputs, expected {len(outputs)}")
        ref32, ref64 = evaluate(gm, inputs, "float32"), evaluate(gm, inputs, "float64")
        whys = []
        for name, out, r32, r64 in zip(outputs, got, ref32, ref64):
            if tuple(out.shape) != tuple(r64.shape):
                rec["failing"].append(name)
                whys.append(f"{name}: shape {tuple(out.shape)} != {tuple(r64.shape)}")
                continue
            m = compare_to_floor(out, r32, r64)
            rec["metrics"][name] = _short(m)
            ok, why = self.check(m)
            if not ok:
                rec["failing"].append(name)
                whys.append(f"{name}: {why}")
        return self._done(rec, start, "fail" if rec["failing"] else "pass", "; ".join(whys))

    def _done(self, rec: dict, start: float, status: str, why: str, log: str = "") -> dict:
        rec.update(status=status, why=why, seconds=round(time.monotonic() - start, 2))
        if log:
            rec["log"] = "\n".join(log.splitlines()[-8:])
        self.probes.append(rec)
        self.log(f"  {rec['phase']:7s} {rec['label']:40s} {rec['n_ops']:5d} ops  {status:13s} "
                 f"compile {rec['compile']}  {why[:90]}")
        return rec

    # -- module level ---------------------------------------------------------------------
    def modules(self) -> list[dict]:
        """Modules `depth` levels below the step's module(s), with their boundary, in completion order."""
        roots = {"kmodel." + p for p in self.step.module_path.split("+")}
        members: dict[str, set] = {}
        types: dict[str, str] = {}
        for n in self.graph.nodes:
            if n.op != "call_function":
                continue
            stack = module_stack(n)
            for i, (path, _) in enumerate(stack):
                if path in roots:
                    for sub, typ in stack[i + 1:i + 1 + self.depth]:
                        members.setdefault(sub, set()).add(n.name)
                        types[sub] = str(typ)
                    break
        out = []
        node, pos = self.graph.node, self.graph.pos
        for path, names in members.items():
            if types[path].startswith(SKIP_MODULE_TYPES):
                continue
            outs = [x for x in sorted(names, key=pos.__getitem__) if _is_float(node[x])
                    and (x in self.graph.outputs or any(u.name not in names for u in node[x].users))]
            if not outs:
                continue
            stop = sorted({a.name for x in names for a in node[x].all_input_nodes
                           if a.name not in names and a.op != "get_attr"}, key=pos.__getitem__)
            out.append({"path": path, "type": types[path], "outputs": outs, "stop": stop,
                        "end": max(pos[x] for x in names)})
        return sorted(out, key=lambda m: m["end"])

    def module_level(self) -> list[dict]:
        rows = []
        for mod in self.modules():
            p = self.probe("module", mod["path"], mod["outputs"], mod["stop"])
            worst = max(p["metrics"].values(), key=lambda m: _num(m.get("floor_ratio")), default={})
            rows.append({"module": _strip(mod["path"]), "type": mod["type"].rsplit(".", 1)[-1], "status": p["status"],
                         "n_ops": p["n_ops"], "why": p["why"], **_short(worst),
                         "_outputs": mod["outputs"], "_stop": mod["stop"]})
        return rows

    # -- op level -------------------------------------------------------------------------
    def op_level(self, outputs: list[str], stop: list[str]) -> dict | None:
        graph = self.graph
        keep, inputs = graph.closure(outputs, stop)
        region = keep - set(inputs)
        cands = [n for n in graph.nodes if n.name in region and n.op == "call_function" and _is_float(n)]
        if not cands:
            return None
        last_use = {}
        for c in cands:
            uses = [graph.pos[u.name] for u in c.users if u.name in keep]
            outside = c.name in outputs or any(u.name not in keep for u in c.users)
            last_use[c.name] = math.inf if outside else max(uses, default=-1)

        def live(i: int) -> list[str]:
            cut = graph.pos[cands[i].name]
            return [c.name for c in cands[:i + 1] if c is cands[i] or last_use[c.name] > cut]

        probes: dict[int, dict] = {}

        def fails(i: int) -> bool:
            probes[i] = self.probe("bisect", cands[i].name, live(i), stop)
            return probes[i]["status"] != "pass"

        n = len(cands)
        if not fails(n - 1):
            return {"n_nodes": n, "localized": False}
        lo, hi = -1, n - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fails(mid):
                hi = mid
            else:
                lo = mid
        k = cands[hi]
        after = probes[hi]
        before = {}
        for a in k.all_input_nodes:
            if a.name in inputs or graph.node[a.name].op == "placeholder":
                before[a.name] = "exact (reference input)"
            elif lo >= 0 and a.name in probes[lo]["metrics"]:
                before[a.name] = probes[lo]["metrics"][a.name]
        local = self.probe("local", k.name, [k.name], [a.name for a in k.all_input_nodes if a.op != "get_attr"])
        window = local
        if local["status"] == "pass":
            # accumulated: the latest window start that still fails, window(hi) being `local`
            ancestors, _ = graph.closure([k.name], stop)

            def window_probe(s: int) -> dict:
                start = graph.pos[cands[s].name]
                early = [a for a in ancestors if graph.pos[a] < start]
                return self.probe("window", f"{cands[s].name}..{k.name}", [k.name], [*stop, *early])

            s_lo, s_hi = 0, hi
            found = None
            while s_hi - s_lo > 1:
                mid = (s_lo + s_hi) // 2
                p = window_probe(mid)
                if p["status"] != "pass":
                    s_lo, found = mid, p
                else:
                    s_hi = mid
            window = found or window_probe(s_lo)
        return {"n_nodes": n, "localized": True, "node": k, "after": after, "before": before,
                "kind": "local" if local["status"] != "pass" else "accumulated", "local": local,
                "window": window, "previous": cands[lo].name if lo >= 0 else None}

    # -- the whole localization -----------------------------------------------------------
    def run(self, repro: bool = True, verify: bool = True) -> dict:
        start = time.monotonic()
        out: dict[str, Any] = {"version": BISECT_VERSION, "backend": self.backend.name, "depth": self.depth}
        rows = self.module_level() if self.depth > 0 else []
        first = next((r for r in rows if r["status"] != "pass"), None)
        out["modules"] = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
        out["module_compiles"] = self.counts["module_compiles"]
        out["first_module"] = first["module"] if first else None
        if first:
            outputs, stop = first["_outputs"], first["_stop"]
            out["region"] = f"module {first['module']}"
        else:
            outputs, stop = self.graph.outputs, []
            out["region"] = f"step {self.step.name}"
        self.log(f"op-level bisection in {out['region']}")
        op = self.op_level(outputs, stop)
        out["n_nodes"] = op["n_nodes"] if op else 0
        out["n_graph_ops"] = sum(1 for n in self.graph.nodes if n.op == "call_function")
        out["bisect_compiles"] = sum(1 for p in self.probes if p["phase"] == "bisect")
        if not op or not op["localized"]:
            out["status"] = "not_localized"
            out["message"] = (f"every probe of {out['region']} passes on {self.backend.name}: the failure is not in "
                              f"a node's value (a shape, the valid region, or a crash of the whole program?)")
        else:
            k = op["node"]
            out["status"] = "localized"
            out["first_op"] = {
                "node": k.name, "op": str(k.target), "module": module_path(k), "source": source_line(k),
                "kind": op["kind"], "status": op["after"]["status"],
                "why": next((w for w in op["after"]["why"].split("; ") if w.startswith(k.name + ":")),
                            op["after"]["why"]),
                "after": op["after"]["metrics"].get(k.name, {}), "before": op["before"],
                "previous_node": op["previous"], "local": {"status": op["local"]["status"],
                                                            **_short(op["local"]["metrics"].get(k.name, {}))}}
            out["window"] = {"label": op["window"]["label"], "n_ops": op["window"]["n_ops"],
                             "status": op["window"]["status"]}
            out["message"] = (f"first diverging op {k.name} ({k.target}, {op['kind']}) in {module_path(k)} "
                              f"at {source_line(k)}")
            if repro:
                out["repro"] = self.write_repro(op, verify=verify)
        out["compiles"] = self.counts["compiles"]
        out["compile_hits"] = self.counts["compile_hits"]
        out["runs"] = self.counts["runs"]
        out["probes"] = [{k: v for k, v in p.items() if k not in ("outputs", "key")} for p in self.probes]
        out["seconds"] = round(time.monotonic() - start, 1)
        return out

    # -- repro bundle ---------------------------------------------------------------------
    def write_repro(self, op: dict, verify: bool = True) -> dict:
        import torch

        from . import cache

        window, k = op["window"], op["node"]
        out_dir = self.report_dir / "repro" / self.item_id
        runner = repro_runner(self.backend)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        out_dir.mkdir(parents=True)
        entry = cache.entry("bisect", window["key"])
        shutil.copyfile(entry / "program.pt2", out_dir / "program.pt2")
        shutil.copyfile(entry / "inputs.pt", out_dir / "inputs.pt")
        gm, in_names = self.graph.carve(window["outputs"], self._window_stop(window))
        inputs = self.graph.values32(in_names)
        # float64 only: repro.py computes PyTorch's float32 (the floor) itself, on its machine
        torch.save({"float64": evaluate(gm, inputs, "float64")}, out_dir / "expected.pt")
        facts = self._facts(op, in_names, inputs)
        atomic_write_text(out_dir / "ENV.md", _env_md(self.backend))
        atomic_write_text(out_dir / "REPORT.md", _report_md(facts))
        atomic_write_text(out_dir / "repro.py", render_repro(self.backend, facts["summary"], k.name,
                                                             self.tol.floor_multiplier, self.tol.rel_l2))
        for p in out_dir.iterdir():
            p.chmod(0o644)
        info = {"path": str(out_dir), "bytes": sum(p.stat().st_size for p in out_dir.iterdir()),
                "files": sorted(p.name for p in out_dir.iterdir()), "n_ops": window["n_ops"],
                "n_inputs": len(in_names), "template": runner is not None}
        if verify and runner is not None:
            info.update(run_repro(out_dir, timeout=self.limits.compile_s))
        return info

    def _window_stop(self, window: dict) -> list[str]:
        """The carve inputs of a probe are its recorded inputs (the cache entry's probe.json)."""
        from . import cache

        return json.loads((cache.entry("bisect", window["key"]) / "probe.json").read_text())["inputs"]

    def _facts(self, op: dict, in_names: list[str], inputs: list) -> dict:
        k, w = op["node"], op["window"]
        m = w["metrics"].get(k.name, {})
        target = str(k.target)
        if w["status"] in ("crashed", "compile_error", "run_error", "timeout"):
            actual = f"{w['status'].replace('_', ' ')}: {w['why']}"
        elif m.get("new_nonfinite") or (m.get("nan_rate") or 0) > 0:
            actual = f"non-finite values (NaN rate {m.get('nan_rate', 0):.2%})"
        else:
            actual = (f"relative L2 error {_fmt(m.get('rel_l2'))} against float64, "
                      f"{_fmt(m.get('floor_ratio'))} x PyTorch float32's own error {_fmt(m.get('floor_rel_l2'))}")
        summary = f"{self.backend.name}: {target} gives wrong results ({actual.split(':')[0] if ':' in actual else actual})"
        return {"summary": summary, "actual": actual, "node": k.name, "op": target, "module": module_path(k),
                "source": source_line(k), "kind": op["kind"], "backend": self.backend.name,
                "version": self.backend.version(), "metrics": w["metrics"], "status": w["status"], "why": w["why"],
                "n_ops": w["n_ops"], "inputs": [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(in_names, inputs)],
                "tol": self.tol, "item": self.item_id, "stack": (k.meta.get("stack_trace") or "").strip()}


class _JobFailed(Exception):
    pass


def _num(v) -> float:
    return v if isinstance(v, (int, float)) and not math.isnan(v) else math.inf if v is not None else 0.0


def _strip(path: str) -> str:
    return path[len("kmodel."):] if path.startswith("kmodel.") else path


def _fmt(v) -> str:
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return "-" if v is None else str(v)


def compile_run_job(backend: str, program_path: str, out_dir: str, inputs_path: str, outputs_path: str) -> dict:
    """Job function: harness.backends' compile_job then run_job in one child; `compiled.json`
    marks that the compile finished (so a crash is known to be the run's)."""
    from .backends import compile_job, run_job

    compiled = compile_job(backend, program_path, out_dir)
    atomic_write_json(Path(out_dir) / "compiled.json", compiled)
    return {"compile": compiled, "run": run_job(backend, str(Path(out_dir) / _artifact_name(backend)),
                                                inputs_path, outputs_path)}


def _artifact_name(backend: str) -> str:
    from .backends import get_backend

    return get_backend(backend).artifact_name


# ---- the standalone repro ----------------------------------------------------------------

REPRO_RUNNERS = {
    "torch": '''def run_backend(program, inputs):
    """PyTorch itself (torch.export program, eager kernels)."""
    with torch.no_grad():
        out = program.module()(*inputs)
    return list(out) if isinstance(out, (tuple, list)) else [out]
''',
    "executorch": '''def run_backend(program, inputs):
    """ExecuTorch: to_edge_transform_and_lower ({partitioner_name}) -> .pte -> the runtime."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
{partitioner_import}
    edge = to_edge_transform_and_lower(program, partitioner={partitioners})
    buffer = edge.to_executorch().buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    return list(method.execute([t.contiguous() for t in inputs]))
''',
    "onnxruntime": '''def run_backend(program, inputs):
    """torch.onnx.export (dynamo exporter, opset 18) -> onnxruntime, CPU execution provider."""
    import tempfile

    import onnxruntime as ort
    from torch.export.graph_signature import InputKind

    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.onnx")
        torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=True).save(path, external_data=False)
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = dict(zip(names, inputs))
    out = session.run(None, {i.name: np.ascontiguousarray(feed[i.name].numpy()) for i in session.get_inputs()})
    return [torch.from_numpy(np.asarray(o)) for o in out]
''',
    "tvm-onnx": '''def run_backend(program, inputs):
    """torch.onnx.export (dynamo, opset 18) -> TVM Relax ONNX frontend -> relax.build(llvm) -> Relax VM."""
    import tempfile

    import onnx
    import tvm
    from torch.export.graph_signature import InputKind
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.onnx")
        torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=True).save(path, external_data=False)
        model = onnx.load(path)
    dtypes = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name for i in model.graph.input}
    mod = from_onnx(model, dtype_dict=dtypes, keep_params_in_input=False)
    with tvm.transform.PassContext(opt_level=3):
        vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    feed = dict(zip(names, inputs))
    out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(feed[i.name].numpy())) for i in model.graph.input])
    out = out if isinstance(out, (list, tuple)) or not hasattr(out, "numpy") else [out]
    return [torch.from_numpy(np.array(o.numpy())) for o in out]
''',
    "tvm": '''def run_backend(program, inputs):
    """torch.export program -> TVM Relax from_exported_program -> relax.build(llvm) -> Relax VM."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    mod = from_exported_program(program, custom_convert_map={"clamp.default": _clamp_int_safe})
    with tvm.transform.PassContext(opt_level=3):
        vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(t.numpy())) for t in inputs])

    def flatten(v):
        return [v] if hasattr(v, "numpy") else [x for item in v for x in flatten(item)]
    return [torch.from_numpy(np.array(o.numpy())) for o in flatten(out)]
''',
    "fp16": '''def run_backend(program, inputs):
    """PyTorch in float16 on the CPU: the whole program (weights, constants, hard-coded dtypes)."""
    half = _to_dtype(program.module(), torch.float16)
    with torch.no_grad():
        out = half(*[t.half() if t.is_floating_point() else t for t in inputs])
    return [o.float() for o in (out if isinstance(out, (tuple, list)) else [out])]
''',
    "coreml": '''def run_backend(program, inputs):
    """coremltools: mlprogram at @PRECISION@ compute precision, predicted with compute units @UNITS@."""
    import platform

    import coremltools as ct

    model = ct.convert(program.run_decompositions({}), convert_to="mlprogram",
                       minimum_deployment_target=ct.target.iOS17, compute_precision=ct.precision.@PRECISION@,
                       compute_units=ct.ComputeUnit.@UNITS@, skip_model_load=platform.system() != "Darwin")
    if platform.system() != "Darwin":
        print(f"converted; Core ML prediction needs macOS (this is {platform.system()}): not run")
        raise SystemExit(2)
    spec = model.get_spec()
    names = [i.name for i in spec.description.input]
    out = model.predict({n: t.numpy() for n, t in zip(names, inputs)})
    return [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]
''',
}
_XNNPACK = dict(partitioner_name="XnnpackPartitioner", partitioners="[XnnpackPartitioner()]",
                partitioner_import="    from executorch.backends.xnnpack.partition.xnnpack_partitioner import "
                                   "XnnpackPartitioner")
_PORTABLE = dict(partitioner_name="no delegate: portable kernels", partitioners="[]", partitioner_import="")


def repro_runner(backend) -> str | None:
    """Source of `run_backend(program, inputs) -> list[Tensor]` for a backend, importing only its
    own package; a backend may supply its own with a `repro_runner()` method. None: no template."""
    custom = getattr(backend, "repro_runner", None)
    if callable(custom):
        return custom()
    if backend.name == "eager":
        return REPRO_RUNNERS["torch"]
    if backend.name == "xnnpack":
        return REPRO_RUNNERS["executorch"].format(**_XNNPACK)
    if backend.name == "portable":
        return REPRO_RUNNERS["executorch"].format(**_PORTABLE)
    if backend.name in ("onnxruntime", "tvm-onnx"):
        return REPRO_RUNNERS[backend.name]
    if backend.name == "tvm":  # the converter fix the backend applies, inlined: the repro imports no harness
        from .backends.tvm import _clamp_int_safe

        return inspect.getsource(_clamp_int_safe) + "\n\n" + REPRO_RUNNERS["tvm"]
    if backend.name == "fp16":
        from .backends.fp16 import _to_dtype

        return inspect.getsource(_to_dtype) + "\n\n" + REPRO_RUNNERS["fp16"]
    if backend.name in ("coreml-fp32", "coreml-fp16"):
        precision, units = ("FLOAT32", "CPU_ONLY") if backend.name == "coreml-fp32" else ("FLOAT16", "ALL")
        return REPRO_RUNNERS["coreml"].replace("@PRECISION@", precision).replace("@UNITS@", units)
    return None


def render_repro(backend, summary: str, node: str, floor_multiplier: float, rel_l2: float) -> str:
    """The text of repro.py for `backend` (a stub that says so when the backend has no template)."""
    runner = repro_runner(backend)
    if runner is None:
        return _NO_TEMPLATE.format(backend=backend.name)
    return _REPRO.format(summary=summary, backend=backend.name, runner=runner, floor_multiplier=floor_multiplier,
                         rel_l2=rel_l2, node=node)


_REPRO = '''#!/usr/bin/env python3
"""Repro: {summary}

Runs the minimal failing subgraph (program.pt2, a torch.export ExportedProgram) on inputs.pt in
PyTorch and on {backend}, compares both with the float64 expected output (expected.pt), and
exits 1 while the backend's error is beyond {floor_multiplier:g} x PyTorch float32's own error and
beyond a relative L2 of {rel_l2:g}, or has NaN/Inf. Needs only torch, numpy and the backend's package.
"""
import math
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
FLOOR_MULTIPLIER = {floor_multiplier!r}
REL_L2_TOLERANCE = {rel_l2!r}
NODE = {node!r}


{runner}

def metrics(candidate, reference):
    c = candidate.detach().double().numpy()
    r = reference.detach().double().numpy()
    out = {{"nan_rate": float(np.isnan(c).mean()) if c.size else 0.0,
           "nonfinite": int((~np.isfinite(c) & np.isfinite(r)).sum())}}
    if out["nonfinite"]:
        return dict(out, rel_l2=math.nan, max_abs=math.nan, cosine=math.nan)
    diff = c - r
    ref_norm = float(np.linalg.norm(r))
    out["rel_l2"] = float(np.linalg.norm(diff)) / ref_norm if ref_norm else float(np.linalg.norm(diff))
    out["max_abs"] = float(np.abs(diff).max()) if diff.size else 0.0
    denom = float(np.linalg.norm(c)) * ref_norm
    out["cosine"] = float((c.ravel() @ r.ravel()) / denom) if denom else 1.0
    return out


def main():
    program = torch.export.load(str(HERE / "program.pt2"))
    inputs = torch.load(HERE / "inputs.pt", weights_only=True)
    expected = torch.load(HERE / "expected.pt", weights_only=True)["float64"]
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ours = list(ours) if isinstance(ours, (tuple, list)) else [ours]
    print(f"torch {{torch.__version__}}; node {{NODE}}; inputs " +
          ", ".join(f"{{tuple(t.shape)}} {{t.dtype}}" for t in inputs))
    try:
        theirs = run_backend(program, [t.clone() for t in inputs])
    except Exception as e:  # a backend that raises reproduces the bug too
        print(f"{backend}: raised {{type(e).__name__}}: {{e}}")
        return 1
    bad = False
    print(f"{{'output':8s}} {{'rel_l2':>10s}} {{'fp32 floor':>10s}} {{'ratio':>8s}} {{'max_abs':>10s}} "
          f"{{'cosine':>10s}} {{'NaN rate':>8s}}")
    for i, (ref, o32, got) in enumerate(zip(expected, ours, theirs)):
        got = torch.as_tensor(got)
        if tuple(got.shape) != tuple(ref.shape):
            print(f"out{{i}}: shape {{tuple(got.shape)}} != expected {{tuple(ref.shape)}}")
            bad = True
            continue
        m, floor = metrics(got, ref), metrics(o32, ref)["rel_l2"]
        ratio = m["rel_l2"] / floor if floor else (1.0 if m["rel_l2"] == 0 else math.inf)
        fails = bool(m["nonfinite"]) or math.isnan(m["rel_l2"]) or (
            m["rel_l2"] > REL_L2_TOLERANCE and m["rel_l2"] > FLOOR_MULTIPLIER * floor)
        bad |= fails
        print(f"out{{i:<5d}} {{m['rel_l2']:10.3e}} {{floor:10.3e}} {{ratio:8.3g}} {{m['max_abs']:10.3e}} "
              f"{{m['cosine']:10.6f}} {{m['nan_rate']:8.2%}}  {{'FAIL' if fails else 'ok'}}")
    print("REPRODUCED: {backend} diverges from PyTorch" if bad else "not reproduced: {backend} matches PyTorch")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
'''

_NO_TEMPLATE = '''#!/usr/bin/env python3
"""No standalone repro template for backend {backend!r} yet: program.pt2, inputs.pt and
expected.pt hold the failing subgraph and its data; compile program.pt2 with the backend's own
tools and compare with expected.pt["float64"]."""
import sys

sys.exit("no repro template for backend {backend!r}")
'''


def run_repro(bundle: Path, timeout: float = 1200) -> dict:
    """Run repro.py alone: a fresh interpreter, its own directory, no PYTHONPATH (so neither this
    harness nor kokoro can be imported from the tree). Exit 1 = the bug reproduces."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    start = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "repro.py"], cwd=bundle, env=env, capture_output=True, text=True,
                           timeout=timeout)
        code, text = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired:
        code, text = None, f"no result after {timeout:.0f} s"
    return {"exit_code": code, "reproduces": code == 1, "repro_s": round(time.monotonic() - start, 1),
            "repro_output": "\n".join(text.strip().splitlines()[-8:])}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _env_md(backend) -> str:
    import importlib.metadata as md

    rows = [("Python", platform.python_version()), ("OS", platform.platform()),
            ("CPU", f"{_cpu()} ({os.cpu_count()} logical cores)")]
    for pkg in ("torch", "numpy", "executorch", "onnxruntime", "onnx", "onnxscript", "apache-tvm", "coremltools"):
        try:
            rows.append((pkg, md.version(pkg)))
        except md.PackageNotFoundError:
            pass
    rows.append((f"backend `{backend.name}`", backend.version()))
    return "# Environment\n\n| what | version |\n| --- | --- |\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def _report_md(f: dict) -> str:
    rows = "".join(f"| {name} | {_fmt(m.get('rel_l2'))} | {_fmt(m.get('floor_rel_l2'))} | {_fmt(m.get('floor_ratio'))} "
                   f"| {_fmt(m.get('max_abs'))} | {_fmt(m.get('cosine'))} | {_fmt(m.get('nan_rate'))} |\n"
                   for name, m in f["metrics"].items())
    inputs = "".join(f"- `{n}`: {list(s)} {d}\n" for n, s, d in f["inputs"])
    kind = ("**local**: the op alone, fed exact (PyTorch float32) inputs, already diverges" if f["kind"] == "local"
            else "**accumulated**: the op alone passes; the error builds up over the "
                 f"{f['n_ops']} ops of this subgraph until it passes the tolerance at this op")
    tol = f["tol"]
    return f"""# {f['summary']}

**Summary.** On `{f['backend']}` ({f['version']}), the subgraph in `program.pt2` ({f['n_ops']} op{'s' if f['n_ops'] != 1 else ''}, ending in
`{f['op']}`) does not match PyTorch: {f['actual']}.

## Expected vs actual
- **Expected:** the float64 result of the same program on the same inputs (`expected.pt`), within
  {tol.floor_multiplier:g} x the error PyTorch float32 itself makes (its noise floor), or within a relative L2 of {tol.rel_l2:g}.
- **Actual:** {f['actual']}.

| output | rel_l2 vs fp64 | PyTorch fp32 rel_l2 (floor) | ratio | max_abs | cosine | NaN rate |
| --- | --- | --- | --- | --- | --- | --- |
{rows}
Verdict detail: {f['why'] or f['status']}

## The op
- graph node `{f['node']}`: `{f['op']}`, {kind}
- module: `{f['module']}` (Kokoro-82M, item `{f['item']}`)
- source: `{f['source']}`

Inputs of the subgraph:
{inputs}
<details><summary>stack trace recorded by torch.export</summary>

```
{f['stack']}
```
</details>

## How to run
```
pip install torch numpy   # plus the backend's package, versions in ENV.md
python repro.py           # exit code 1 while the bug reproduces, 0 once fixed
```
The directory is self-contained: `program.pt2` (torch.export.save), `inputs.pt`, `expected.pt`
(the float64 reference), `repro.py`. Found with kokoro-parity's bisection.
"""


# ---- entry points --------------------------------------------------------------------------

def bisect_item(session, item, record=None, depth: int = 2, repro: bool = True, verify: bool = True,
                log: Callable[[str], None] | None = None) -> dict:
    """Localize one item; the result goes into `record.bisect` (rewritten) when given."""
    import traceback

    from .jobs import first_error_line

    try:
        result = Bisector.for_item(session, item, depth=depth, log=log).run(repro=repro, verify=verify)
    except Exception as e:  # noqa: BLE001 - a bisection that cannot run is reported, not raised
        result = {"status": "error", "message": first_error_line(e), "traceback": traceback.format_exc()[-4000:]}
    if record is not None:
        record.bisect = result
        record.write(Path(session.report_dir) / "records")
    return result


def format_bisect(b: dict) -> str:
    """The bisection's lines under an item's metric table."""
    from tabulate import tabulate

    if b.get("status") == "error":
        return f"bisect: could not run: {b.get('message')}"
    lines = []
    rows = b.get("modules") or []
    if rows:
        lines.append(f"bisect, module level ({len(rows)} modules alone on their captured inputs; "
                     f"{b.get('module_compiles', 0)} compiles):")
        table = [[r["module"], r["type"], r["status"].upper(), r["n_ops"], _fmt(r.get("rel_l2")),
                  _fmt(r.get("floor_rel_l2")), _fmt(r.get("floor_ratio"))] for r in rows]
        lines.append(tabulate(table, headers=["module", "type", "alone", "ops", "rel_l2", "floor", "ratio"],
                              tablefmt="simple"))
        lines.append(f"first failing module: {b.get('first_module') or 'none (every module passes alone)'}")
    if b.get("status") != "localized":
        lines.append(f"bisect: not localized: {b.get('message')}")
    else:
        f = b["first_op"]
        lines.append(f"bisect: first diverging op `{f['node']}` ({f['op']}, {f['kind'].upper()}) "
                     f"in {f['module'] or '?'}")
        lines.append(f"  source: {f['source'] or '?'}")
        before = "; ".join(f"{n}: {v if isinstance(v, str) else 'rel_l2 ' + _fmt(v.get('rel_l2')) + ' (' + _fmt(v.get('floor_ratio')) + 'x floor)'}"
                           for n, v in f["before"].items()) or "-"
        a = f["after"]
        lines.append(f"  before (its inputs): {before}")
        lines.append(f"  after: rel_l2 {_fmt(a.get('rel_l2'))} ({_fmt(a.get('floor_ratio'))}x floor "
                     f"{_fmt(a.get('floor_rel_l2'))}), NaN rate {_fmt(a.get('nan_rate'))}: {f['why']}")
        lines.append(f"  alone on exact inputs: {f['local']['status']} -> {f['kind']}")
    lines.append(f"  op bisection in {b.get('region')}: {b.get('bisect_compiles', 0)} probes for {b.get('n_nodes', 0)} "
                 f"float nodes (log2 = {math.log2(max(b.get('n_nodes', 1), 1)):.1f}); total compiles "
                 f"{b.get('compiles', 0)} (+{b.get('compile_hits', 0)} cached), runs {b.get('runs', 0)}, {b.get('seconds')} s")
    r = b.get("repro")
    if r:
        state = ("reproduces when run alone" if r.get("reproduces") else
                 f"repro.py exit code {r.get('exit_code')}" if "exit_code" in r else "not verified")
        lines.append(f"  repro: {r['path']}/ ({r['bytes'] / 1024:.0f} KiB, {r['n_ops']} ops, {state})")
    return "\n".join(lines)
