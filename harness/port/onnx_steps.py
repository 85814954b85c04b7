"""The one ONNX localizer (`localize_modules`): inside a whole-model ONNX (a one-stage port,
`--artifact e2e=PATH`), a chain's ONNX stage (harness.port.chain_localize) or one step's ONNX
(`--artifact STEP=PATH --bisect`: `localize_step`), the Kokoro modules the file's names reach,
each judged chained and locally; onnx_stages holds the ONNX side (marking, cutting, feeding,
judging a row, ranking defects, the repro bundle).

- *Stages*: every module with parameters that the file's node names reach, at the granularity
  STAGE_DEPTH allows (`choose_stages`: levels of Kokoro's calls from the model's top; in a whole
  model, the F0 and N blocks and their convolutions, the decoder's encode and decode blocks and
  theirs, the generator's harmonic source, upsamplers, resblocks, noise convolutions and conv_post,
  and its tail from conv_post to the audio: `TAIL`), in the order a hooked float32 run finishes
  them, so a module comes before the one that holds it and the first named is the innermost. A
  module called more than once (shared weights) is listed as not mapped: one capture cannot stand
  for every call.
- *Names*: a node's module path comes from the dynamo exporter's metadata
  (`pkg.torch.onnx.name_scopes`, else `namespace`: full paths from the exported module) or from a
  TorchScript-exporter name (`/decoder/generator/conv_post/Conv`: one segment per module call, each
  relative to the call around it). The export's own prefix (`kmodel.` of the harness's step
  wrapper, a user's wrapper module, the packaged file's `/encoder`) and the module the names start
  from (`decoder` when the user exported `kmodel.decoder` itself) are found together: the pair
  under which most nodes resolve to real modules.
- *References*: `reference.module_captures` (`path:out` and `path:in`, float32 and float64, one
  teacher-forced run of each step on the exact lengths, cached), with every noise input zero for a
  file that draws none and takes none; for the harmonic source also what an export may feed it
  (the upsampled F0, voiced masks) and another draw of its noise. Each stage is judged chained (the
  marked run) and locally (its extracted subgraph fed the reference's inputs) against the fp32
  floor with the item's tolerance; chained after the source, where the F0's phase or the file's own
  noise rules, the audio's noise band judges; a cut that draws its own noise, by what its phase
  and noise do not hide (envelope, instantaneous frequency, harmonic magnitudes).
- *Durations* the graph rounds inside it (Round, then Clip: found by position) are read; when
  they differ from the reference's, everything after them runs again on the reference's, forced.
- *Between stages*: the ops that compute a stage's input outside every stage (a parent's own ops,
  unnamed nodes) are a row of their own, `<stage>:input` (onnx_glue), judged as a stage is.
- *Defects*: each innermost module whose local error leaves its tolerance, ranked by its effect
  on the audio when the file outputs it (onnx_stages.rank_defects), in the reason; the first's
  repro bundle is onnx_stages' (numpy + onnxruntime only; a static page too when the item ran in
  onnxruntime-web, whose browser runs the stages as well).
"""
from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import onnx
import torch

from ..backends.prebuilt import NATIVE, kind_of
from ..patches import affecting, apply_patches, provide_noise
from ..record import OnnxStages, Unlocalized
from ..reference import NEUTRAL_PATCHES, REFERENCE_PATCHES, module_captures
from ..steps import get_step
from ..verdict import comparator
from . import tensors
from .defects import defects_reason, score_defects
from .noise import zero_noise_reference
from .onnx_glue import INPUT_SUFFIX, glue_rows, judge_references
from .onnx_graph import (depends_on_inputs, draws_noise, durations_tensor, force_input, marked_copy, moved_inputs,
                         run_onnx, seeded_copy)
from .onnx_stages import (STOCHASTIC_FROM, band_rows, float_boundaries, found_defects, judge_own_noise, judge_row,
                          localized_on, module_groups, other_draw, ran_on, rank_defects, row_sub, run_localize_job,
                          source_inputs, stage_lines, stage_row, stage_runner, write_repro)

STAGE_DEPTH = 3  # module levels of Kokoro's calls, from the model's top, that become stages (choose_stages)
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
    parameters at levels 1..depth of Kokoro's calls, counted from the model's top: a module no
    module around it ran is level 1, each module around it that ran adds one. In a whole model:
    the F0 and N blocks (1) and their convolutions and norms (2); the decoder (1), its encode and
    decode blocks (2) and their convolutions (3); the generator (2), its harmonic source,
    upsamplers, resblocks, noise convolutions and conv_post (3). An artifact of one module (a
    step's, a vocoder's decoder) is its inside: that module is not a stage of its own, so a part
    of the model cut out is judged at the granularity the whole file is."""
    order, calls = ran["order"], ran["calls"]
    seen = set(order)
    roots = step_roots(order)
    whole = roots[0] if len(roots) == 1 else None
    stages, skipped = [], {}
    for p in order:
        level = 1 + sum(a in seen for a in _ancestors(p))
        if level > depth or p not in ran["params"] or p == whole:
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


# ---- the job (child process) ------------------------------------------------------------------------

def localize_job(artifact: str, reference_path: str, out_dir: str, runtime: str = NATIVE) -> dict:
    """Job function (child process): place the nodes, mark, run (the durations inside forced when
    they differ from the reference's), extract and run each stage, on `runtime`
    (onnx_stages.stage_runner)."""
    with stage_runner(runtime) as run:
        return {**_localize(artifact, reference_path, out_dir, run), **ran_on(run)}


def _localize(artifact: str, reference_path: str, out_dir: str, run=run_onnx) -> dict:
    ref = torch.load(reference_path, weights_only=False)
    out = Path(out_dir)
    model = onnx.load(artifact, load_external_data=False)
    node_path, how = step_node_paths(model, ref["paths"], ref["roots"])
    groups = float_boundaries(model, module_groups(model, [p for p, _ in ref["stages"]], node_path=node_path))
    dur = inner_durations(model) if "pred_dur" in ref else None
    source = Path(artifact)  # what each stage's subgraph is cut from
    if draws_noise(model):  # its random ops seeded: every run here (marked, cut, fed) draws the same numbers
        source = seeded_copy(source, out / "seeded.onnx")
    candidates = [t for g in groups.values() for t in (*g["outputs"], *g["inputs"])] + ([dur] if dur else [])
    marked = marked_copy(source, out / "marked.onnx", candidates)
    values = run(marked, ref["feed"])
    audio = ref.get("audio")
    unforced = None if audio is None else np.asarray(values[audio]).reshape(-1)
    feed, forced = dict(ref["feed"]), None
    if dur is not None:
        values, feed, source, forced = force_durations(run, marked, source, dur, values, feed, ref["pred_dur"])
    marked.unlink()
    local_ref = {**ref, "feed": feed, "dynamic": depends_on_inputs(model), "from_inputs": moved_inputs(model)}
    rows = {p: stage_row(p, what, groups.get(p), values, local_ref, source, out, run)
            for p, what in ref["stages"] if p != TAIL}
    if rows.get(TAIL_FROM, {}).get("tensor") and rows.get(TAIL_TO, {}).get("tensor"):  # the cut between them
        tail = {"nodes": [], "inputs": [rows[TAIL_FROM]["tensor"]], "outputs": [rows[TAIL_TO]["tensor"]]}
        rows[TAIL] = stage_row(TAIL, dict(ref["stages"])[TAIL], tail, values, local_ref, source, out, run)
    rows.update(glue_rows(model, groups, rows, values, local_ref, source, out, run))
    if dur is not None:
        rows["pred_dur"] = {"what": "durations (Round, Clip)", "mapped": True, "tensor": dur,
                            "chained": np.asarray(values[dur]).reshape(-1)}
    if audio is not None:
        rows["audio"] = {"what": "audio" + (" (reference durations forced)" if forced else ""), "mapped": True,
                         "tensor": audio, "chained": np.asarray(values[audio]).reshape(-1), "unforced": unforced}
        torch.save({"source": str(source), "feed": feed, "audio": audio}, out / "run.pt")  # for the effects' runs
    torch.save(rows, out / "stages.pt")
    return {"names": how, "mapped": [p for p, r in rows.items() if r.get("mapped")], "forced_durations": forced}


def inner_durations(model) -> str | None:
    """The rounded durations the graph computes and uses (onnx_graph.durations_tensor), not when
    they are its output (then they are what the graph computes, judged as such)."""
    dur = durations_tensor(model)
    return None if dur is None or dur in {o.name for o in model.graph.output} else dur


def force_durations(run, marked: Path, source: Path, dur: str, values: dict, feed: dict, want: np.ndarray):
    """(values, feed, source, forced): when the graph's own durations differ from the reference's
    (`want`), everything after them computed again with the reference's forced (the durations
    tensor becomes an input, `onnx_graph.force_input`), and the stages cut from that copy;
    `values[dur]` stays the graph's own."""
    own = np.asarray(values[dur])
    if own.size == want.size and (own.reshape(-1) == want.reshape(-1)).all():
        return values, feed, source, False
    cut = force_input(marked, marked.with_name("forced-marked.onnx"), dur, own.dtype)
    feed = {**feed, dur: want.astype(own.dtype).reshape(own.shape if own.size == want.size else -1)}
    values = {**run(cut, feed), dur: own}
    cut.unlink()
    return values, feed, force_input(source, marked.with_name("forced.onnx"), dur, own.dtype), True


# ---- the one localizer ---------------------------------------------------------------------------

def localize_step(session, artifact: Path, case_id: str, step: str, input_mapping: dict, rec, tol, run_dir: Path,
                  variant: tuple[str, ...] = (), log=print, runtime: str = NATIVE) -> dict:
    """Localize inside one step's ONNX on one case (exact lengths); fills `rec.bisect` with
    onnx_stages' structure, so reports and the dashboard show it as a whole model's. `variant`:
    the item's semantics-changing patches (a port's own STFT), carried by the module references;
    `runtime`: the one that judged the item, which runs the stages too. A step whose one output is
    the audio (the decoder) has its defects ranked by their effect on it."""
    traces = session.traces(case_id)
    ran = step_modules(session.model, step, traces, variant)
    inputs = traces.inputs(step, "dynamic", "float32")
    feed = {port: inputs[name].numpy() for port, name in input_mapping.items()}
    audio = None
    if list(get_step(step).output_names) == ["audio"]:
        outs = onnx.load(str(artifact), load_external_data=False).graph.output
        audio = outs[0].name if len(outs) == 1 else None
    return localize_modules(session, artifact, case_id, ran, feed, rec, tol, run_dir,
                            {"step": step, "what": f"step {step!r}", "roots": step_roots(ran["order"]),
                             "repro": f"{case_id}-{step}-{artifact.stem}", "audio": audio}, variant, log, runtime)


def localize_modules(session, artifact: Path, case_id: str, ran: dict, feed: dict, rec, tol, run_dir: Path,
                     where: dict, variant: tuple[str, ...] = (), log=print, runtime: str = NATIVE,
                     zero_noise: bool = False) -> dict:
    """The one localizer inside an ONNX (a whole model, a chain's stage, one step's file): the
    Kokoro modules of `ran` (a hooked run: model_modules, step_modules, cut to what the file's
    names reach) with parameters (choose_stages), each judged inside the ONNX fed `feed` (its
    graph inputs): chained and locally, against the module captures; the durations inside forced
    when they differ from the reference's; a module that draws its own noise judged by what its
    phase and noise do not hide (onnx_stages.judge_own_noise); every defect (the innermost
    failing modules) ranked by its effect on the audio when the file outputs it (`where["audio"]`:
    that output's name). Fills `rec.bisect` (kind `onnx-stages`; `where`: the key naming what was
    cut, `step` or `port_stage` (none for a whole model), its `what`, the `roots` its node names
    resolve under and the `repro` bundle's directory name); the ONNX runs on `runtime`
    (onnx_stages.stage_runner). `zero_noise`: the artifact draws no noise and takes none, so the
    modules are judged against captures with every noise input zero, as its own output is."""
    stages, skipped = choose_stages(ran)
    ran, stages = with_tail(ran, stages)
    if not stages:
        return _no_stages(rec, f"{where['what']} has no submodule with parameters below its module: judged whole", log)
    noisy = draws_noise(onnx.load(str(artifact), load_external_data=False))
    try:
        ref, caps = module_references(session, case_id, ran, stages, feed, variant, zero_noise, noisy,
                                      where.get("audio"))
    except ValueError as e:  # a module the harness's steps do not run as a forward
        return _no_stages(rec, f"no module references for {where['what']}: {e}", log)
    job_ref = {k: ref[k] for k in ("feed", "fp32", "fp32_in", "fp32_derived")}
    if where.get("durations", True):  # else they are the file's output: judged where the file is, not forced
        job_ref["pred_dur"] = ref["pred_dur"]
    job_ref.update(paths=ran["paths"], roots=where["roots"], stages=[(p, ran["types"][p]) for p in stages],
                   audio=where.get("audio"))
    log(f"localizing inside {artifact.name} ({len(stages)} modules of {where['what']}): marking, extracting each ...")
    result, rows = run_localize_job(session, "harness.port.onnx_steps:localize_job", artifact, job_ref, run_dir,
                                    runtime, target_of(rec))
    if not result.ok:
        return _no_stages(rec, f"localization failed: {result.error}", log)
    judge_references(ref, rows, caps)
    table = judge_modules(ran, skipped, rows, ref, caps, comparator(tol), noisy)
    names = result.value["names"] + (f"; references with {'+'.join(variant)}" if variant else "")
    key = next((k for k in ("step", "port_stage") if k in where), None)
    forced = result.value.get("forced_durations")
    rec.bisect = OnnxStages(artifact=str(artifact), names=names, stages=table,
                            unmapped=[e["stage"] for e in table if not e["mapped"]], **({key: where[key]} if key else {}),
                            **({"noise": "draws its own"} if noisy else {"noise": "none drawn"} if zero_noise else {}),
                            **({"forced_durations": forced} if forced is not None else {}))
    localized_on(rec, runtime, result.value.get("ran_on"), log)
    findings(session, case_id, rec, rows, ref, tol, run_dir, where, result.value.get("ran_on"), runtime)
    for line in stage_lines(rec.bisect):
        log(line)
    return rec.bisect


def module_references(session, case_id: str, ran: dict, stages: list[str], feed: dict, variant: tuple[str, ...],
                      zero_noise: bool, noisy: bool, audio: str | None) -> tuple[dict, dict]:
    """(the references the stages are judged against, the module captures): each stage's output
    (float32, float64) and input (float32), what an export may feed the harmonic source instead of
    its argument, another noise draw of the source (its measures' floor, for a file that draws its
    own), the reference's durations, and the audio when the file outputs it."""
    traces = session.traces(case_id)
    caps = module_captures(session.model, session.cases[case_id],
                           dataclasses.replace(traces, captures={}) if variant or zero_noise else traces,
                           [f"{p}:out" for p in stages if p != TAIL]
                           + [f"{p}:in" for p in stages if p in ran["tensor_in"] and p != TAIL], variant, zero_noise)
    caps = tail_captures(caps, stages)
    ref = {"feed": feed, "fp32": {p: caps[(f"{p}:out", "float32")] for p in stages},
           # no float64 capture where the float64 reference runs an LSTM packed (no tensor comes out):
           # that stage is judged against float32 with the tolerance alone (a zero floor)
           "fp64": {p: caps.get((f"{p}:out", "float64"), caps[(f"{p}:out", "float32")].double()) for p in stages},
           "fp32_in": {p: [caps[(f"{p}:in", "float32")]] for p in stages if p in ran["tensor_in"]},
           "fp32_derived": {}, "pred_dur": np.asarray(traces.pred_dur, np.int64).reshape(-1)}
    if STOCHASTIC_FROM in stages:
        km = apply_patches(session.model.kmodel, (*REFERENCE_PATCHES["dynamic"], *variant))
        with torch.no_grad():
            ref["fp32_derived"][STOCHASTIC_FROM] = source_inputs(km, {"predictor.F0_proj": traces.chain["F0_pred"]})
            if noisy and STOCHASTIC_FROM in ref["fp32_in"]:
                ref["fp32_other_draw"] = {STOCHASTIC_FROM: other_draw(km, ref["fp32_in"][STOCHASTIC_FROM][0])}
    if audio is not None:
        want = zero_noise_reference(session, case_id) if zero_noise else \
            {d: tensors.reference("audio", traces, d) for d in ("float32", "float64")}
        ref["fp32"]["audio"], ref["fp64"]["audio"] = want["float32"], want["float64"].double()
    return ref, caps


# The generator's tail, from conv_post's output to the audio (exp and sin of its halves, the inverse
# STFT: a method, no forward to hook): a stage wherever both ends are.
TAIL, TAIL_FROM, TAIL_TO = "decoder.generator.istft", "decoder.generator.conv_post", "decoder.generator"
F0_FROM = "predictor.F0_proj"  # the F0 curve, whose long cumulative sum is the harmonic source's phase


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


def after_source(ran: dict, noisy: bool) -> set[str]:
    """The modules whose chained values carry the harmonic source's phase and noise, from the
    source on (the audio too): when the file draws its own noise, or computes the F0 curve itself
    (the phase is a long cumulative sum of it: any difference of F0 moves it). Their chained
    values are not judged sample by sample (the audio's noise band judges the end)."""
    order = ran["order"]
    if STOCHASTIC_FROM not in order or not (noisy or F0_FROM in order):
        return set()
    return set(order[order.index(STOCHASTIC_FROM):]) | {"audio"}


def judge_modules(ran: dict, skipped: dict, rows: dict, ref: dict, caps: dict, check, noisy: bool = False) -> list:
    """The table's rows in the order the modules finish, then the durations and the audio."""
    after = after_source(ran, noisy)
    table = []
    for path in ran["order"]:
        if path in skipped:
            table.append({"stage": path, "what": ran["types"][path], "mapped": False, "why": skipped[path]})
        elif path in rows:
            if path + INPUT_SUFFIX in rows:  # the ops computing its input outside every stage (onnx_glue)
                entry = judge_module(path + INPUT_SUFFIX, rows[path + INPUT_SUFFIX], ref, check, path in after, noisy)
                if (f"{path}:in", "float64") not in caps:
                    entry["note"] = "no float64 capture of its input: against float32, the tolerance alone"
                table.append(fed_otherwise(entry))
            entry = judge_module(path, rows[path], ref, check, path in after, noisy)
            if entry.get("mapped") and (f"{path}:out", "float64") not in caps:
                entry["note"] = "no float64 capture (run packed in float64): against float32, the tolerance alone"
            table.append(fed_otherwise(entry))
    if "pred_dur" in rows:
        got, want = torch.as_tensor(rows["pred_dur"]["chained"]).long(), torch.as_tensor(ref["pred_dur"]).long()
        n = min(len(got), len(want))
        differ = int((got[:n] != want[:n]).sum()) + abs(len(got) - len(want))
        table.append({"stage": "pred_dur", "what": rows["pred_dur"]["what"], "mapped": True, "tokens_differ": differ,
                      "max_frames_diff": int((got[:n] - want[:n]).abs().max()) if n else 0, "ok": differ == 0})
    if "audio" in rows:
        table.append(judge_module("audio", rows["audio"], ref, check, "audio" in after, noisy))
    return table


def judge_module(path: str, row: dict, ref: dict, check, after: bool, noisy: bool) -> dict:
    """One module's row judged: chained and local against its reference (onnx_stages.judge_row);
    chained after the source, and locally a cut that draws its own noise, by the band; a cut that
    draws its own noise and has another draw of its reference (the source) by what its phase
    and noise do not hide (onnx_stages.judge_own_noise)."""
    entry = {"stage": path, "what": row["what"], "mapped": row.get("mapped", False)}
    if not entry["mapped"]:
        entry["why"] = row["why"]
        return entry
    # locally, a module is noise-dependent only when its own subgraph draws (what follows the source,
    # fed the reference's values, is deterministic even in a file that draws)
    own_noise = noisy and row.get("local_draws_noise", True)
    judge_row(entry, row, ref["fp32"][path], ref["fp64"][path], check,
              stochastic=lambda role: after and (role == "chained" or own_noise))
    other = ref.get("fp32_other_draw", {}).get(path)
    if own_noise and other is not None and row.get("local") is not None:
        entry["local"] = judge_own_noise(row["local"], ref["fp32"][path], other, check)
    fed = {x: how for x, how in (row.get("fed") or {}).items() if not how.startswith("reference input")}
    if fed:
        entry["fed"] = fed  # inputs fed what the reference computes outside the module
    return entry


def fed_otherwise(entry: dict) -> dict:
    """A local error under a chained value that holds sample by sample means the cut was fed
    something other than the module's input (an exporter merged a computation of two modules):
    not the module's own; noted, and no defect. A NaN or Inf is never excused: it stays a defect."""
    local, chained = entry.get("local") or {}, entry.get("chained") or {}
    if local and not local["ok"] and not local.get("nonfinite") and chained.get("ok") and not chained.get("by_band"):
        entry["note"] = ("local cut fed otherwise (the export shares a computation with another module): "
                         "not this module's error, its chained value holds")
    return entry


def defect_rows(table: list) -> list:
    """Every defect: each module whose local error leaves its tolerance, but a module holding
    another that fails (it fails with it) or one whose cut was fed otherwise; in finishing order."""
    failing = [e for e in table if e.get("mapped") and not (e.get("local") or {"ok": True})["ok"]
               and "fed otherwise" not in e.get("note", "")]
    names = {e["stage"] for e in failing}
    return [e for e in failing if not any(n.startswith(e["stage"] + ".") for n in names)]


def target_of(rec) -> str:
    """The target the item ran on: a localization's runs go there too (a browser target's page)."""
    return (getattr(rec, "target", None) or {}).get("name") or "local"


def findings(session, case_id: str, rec, rows: dict, ref: dict, tol, run_dir: Path, where: dict, ran_where,
             runtime: str) -> None:
    """Into `rec.bisect`: the audio with the reference's durations forced against the noise band;
    every defect, ranked by its effect on the audio when the file outputs it (onnx_stages.rank_defects),
    else listed as found, and into `rec.reason`; the first's repro bundle."""
    b = rec.bisect
    audio = rows.get("audio") or {}
    if audio.get("mapped") and b.get("forced_durations"):
        b.forced_audio = band_rows(session, case_id, session.traces(case_id), audio["chained"], tol)
    defects = defect_rows(b.stages)
    if not defects:
        return
    if audio.get("mapped"):
        b.defects = rank_defects(session, defects, rows, ref, run_dir, runtime, target_of(rec))
    else:
        b.defects = score_defects([{**d, "unranked": f"{where['what']} does not output the audio"}
                                   for d in found_defects(defects, rows)], {}, np.zeros(0))
    rec.reason = (rec.reason + "; " if rec.reason else "") + defects_reason(b.defects)
    first = defects[0]["stage"]
    b.first_stage = first
    if row_sub(rows, first) is not None:
        b.repro = write_repro(session.report_dir / "repro" / where["repro"], rows[first], ref, first, tol, ran_where)


# ---- the step's item ------------------------------------------------------------------------------

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
