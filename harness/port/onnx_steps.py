"""`--bisect` on one step's ONNX (`--artifact STEP=PATH`): the localization of onnx_stages, inside
the step's module instead of the whole model.

- *Stages*: the step's submodules that hold parameters, down to STAGE_DEPTH levels below the step
  (children and grandchildren of its module; a step made of several modules, such as `f0n`, counts
  each as a child), in the order a hooked float32 run of the step finishes them, so a module comes
  before the one that holds it and the first stage named is the innermost. A module called more
  than once (shared weights) is listed as not mapped: one capture cannot stand for every call.
- *Names*: a node's module path comes from the dynamo exporter's metadata
  (`pkg.torch.onnx.name_scopes`, else `namespace`: full paths from the exported module) or from a
  TorchScript-exporter name (`/decoder/generator/conv_post/Conv`: one segment per module call, each
  relative to the call around it). The export's own prefix (`kmodel.` of the harness's step
  wrapper, a user's wrapper module) and the module the names start from (`decoder` when the user
  exported `kmodel.decoder` itself) are found together: the pair under which most nodes resolve to
  real modules of the step.
- *References*: `reference.module_captures` (`path:out` and `path:in`, float32 and float64, one
  teacher-forced run of the step on the exact lengths, cached). Each stage is judged chained (the
  marked run) and locally (its extracted subgraph fed the reference's inputs) against the fp32
  floor with the item's tolerance, and the repro bundle is onnx_stages' (numpy + onnxruntime only;
  a static page too when the item ran in onnxruntime-web, whose browser runs the stages as well).
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import onnx
import torch

from ..backends.prebuilt import NATIVE, kind_of
from ..patches import affecting, apply_patches, provide_noise
from ..record import OnnxStages, Unlocalized
from ..reference import NEUTRAL_PATCHES, REFERENCE_PATCHES, module_captures
from ..steps import get_step
from ..verdict import comparator
from . import tensors
from .onnx_graph import moved_inputs
from .onnx_stages import (depends_on_inputs, float_boundaries, judge_row, localized_on, marked_copy, module_groups,
                          ran_on, run_localize_job, run_onnx, stage_lines, stage_row, stage_runner, write_repro)

STAGE_DEPTH = 2  # module levels below the step's module that become stages
MAX_PREFIX = 3  # leading name segments an export may add (a wrapper module, `kmodel.`)


# ---- the step's modules, from a hooked run ------------------------------------------------------

def step_modules(model, step: str, traces, variant: tuple[str, ...] = ()) -> dict:
    """The modules one float32 run of `step` calls (hooked_modules), under the references'
    patches and `variant`."""
    km = apply_patches(model.kmodel, (*REFERENCE_PATCHES["dynamic"], *variant))
    return hooked_modules(km, lambda: get_step(step).module(km)(*traces.inputs(step, "dynamic", "float32").values()))


def model_modules(model, traces) -> dict:
    """The modules one float32 run of the whole model calls (Kokoro's forward_with_tokens on the
    case, its noise the case's), as hooked_modules gives them: what a chain's stage may hold."""
    km = apply_patches(model.kmodel, REFERENCE_PATCHES["dynamic"])
    chain = traces.chain

    def run():
        with provide_noise({k: chain[k] for k in ("rand_ini", "sine_noise", "source_noise")}):
            km.forward_with_tokens(chain["input_ids"], tensors.reference("ref_s", traces), float(chain["speed"]))
    return hooked_modules(km, run)


def hooked_modules(km, run) -> dict:
    """The modules of `km` that `run()` calls: `order` (as they finish), `calls` per path, `params`
    (paths that hold parameters), `types` (class names) and `tensor_in`/`tensor_out` (the paths
    whose first argument / first output is a tensor: what a module capture can hold)."""
    order, calls, hooks, tensor_in, tensor_out = [], {}, [], set(), set()
    names: dict[int, list[str]] = {}
    for path, sub in km.named_modules(remove_duplicate=False):
        names.setdefault(id(sub), []).append(path)
    for path, sub in km.named_modules():
        if path and len(names[id(sub)]) == 1:  # one instance under several paths (kokoro shares a LeakyReLU):
            # a hook cannot tell which path called it
            def done(m, args, out, path=path):
                calls[path] = calls.get(path, 0) + 1
                if calls[path] == 1:
                    order.append(path)
                    if args and isinstance(args[0], torch.Tensor):
                        tensor_in.add(path)
                    if isinstance(out[0] if isinstance(out, (tuple, list)) else out, torch.Tensor):
                        tensor_out.add(path)
            hooks.append(sub.register_forward_hook(done))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in hooks:
            h.remove()
    modules = dict(km.named_modules())
    return {"order": order, "calls": calls, "paths": sorted(p for ps in names.values() for p in ps if p),
            "params": {p for p in order if any(True for _ in modules[p].parameters())},
            "types": {p: type(modules[p]).__name__ for p in order}, "tensor_in": tensor_in, "tensor_out": tensor_out}


def reached(ran: dict, placed) -> dict:
    """`ran` cut to the modules an artifact's nodes are placed in (`placed`: module paths) and
    the modules around them: the stages of a chain's ONNX that holds part of the model."""
    inside = set(placed) - {""}
    inside |= {a for p in inside for a in _ancestors(p)}
    order = [p for p in ran["order"] if p in inside]
    return {**ran, "order": order, "params": ran["params"] & set(order)}


def _ancestors(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def step_roots(order: list[str]) -> list[str]:
    """The modules the step calls directly: no module around them ran."""
    ran = set(order)
    return [p for p in order if not any(a in ran for a in _ancestors(p))]


def choose_stages(ran: dict, depth: int = STAGE_DEPTH) -> tuple[list[str], dict[str, str]]:
    """(stages in finishing order, {module: why not} for the others of those levels): modules with
    parameters at levels 1..depth below the step (a step of one module is level 0)."""
    order, calls = ran["order"], ran["calls"]
    seen = set(order)
    single = len(step_roots(order)) == 1
    stages, skipped = [], {}
    for p in order:
        level = sum(a in seen for a in _ancestors(p)) + (0 if single else 1)
        if not 1 <= level <= depth or p not in ran["params"]:
            continue
        if calls[p] > 1:
            skipped[p] = (f"called {calls[p]} times in the step (shared weights): one capture cannot stand for "
                          f"every call")
        elif p not in ran["tensor_out"]:
            skipped[p] = "its output is not a tensor (a packed sequence): nothing to compare"
        else:
            stages.append(p)
    return stages, skipped


# ---- ONNX node -> module path --------------------------------------------------------------------

def node_segments(node) -> tuple[tuple[str, ...] | None, str]:
    """(scope segments outermost first, where they came from) of one ONNX node."""
    meta = {p.key: p.value for p in node.metadata_props}
    scopes, key = None, "pkg.torch.onnx.name_scopes"
    if key in meta:  # dynamo: ['', 'kmodel.decoder', 'kmodel.decoder.encode', 'conv1d']
        try:
            scopes = [str(s) for s in ast.literal_eval(meta[key])]
        except (ValueError, SyntaxError):
            scopes = None
    if scopes is None and "namespace" in meta:  # ': Root/kmodel.decoder: Decoder/.../conv1d: aten.conv1d'
        scopes, key = [part.split(":")[0].strip() for part in meta["namespace"].split("/")], "namespace"
    if scopes is not None:
        modules = [s for s in scopes[1:-1] if s]  # the last is the op itself
        return (tuple(modules[-1].split(".")) if modules else ()), f"exporter metadata ({key})"
    if node.name.startswith("/"):  # TorchScript: one segment per module call, the op last
        return tuple(s for s in node.name.split("/") if s)[:-1], "node names"
    return None, "none"  # no scope at all (not the same as the exported module's own ops: ())


_CALL_SUFFIX = re.compile(r"(@\d+|_\d+)$")  # a later call of the same module (`@1` dynamo, `_1` TorchScript)


def resolve(segments, base: str, paths: set[str]) -> str | None:
    """The module path the segments name, starting at `base`: each segment is looked up under the
    path so far and under each of its ancestors (TorchScript writes `cnn.0/cnn.0.0`), and must
    land inside it; None when one does not resolve. Two exceptions past the first segment: a shared
    instance named by its first registration is that module's own alias (kokoro's one LeakyReLU
    is `cnn.0.2` in every block, so `cnn.1/cnn.0.2` is `cnn.1.2`), and a scope that names no module
    at all, last or before one that resolves, is the export's own (kokoro-onnx's `istft/stft`, an
    optimizer's `adain2.2/Slice_1/GatherSliceToSplitFusion/`)."""
    cur = base
    for i, seg in enumerate(segments):
        found = _lookup(seg, cur, paths)
        if found is None and i:  # past the first segment: the export's own prefix is found elsewhere
            found = _alias(seg, cur, paths)
            if found is None and not _names_a_module(seg, paths) \
                    and (i + 1 == len(segments) or _lookup(segments[i + 1], cur, paths)):
                continue
        if found is None:
            return None
        cur = found
    return cur or None


def _lookup(seg: str, cur: str, paths: set[str], inside: bool = True) -> str | None:
    for s in dict.fromkeys((seg, _CALL_SUFFIX.sub("", seg))):
        parts = cur.split(".") if cur else []
        for k in range(len(parts), -1, -1):
            cand = ".".join([*parts[:k], s])
            if cand in paths and (not inside or not cur or cand == cur or cand.startswith(cur + ".")):
                return cand
    return None


def _alias(seg: str, cur: str, paths: set[str]) -> str | None:
    """`cur`'s own name for a module registered first elsewhere (the segment names that one)."""
    first = _lookup(seg, cur, paths, inside=False)
    alias = f"{cur}.{first.rsplit('.', 1)[-1]}" if first else None
    return alias if alias in paths else None


def _names_a_module(seg: str, paths: set[str]) -> bool:
    names = {seg, _CALL_SUFFIX.sub("", seg)}
    return any(p in names or p.rsplit(".", 1)[-1] in names or any(p.endswith("." + n) for n in names) for p in paths)


def step_node_paths(model, paths, roots: list[str]):
    """(node -> module path under the step's roots, "" outside them; how the names were read): the
    export's prefix (leading segments dropped) and the module its names start from are the pair
    under which most nodes land inside the step's modules."""
    paths = set(paths)
    segs = [node_segments(n) for n in model.graph.node]
    unique = {s for s, _ in segs if s}
    inside = lambda p: p is not None and any(p == r or p.startswith(r + ".") for r in roots)  # noqa: E731
    bases = sorted({"", *roots, *(a for r in roots for a in _ancestors(r))}, key=len)
    best = (0, 0, "", {})
    for skip in range(MAX_PREFIX + 1):
        for base in bases:
            table = {s: resolve(s[skip:], base, paths) for s in unique if len(s) > skip}
            table = {s: p for s, p in table.items() if inside(p)}
            hits = sum(1 for s, _ in segs if s in table)
            if hits > best[0]:
                best = (hits, skip, base, table)
    hits, skip, base, table = best
    # a name that does not resolve from that base may from another module the file's names already
    # reach: an export that writes the predictor's blocks as `/encoder/F0.1/...` beside
    # `/encoder/predictor/...`
    placed = set(table.values())
    others = [b for b in bases if b and b != base and any(p == b or p.startswith(b + ".") for p in placed)]
    for s in unique - set(table):
        if len(s) > skip:
            p = next((p for b in others for p in [resolve(s[skip:], b, paths)] if inside(p)), None)
            if p is not None:
                table[s] = p
                hits += sum(1 for t, _ in segs if t == s)
    source = next((how for s, how in segs if s), "no module scopes")
    dropped = {".".join(s[:skip]) for s in table} if skip else set()
    how = (f"{source}" + (f", export prefix {' / '.join(repr(d) for d in sorted(dropped))} dropped" if dropped else "")
           + (f", names start at {base!r}" if base else "") + f"; {hits} of {len(segs)} nodes placed")
    where = _place_unnamed(model, [None if s is None else table.get(s, "") for s, _ in segs])
    by_output = {n.output[0]: p for n, p in zip(model.graph.node, where) if n.output}
    return (lambda node: by_output.get(node.output[0] if node.output else None, "")), how


def _place_unnamed(model, where: list) -> list[str]:
    """Nodes without any scope (an optimizer's rewrites, TorchScript's `Constant_12`) go into the
    innermost module holding all their inputs' producers and all their consumers, so that a
    module's trailing op rewritten without a scope is not taken for the next module's (nor its
    input for the module's). Nodes left outside every module (the step's own ops) are ""."""
    graph = model.graph
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(graph.node):
        for x in n.input:
            consumers.setdefault(x, []).append(i)

    def common(paths) -> str:
        parts = [p.split(".") for p in paths]
        k = 0
        while all(len(q) > k and q[k] == parts[0][k] for q in parts):
            k += 1
        return ".".join(parts[0][:k])

    where = list(where)
    for strict in (True, False):  # first where every neighbour is placed, then with what is
        changed = True
        while changed:
            changed = False
            for i, n in enumerate(graph.node):
                if where[i] is not None:
                    continue
                near = [where[producer[x]] for x in n.input
                        if x in producer and graph.node[producer[x]].op_type != "Constant"]
                near += [where[c] for o in n.output for c in consumers.get(o, [])]
                if not near or (strict and None in near):
                    continue
                placed = [p for p in near if p is not None]
                where[i] = common(placed) if placed and "" not in placed else ""
                changed = True
    return [p or "" for p in where]


# ---- the job (child process) and the item --------------------------------------------------------

def localize_step_job(artifact: str, reference_path: str, out_dir: str, runtime: str = NATIVE) -> dict:
    """Job function (child process): place the nodes, mark, run, extract and run each stage, on
    `runtime` (onnx_stages.stage_runner)."""
    with stage_runner(runtime) as run:
        return {**_localize_step(artifact, reference_path, out_dir, run), **ran_on(run)}


def _localize_step(artifact: str, reference_path: str, out_dir: str, run=run_onnx) -> dict:
    ref = torch.load(reference_path, weights_only=False)
    out = Path(out_dir)
    model = onnx.load(artifact, load_external_data=False)
    node_path, how = step_node_paths(model, ref["paths"], ref["roots"])
    groups = float_boundaries(model, module_groups(model, [p for p, _ in ref["stages"]], node_path=node_path))
    candidates = [t for g in groups.values() for t in (*g["outputs"], *g["inputs"])]
    marked = marked_copy(Path(artifact), out / "marked.onnx", candidates)
    values = run(marked, ref["feed"])
    marked.unlink()
    local_ref = {**ref, "dynamic": depends_on_inputs(model), "from_inputs": moved_inputs(model)}
    rows = {p: stage_row(p, what, groups.get(p), values, local_ref, Path(artifact), out, run)
            for p, what in ref["stages"] if p != TAIL}
    if rows.get(TAIL_FROM, {}).get("tensor") and rows.get(TAIL_TO, {}).get("tensor"):  # the cut between them
        tail = {"nodes": [], "inputs": [rows[TAIL_FROM]["tensor"]], "outputs": [rows[TAIL_TO]["tensor"]]}
        rows[TAIL] = stage_row(TAIL, dict(ref["stages"])[TAIL], tail, values, local_ref, Path(artifact), out, run)
    torch.save(rows, out / "stages.pt")
    return {"names": how, "mapped": [p for p, r in rows.items() if r.get("mapped")]}


def localize_step(session, artifact: Path, case_id: str, step: str, input_mapping: dict, rec, tol, run_dir: Path,
                  variant: tuple[str, ...] = (), log=print, runtime: str = NATIVE) -> dict:
    """Localize inside one step's ONNX on one case (exact lengths); fills `rec.bisect` with
    onnx_stages' structure, so reports and the dashboard show it as a whole model's. `variant`:
    the item's semantics-changing patches (a port's own STFT), carried by the module references;
    `runtime`: the one that judged the item, which runs the stages too."""
    traces = session.traces(case_id)
    ran = step_modules(session.model, step, traces, variant)
    inputs = traces.inputs(step, "dynamic", "float32")
    feed = {port: inputs[name].numpy() for port, name in input_mapping.items()}
    return localize_modules(session, artifact, case_id, ran, feed, rec, tol, run_dir,
                            {"step": step, "what": f"step {step!r}", "roots": step_roots(ran["order"]),
                             "repro": f"{case_id}-{step}-{artifact.stem}"}, variant, log, runtime)


def localize_modules(session, artifact: Path, case_id: str, ran: dict, feed: dict, rec, tol, run_dir: Path,
                     where: dict, variant: tuple[str, ...] = (), log=print, runtime: str = NATIVE,
                     zero_noise: bool = False) -> dict:
    """The Kokoro modules of `ran` (a hooked run: step_modules, model_modules) with parameters,
    each judged inside the ONNX fed `feed` (its graph inputs): chained and locally, against the
    module captures; fills `rec.bisect` (kind `onnx-stages`; `where`: the key naming what was cut,
    `step` or `port_stage`, its `what` for the errors, the `roots` its node names resolve under and
    the `repro` bundle's directory name); the ONNX runs on `runtime` (onnx_stages.stage_runner).
    `zero_noise`: the artifact draws no noise and takes none, so the modules are judged against
    captures with every noise input zero, as its own output is."""

    traces = session.traces(case_id)
    stages, skipped = choose_stages(ran)
    ran, stages = with_tail(ran, stages)
    if not stages:
        return _no_stages(rec, f"{where['what']} has no submodule with parameters below its module: judged whole", log)
    try:
        caps = module_captures(session.model, session.cases[case_id],
                               dataclasses.replace(traces, captures={}) if variant or zero_noise else traces,
                               [f"{p}:out" for p in stages if p != TAIL]
                               + [f"{p}:in" for p in stages if p in ran["tensor_in"] and p != TAIL], variant, zero_noise)
        caps = tail_captures(caps, stages)
    except ValueError as e:  # a module the harness's steps do not run as a forward
        return _no_stages(rec, f"no module references for {where['what']}: {e}", log)
    ref = {"feed": feed, "fp32": {p: caps[(f"{p}:out", "float32")] for p in stages},
           # no float64 capture where the float64 reference runs an LSTM packed (no tensor comes out):
           # that stage is judged against float32 with the tolerance alone (a zero floor)
           "fp64": {p: caps.get((f"{p}:out", "float64"), caps[(f"{p}:out", "float32")].double()) for p in stages},
           "fp32_in": {p: [caps[(f"{p}:in", "float32")]] for p in stages if p in ran["tensor_in"]}}
    job_ref = {k: ref[k] for k in ("feed", "fp32", "fp32_in")}
    job_ref.update(paths=ran["paths"], roots=where["roots"], stages=[(p, ran["types"][p]) for p in stages])
    log(f"localizing inside {artifact.name} ({len(stages)} modules of {where['what']}): marking, extracting each ...")
    result, rows = run_localize_job(session, "harness.port.onnx_steps:localize_step_job", artifact, job_ref, run_dir,
                                    runtime)
    if not result.ok:
        return _no_stages(rec, f"localization failed: {result.error}", log)
    table, first = judge_modules(ran, skipped, rows, ref, caps, comparator(tol))
    names = result.value["names"] + (f"; references with {'+'.join(variant)}" if variant else "")
    key = "step" if "step" in where else "port_stage"
    rec.bisect = OnnxStages(artifact=str(artifact), names=names, stages=table,
                            unmapped=[e["stage"] for e in table if not e["mapped"]], **{key: where[key]},
                            **({"noise": "none drawn"} if zero_noise else {}))
    localized_on(rec, runtime, result.value.get("ran_on"), log)
    if first is not None:
        rec.bisect.first_stage = first
        rec.bisect.repro = write_repro(session.report_dir / "repro" / where["repro"], rows[first], ref, first, tol,
                                       result.value.get("ran_on"))
    for line in stage_lines(rec.bisect):
        log(line)
    return rec.bisect


# The generator's tail, from conv_post's output to the audio (exp and sin of its halves, the inverse
# STFT: a method, no forward to hook), as onnx_stages names it: a stage wherever both ends are.
TAIL, TAIL_FROM, TAIL_TO = "decoder.generator.istft", "decoder.generator.conv_post", "decoder.generator"


def with_tail(ran: dict, stages: list[str]) -> tuple[dict, list[str]]:
    """The stages with the generator's tail after conv_post, when conv_post and the generator are stages."""
    if TAIL_FROM not in stages or TAIL_TO not in stages:
        return ran, stages
    after = lambda seq: [x for p in seq for x in ((p, TAIL) if p == TAIL_FROM else (p,))]  # noqa: E731
    return ({**ran, "order": after(ran["order"]), "types": {**ran["types"], TAIL: "tail: magnitude/phase -> inverse "
             "STFT -> audio"}, "tensor_in": ran["tensor_in"] | {TAIL}}, after(stages))


def tail_captures(caps: dict, stages: list[str]) -> dict:
    """The tail's references: conv_post's output in, the generator's output out."""
    if TAIL not in stages:
        return caps
    caps = dict(caps)
    for dtype in ("float32", "float64"):
        for ref, path, which in ((f"{TAIL}:out", TAIL_TO, "out"), (f"{TAIL}:in", TAIL_FROM, "out")):
            if (f"{path}:{which}", dtype) in caps:
                caps[(ref, dtype)] = caps[(f"{path}:{which}", dtype)]
    return caps


def _no_stages(rec, error: str, log) -> dict:
    rec.bisect = Unlocalized(error=error)
    log(error)
    return rec.bisect


def judge_modules(ran: dict, skipped: dict, rows: dict, ref: dict, caps: dict, check) -> tuple[list, str | None]:
    """The table's rows in the order the modules finish, and the first whose local error leaves
    its tolerance (a local error under a chain that holds is the cut's, not the module's)."""
    table, first = [], None
    for path in ran["order"]:
        if path in skipped:
            table.append({"stage": path, "what": ran["types"][path], "mapped": False, "why": skipped[path]})
            continue
        if path not in rows:
            continue
        row = rows[path]
        entry = {"stage": path, "what": row["what"], "mapped": row.get("mapped", False)}
        if not entry["mapped"]:
            entry["why"] = row["why"]
        else:
            judge_row(entry, row, ref["fp32"][path], ref["fp64"][path], check)
            if (f"{path}:out", "float64") not in caps:
                entry["note"] = "no float64 capture (run packed in float64): against float32, the tolerance alone"
            local, chained = entry.get("local") or {}, entry.get("chained") or {}
            # a local error under a chain that holds means the cut was fed something other than the
            # module's input (an exporter merged a computation of two modules): not the module's own
            if local and not local["ok"] and chained.get("ok"):
                entry["note"] = ("local cut fed otherwise (the export shares a computation with another module): "
                                 "not this module's error, its chained value holds")
            elif local and not local["ok"] and first is None:
                first = path
        table.append(entry)
    return table, first


def localize_artifact_item(session, item, rec, log=print, runtime: str = NATIVE) -> dict:
    """`--bisect` on a failing `--artifact STEP=PATH` item: inside an ONNX, stage by stage; any
    other format is judged whole, with the reason in `rec.bisect`. Rewrites the record. An item
    judged on a browser runtime is localized in that browser runtime, and the record says so."""
    path = Path(item.path)
    kind = kind_of(path)
    why = None
    if kind == "executorch":  # the ETRecord/ETDump localization (harness/port/pte_stages.py) plugs in here
        why = f"{path.name}: a .pte is localized through ExecuTorch's ETRecord, not wired for step artifacts yet"
    elif kind != "onnx":
        why = f"{path.name}: a {kind} artifact exposes no intermediate values to the harness"
    elif item.mode != "dynamic":
        why = (f"{item.id}: module references exist for the exact lengths only (reference.module_captures); "
               f"bisect the dynamic item")
    elif not rec.audit.get("input_mapping"):
        why = f"{item.id}: the artifact's inputs were never mapped to the step's"
    if why:
        rec.bisect = Unlocalized(error=f"{why}: judged whole")
        log(rec.bisect.error)
    else:
        tol = session.profile.for_(item.step, item.backend, item.mode)
        variant = affecting([p for p in rec.patches if p not in REFERENCE_PATCHES["dynamic"]
                             and p not in NEUTRAL_PATCHES], item.step)  # as reference.references_for picks them
        localize_step(session, path, item.case, item.step, rec.audit["input_mapping"], rec, tol,
                      session.report_dir / "runs" / item.id / "localize", variant, log, runtime=runtime)
    rec.write(session.report_dir / "records")
    return rec.bisect
