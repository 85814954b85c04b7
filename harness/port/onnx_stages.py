"""The ONNX side of the one ONNX localizer (harness.port.onnx_steps.localize_modules: a whole
model, a chain's stage, one step's file): intermediate values exposed as outputs, each module's
row judged chained and locally; every defect ranked by how far taking it out alone moves the
audio; a repro bundle for the first.

- *Mark*: like Polygraphy's `mark all`, the module outputs become graph outputs of a copy of the
  ONNX (`module_groups`: the nodes onnx_steps places in each module, with the unnamed ones fed only
  by it and its activation quantizers); a module's output is the tensor its nodes produce for a
  node outside it, the one whose size matches the reference capture. A module no node is placed in
  is reported as not mapped.
- *Chained*: the marked run's value of each module against the reference. *Local*: the module's
  subgraph (`onnx.utils.Extractor`, the file read once) fed the reference's inputs of that module,
  matched by value (the harmonic source's also what an export computes outside it: upsampled F0,
  voiced mask); a subgraph that draws its own noise (the source) by what its phase and noise do
  not hide, its amplitude envelope, instantaneous frequency and harmonic magnitudes
  (`judge_own_noise`, each against another noise draw: `other_draw`).
- *Defects*: each taken out of its chained output as its kind says and fed back into a copy of the
  artifact (random ops seeded alike), the audio with and without it compared (`rank_defects`).
- *Repro*: the extracted subgraph, its inputs, the expected output and a repro.py that imports only
  numpy and onnxruntime (exit 1 reproduced, 0 fixed, 2 cannot run here).
- *Where*: every ONNX run here (marked, cut, fed) is on the runtime that judged the item: onnxruntime
  CPU, or onnxruntime-web in one headless Chromium (`stage_runner`), whose bundle then holds a
  static page that runs the stage in the browser (harness.port.web_repro).
"""
from __future__ import annotations

import contextlib
import functools
import math
from pathlib import Path

import numpy as np
import onnx
import torch

from ..backends import get_backend
from ..backends.onnxruntime_web import BrowserRunner, stage_pages
from ..backends.prebuilt import NATIVE
from ..metrics import fmt
from ..metrics.audio import audio_metrics
from ..metrics.tensor import compare_to_floor, error_metrics
from ..patches import provide_noise, sample_noise
from ..plumbing.bundle import write_bundle_dir
from ..plumbing.files import atomic_write
from ..plumbing.jobs import run_job
from ..record import OnnxStages
from ..verdict import band_comparator
from .defects import (OWN_NOISE_MEASURES, defects_reason, effect_text, envelope,  # noqa: F401
                      frequency_shift, score_defects, without_own_error)
from .differences import difference_kind, nonfinite, unwrapped
from .matching import best_layout, layouts, rel_l2
from .noise import DIRECTIONS, noise_band, session_k
from .onnx_graph import draws_noise, given_copy, run_onnx, seeded_copy
from .web_repro import browser_files

# The harmonic source: it draws its own noise, and its phase is a long cumulative sum of F0.
STOCHASTIC_FROM = "decoder.generator.m_source"


def module_groups(model, paths, node_path) -> dict[str, dict]:
    """module path -> {"nodes": indices, "outputs": candidate tensors, "inputs": external inputs}.
    `node_path(node)` places a node in a module (onnx_steps.step_node_paths)."""
    graph = model.graph
    consts = {i.name for i in graph.initializer}
    producer = {}
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(graph.node):
        for o in n.output:
            producer[o] = i
        for x in n.input:
            consumers.setdefault(x, []).append(i)
    where = [node_path(n) for n in graph.node]
    graph_outputs = {o.name for o in graph.output}
    data = data_tensors(graph)
    groups = {}
    for path in paths:
        members = {i for i, p in enumerate(where) if p is not None and (p == path or p.startswith(path + "."))}
        if not members:
            continue
        changed = True
        while changed:  # unnamed (fused) nodes fed only by this module belong to it
            changed = False
            for j, n in enumerate(graph.node):
                if j in members or where[j] is not None or n.op_type == "DynamicQuantizeLinear":
                    continue
                srcs = [producer[x] for x in n.input if x and x not in consts and x in producer
                        and graph.node[producer[x]].op_type != "Constant"]
                if srcs and all(i in members for i in srcs):
                    members.add(j)
                    changed = True
        absorb_quantization(graph, path, members, where, producer, consumers, data)
        outs, ins = [], []
        for i in sorted(members):
            for o in graph.node[i].output:
                if o and (o in graph_outputs or any(c not in members for c in consumers.get(o, []))):
                    outs.append(o)
            for x in graph.node[i].input:
                if x and x not in consts and producer.get(x) not in members and x not in ins:
                    if x in producer and graph.node[producer[x]].op_type == "Constant":
                        continue
                    ins.append(x)
        groups[path] = {"nodes": sorted(members), "outputs": outs, "inputs": ins}
    return groups


def data_tensors(graph) -> set[str]:
    """The tensors computed from the graph's inputs as data: not a quantizer's scale or zero
    point (a DynamicQuantizeLinear's 2nd and 3rd outputs), nor what is computed from those and
    the weights alone (a bias requantized by its input's scale)."""
    data = {i.name for i in graph.input}
    for n in graph.node:  # ONNX nodes are topologically sorted
        if n.op_type == "DynamicQuantizeLinear":
            if n.input[0] in data:
                data.add(n.output[0])
        elif any(x in data for x in n.input):
            data.update(n.output)
    return data


def absorb_quantization(graph, path: str, members: set, where: list, producer: dict, consumers: dict,
                        data: set) -> None:
    """Into a module's nodes (`members`), what feeds only them: its activation quantizers, and the
    quantization glue placed around it (in a module holding it, or nowhere: the quantizer names it
    after the weights, not the module) whose data comes from the module alone: a quantized conv's
    bias divided by its input's scale, and the Add that puts it on the conv's integer output. Cut
    out without it, the module's subgraph would take that glue's value, computed from the
    artifact's own input, as an input of its own (and compute nothing of the module's)."""
    around = lambda p: not p or p == path or path.startswith(p + ".")  # noqa: E731
    stack = list(members)
    while stack:
        for x in graph.node[stack.pop()].input:
            j = producer.get(x)
            if j is None or j in members:
                continue
            n = graph.node[j]
            glue = around(where[j]) and all(producer.get(y) in members for y in n.input if y in data)
            if (n.op_type == "DynamicQuantizeLinear" or glue) and \
                    all(c in members for o in n.output for c in consumers.get(o, [])):
                members.add(j)
                stack.append(j)


def float_boundaries(model, groups: dict) -> dict:
    """An activation quantizer at a module's edge: the float tensor before it is the boundary."""
    producer = {o: n for n in model.graph.node for o in n.output}
    unq = lambda x: (producer[x].input[0] if x in producer  # noqa: E731
                     and producer[x].op_type == "DynamicQuantizeLinear" else x)
    for g in groups.values():
        g["inputs"] = list(dict.fromkeys(unq(x) for x in g["inputs"]))
        g["outputs"] = list(dict.fromkeys(unq(x) for x in g["outputs"]))
    return groups


@contextlib.contextmanager
def stage_runner(runtime: str = NATIVE):
    """What runs the marked model and every subgraph cut from it: onnxruntime CPU (`run_onnx`), or
    the browser runtime that judged the item (`--artifact-runtime ort-web-*`), one browser for all
    of them (the page on the user's device when the item ran there), so that the stage named is
    the one that browser computes wrong."""
    if runtime == NATIVE:
        yield run_onnx
        return
    web = get_backend(runtime)
    with stage_pages(web.execution_provider, web.bundle) as session:
        yield BrowserRunner(session)


def ran_on(run) -> dict:
    """A job's account of where its stages ran: {} on onnxruntime CPU (`stage_runner`)."""
    return {"ran_on": run.about()} if isinstance(run, BrowserRunner) else {}


def stage_row(path: str, what: str, group: dict | None, values: dict, ref: dict, source: Path, out_dir: Path,
              run=run_onnx) -> dict:
    """One module in the marked run: its output tensor (chained) and its subgraph fed the
    reference's inputs (local, run by `run`), or why it could not be mapped. `ref` holds `fp32`,
    `fp32_in`, `feed` (the graph's inputs) and `dynamic` (`depends_on_inputs`)."""
    if group is None:
        return {"what": what, "mapped": False, "why": "no ONNX node is named after this module"}
    want = ref["fp32"].get(path)
    if want is None:
        return {"what": what, "mapped": False, "why": "the reference did not call this module"}
    match = [t for t in group["outputs"] if t in values and np.asarray(values[t]).size == want.numel()
             and np.issubdtype(np.asarray(values[t]).dtype, np.floating)]
    if not match:
        return {"what": what, "mapped": False,
                "why": f"none of its {len(group['outputs'])} output tensors has the reference's size "
                       f"{list(want.shape)}"}
    # several tensors of that size: the module's output is the one nearest the reference
    # (as a mapping rule only; the error of the one chosen is what gets judged)
    tensor = min(match, key=lambda t: rel_l2(values[t], want))
    row = {"what": what, "mapped": True, "tensor": tensor, "nodes": len(group["nodes"]), "candidates": len(match),
           "chained": best_layout(values[tensor], want), "chained_raw": np.asarray(values[tensor])}
    row.update(_local(source, group, tensor, ref, path, values, out_dir / "stages" / path, run))
    return row


SAME_VALUE = 0.1  # rel L2 within which a reused or computed reference value is the artifact's input


def _local(artifact: Path, group: dict, tensor: str, ref: dict, path: str, values: dict, where: Path,
           run=run_onnx) -> dict:
    """Extract the module's subgraph and feed it the reference's inputs of the module: each float
    input the reference value nearest the artifact's own (any axis order), among the module's
    captured arguments and what an export may compute from them outside the module
    (`fp32_derived`: the harmonic source's upsampled F0 and voiced masks), an argument no other
    input took first; one value may feed several inputs when none is left (the same F0 before and
    after a transpose). Integer inputs (shapes, lengths) are the artifact's own values."""
    options = [(f"reference input {i}", a) for i, a in enumerate(ref["fp32_in"].get(path, []))]
    options += list(ref.get("fp32_derived", {}).get(path, []))
    feed, fed = {}, {}
    for x in group["inputs"]:
        own = values.get(x)
        if x in ref["feed"]:
            feed[x] = ref["feed"][x]
            continue
        if own is not None and (x not in ref["dynamic"] or x in ref.get("from_inputs", ())):
            feed[x] = np.asarray(own)  # from weights alone (quantization scales), or the file's own glue
            continue  # over the reference's inputs (the style's halves): the reference's value either way
        own_a = None if own is None else np.asarray(own)
        floating = own_a is not None and np.issubdtype(own_a.dtype, np.floating)
        if floating:
            own_t = torch.from_numpy(own_a.astype(np.float32))
            twin = next((v for v in ref["feed"].values() if np.asarray(v).size == own_t.numel()
                         and np.issubdtype(np.asarray(v).dtype, np.floating) and rel_l2(v, own_t) <= 1e-6), None)
            if twin is not None:  # a graph input reshaped (`F0_curve[:, None]`, shared by two modules): itself
                feed[x] = best_layout(twin, own_t).astype(own_a.dtype)
                continue
            fits = [(label, v) for label, a in options if a.numel() == own_a.size
                    for v in layouts(a.float().numpy(), own_a.shape)]
            # a captured argument feeds one input (two inputs of one size are two arguments: an
            # export that merged two modules' computations must not get one tensor twice); what is
            # computed from the arguments (the upsampled F0, a voiced mask) may feed several. The
            # nearest to the artifact's own value (in its layout) within SAME_VALUE, else the
            # nearest argument no other input took.
            fresh = [o for o in fits if o[0].startswith("reference input") and o[0] not in fed.values()]
            free = {id(o) for o in fresh}
            near = [o for o in fits if (id(o) in free or not o[0].startswith("reference input"))
                    and rel_l2(o[1], own_t) <= SAME_VALUE]
            if near or fresh:
                label, value = min(near or fresh, key=lambda o: rel_l2(o[1], own_t))
                feed[x], fed[x] = value.astype(own_a.dtype), label
                continue
        if own_a is not None and (not floating or own_a.size <= 16):
            feed[x] = own_a  # shapes, lengths, quantization scales: the artifact's own values
        else:
            return {"local_error": f"input {x!r} matches none of the module's reference inputs"}
    return run_cut(artifact, feed, fed, tensor, ref, path, where, run)


def run_cut(artifact: Path, feed: dict, fed: dict, tensor: str, ref: dict, path: str, where: Path,
            run=run_onnx) -> dict:
    """The module's subgraph (inputs `feed`, output `tensor`) cut out of the artifact and run."""
    for k, v in ref["feed"].items():  # the graph's inputs, for what the cut reaches through shapes
        feed.setdefault(k, v)
    where.mkdir(parents=True, exist_ok=True)
    sub = where / "stage.onnx"
    try:
        extract(artifact, sub, list(feed), [tensor])
        got = run(sub, feed, [tensor])[tensor]
    except Exception as e:  # noqa: BLE001 - a stage that cannot be cut out is reported, not fatal
        return {"local_error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    np.savez(where / "inputs.npz", **{k: np.asarray(v) for k, v in feed.items()})
    want = ref["fp32"][path]
    return {"local": best_layout(got, want) if np.asarray(got).size == want.numel() else np.asarray(got),
            "subgraph": str(sub), "inputs": list(feed), "fed": fed,
            "local_draws_noise": draws_noise(onnx.load(str(sub), load_external_data=False))}


def extract(src: Path, dest: Path, inputs: list[str], outputs: list[str]) -> None:
    """onnx.utils.extract_model (no check), the source read and its shapes inferred once per file:
    a localization cuts a hundred modules out of one file."""
    stat = src.stat()
    if stat.st_size > onnx.checker.MAXIMUM_PROTOBUF:  # onnx's own path for a file that large
        onnx.utils.extract_model(str(src), str(dest), inputs, outputs, check_model=False)
        return
    onnx.save(_extractor(str(src.resolve()), stat.st_mtime_ns, stat.st_size).extract_model(inputs, outputs), str(dest))


@functools.lru_cache(maxsize=1)
def _extractor(path: str, _mtime: int, _size: int) -> onnx.utils.Extractor:
    model = onnx.shape_inference.infer_shapes(onnx.load(path, load_external_data=False))
    onnx.load_external_data_for_model(model, str(Path(path).parent))
    return onnx.utils.Extractor(model)


# ---- the harmonic source's references ------------------------------------------------------------

OTHER_DRAW_SEED = 1_000_003  # the source's second noise draw: its measures' own floors (judge_own_noise)


def other_draw(km, f0: torch.Tensor) -> torch.Tensor:
    """Kokoro's harmonic source on its captured input with another draw of its noise: how far its
    output moves by noise alone (what an artifact that draws its own is judged against)."""
    with provide_noise(sample_noise(OTHER_DRAW_SEED, f0.shape[1])):
        out = km.decoder.generator.m_source(f0)
    return (out[0] if isinstance(out, (tuple, list)) else out).detach()


def source_inputs(km, seen: dict) -> list[tuple[str, torch.Tensor]]:
    """What an export may feed the harmonic source in place of its own argument (the upsampled F0,
    transposed), computed from the reference's F0 curve with Kokoro's own code: the curve itself,
    the generator's upsampling of it (`f0_upsamp`), and SineGen's voiced mask (`_f02uv`) of each.
    An export may compute the mask outside the source's scope, before the upsampling or after, or
    hand the source the upsampled F0 in another layout (the packaged int8 file: before and after
    its transpose)."""
    f0 = seen.get("predictor.F0_proj")
    if f0 is None:
        return []
    gen = km.decoder.generator
    f0 = f0.reshape(1, -1)
    up = gen.f0_upsamp(f0[:, None])
    mask = gen.m_source.l_sin_gen._f02uv
    return [("the F0 curve", f0), ("the voiced mask of the F0 curve (SineGen._f02uv)", mask(f0)),
            ("the upsampled F0 (decoder.generator.f0_upsamp)", up),
            ("the voiced mask of the upsampled F0 (f0_upsamp, SineGen._f02uv)", mask(up))]


def run_localize_job(session, job: str, artifact: Path, ref: dict, run_dir: Path, runtime: str = NATIVE,
                     target: str = "local"):
    """The ONNX side of a localization in a child process (a crashing onnxruntime or browser stays
    there), its ONNX runs on `runtime` (`stage_runner`): the reference written beside it, then (job
    result, the job's stage rows or None). A page per run in the browser: a longer limit."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(run_dir / "reference.pt", lambda f: torch.save(ref, f))
    result = stages_job(session, job, dict(artifact=str(artifact), reference_path=str(run_dir / "reference.pt"),
                                           out_dir=str(run_dir), runtime=runtime), run_dir / "job",
                        session.limits.run_s * (2 if runtime == NATIVE else 4), target)
    return result, (torch.load(run_dir / "stages.pt", weights_only=False) if result.ok else None)


def stages_job(session, job: str, kwargs: dict, workdir: Path, timeout: float, target: str = "local"):
    """A localizer's job: in a child process here; for an item that ran on a browser target (a page
    on the user's device), on that target, whose page then runs every stage (web_device.DeviceTarget)."""
    if target != "local" and kwargs.get("runtime", NATIVE) != NATIVE:
        place = session.target_for(target)
        if place.kind == "browser":
            return place.job_or_error(job, kwargs, workdir, timeout)
    return run_job(job, kwargs, workdir, timeout)


def judge_own_noise(local, r32: torch.Tensor, other: torch.Tensor, check) -> dict:
    """A stage that draws its own noise (the source), run locally: judged by what its phase and
    noise do not hide (defects.OWN_NOISE_MEASURES: amplitude envelope, instantaneous frequency,
    harmonic magnitudes), each against the reference's with the same measure of another noise draw
    of the reference as its floor (rel L2, the item's rule on it). It fails when any measure fails:
    its numbers and kind those of the first that fails (else the envelope's), its reason naming the
    failing ones first; a NaN or Inf fails and says so first."""
    value = torch.as_tensor(np.asarray(local)).reshape(-1)
    bad = nonfinite(value)
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731 - frames on the last axis
    measures = {}
    for name, measure in OWN_NOISE_MEASURES.items():
        got, want, floor = measure(value), measure(r32), measure(other)
        m = compare_to_floor(got, floor, want)
        ok, why = check(m)
        shift = frequency_shift(got, want, floor) if name == "instantaneous frequency" else None
        measures[name] = {"rel_l2": m["rel_l2"], "floor_rel_l2": m["floor_rel_l2"], "ok": ok, "why": why,
                          "kind": f"{shift or difference_kind(rows(got), rows(want))} ({name})"}
    failed = [n for n, r in measures.items() if not r["ok"]]
    lead = measures[(failed or ["envelope"])[0]]
    why = "; ".join(f"{n} against another noise draw's: {measures[n]['why']}"
                    for n in failed + [n for n in measures if n not in failed])
    return {"rel_l2": lead["rel_l2"], "floor_rel_l2": lead["floor_rel_l2"], "ok": not failed and not bad,
            "why": bad or (f"outside its floor by {', '.join(failed)}: " if failed else "") + why,
            "kind": lead["kind"], "judged_by": "own noise",
            "measures": {n: {k: r[k] for k in ("rel_l2", "floor_rel_l2", "ok")} for n, r in measures.items()}}


# ---- every defect, ranked by what taking it out alone does to the audio ------------------------

def rank_defects(session, defects: list[dict], rows: dict, ref: dict, run_dir: Path,
                 runtime: str = NATIVE, target: str = "local") -> list[dict]:
    """Each stage whose local error leaves its tolerance, with its kind, its rank and its audio
    effect. Its own error is taken out of its chained output (`without_own_error`) and the
    artifact runs on from there; the same run fed the stage's own chained value gives the audio
    with it, so that both carry the same noise (random ops seeded alike in both copies). The
    defect's effect is how far it moves the audio: the SNR of the audio with it against the audio
    without it (lower: a larger effect); ranked by it, a stage with NaN or Inf first. The audio
    metrics of both against the reference's (no PESQ) are recorded beside it. The runs are on
    `runtime`, as the stages'."""
    audio_tensor = (rows.get("audio") or {}).get("tensor")
    pairs, given = {}, {}
    for e in defects:
        row = rows[e["stage"]]
        raw = np.asarray(row["chained_raw"])
        fixed = in_layout(without_own_error(row["chained"], row["local"], ref["fp32"][e["stage"]],
                                            e["local"].get("judged_by")), raw)
        if row["tensor"] == audio_tensor:  # the stage's output is the audio itself
            pairs[e["stage"]] = (raw.reshape(-1), fixed.reshape(-1))
        else:
            given[e["stage"]] = (row["tensor"], raw, fixed)
    if given:
        pairs.update(run_effects(session, given, run_dir, runtime, target))
    return score_defects(found_defects(defects, rows), pairs, ref["fp32"]["audio"].double().reshape(-1).numpy())


def found_defects(defects: list[dict], rows: dict) -> list[dict]:
    """The defects' table rows as defects.score_defects takes them."""
    return [{"stage": e["stage"], "kind": e["local"]["kind"], "local_rel_l2": e["local"]["rel_l2"],
             "floor_rel_l2": e["local"]["floor_rel_l2"],
             "nonfinite": bool(nonfinite(torch.as_tensor(rows[e["stage"]]["local"])))} for e in defects]


def in_layout(value: np.ndarray, raw: np.ndarray) -> np.ndarray:
    """`value` (the reference's layout) in the artifact's layout: the axis order nearest its own."""
    own = torch.from_numpy(raw.astype(np.float32))
    return min(layouts(value, raw.shape), key=lambda a: rel_l2(a, own)).astype(raw.dtype)


def run_effects(session, given: dict, run_dir: Path, runtime: str = NATIVE, target: str = "local") -> dict:
    """{stage: (audio with its own value fed, audio with its error taken out)}, the artifact run
    in a child process on `runtime` as the stages ran; a stage whose runs fail is left out."""
    atomic_write(run_dir / "given.pt", lambda f: torch.save(given, f))
    result = stages_job(session, "harness.port.onnx_stages:effects_job", dict(out_dir=str(run_dir), runtime=runtime),
                        run_dir / "effects", session.limits.run_s * 4, target)
    return torch.load(run_dir / "effects.pt", weights_only=False) if result.ok else {}


def effects_job(out_dir: str, runtime: str = NATIVE) -> dict:
    """Job function (child process): per stage, the artifact (its random ops seeded) run twice
    on `runtime` with that stage's tensor fed: its own chained value, then the value without its error."""
    with stage_runner(runtime) as run:
        return _effects(Path(out_dir), run)


def _effects(out: Path, run) -> dict:
    job = torch.load(out / "run.pt", weights_only=False)
    given = torch.load(out / "given.pt", weights_only=False)
    seeded = seeded_copy(Path(job["source"]), out / "effects-seeded.onnx")
    pairs, errors = {}, {}
    for stage, (tensor, own, fixed) in given.items():
        try:
            cut, name = given_copy(seeded, out / "given.onnx", tensor, own.dtype)
            pairs[stage] = tuple(np.asarray(run(cut, {**job["feed"], name: v}, [job["audio"]])[job["audio"]])
                                 .reshape(-1) for v in (own, fixed))
        except Exception as e:  # noqa: BLE001 - a stage whose value cannot be fed is left unranked
            errors[stage] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for f in ("given.onnx", "effects-seeded.onnx"):
        (out / f).unlink(missing_ok=True)
    torch.save(pairs, out / "effects.pt")
    return {"errors": errors}


def judge_row(entry: dict, row: dict, r32: torch.Tensor, r64: torch.Tensor, check, stochastic=lambda role: False):
    """Fill `entry["chained"]` and `entry["local"]` (rel L2, its fp32 floor, ok, kind of difference)
    from a stage's row; a role `stochastic(role)` says is noise-dependent passes (the band judges it).
    An angle written -pi where the reference has +pi (an STFT's phase where its imaginary part is
    0) counts as the reference's: which side a rounding-level imaginary part lands on is rounding's
    choice, PyTorch's float32 and float64 disagree on it too (`wrapped` says how many)."""
    for role in ("chained", "local"):
        value = row.get(role)
        if value is None:
            entry[f"{role}_error"] = row.get("local_error", "not run") if role == "local" else "not run"
            continue
        value = torch.as_tensor(value).reshape(-1)
        a32, a64 = r32.reshape(-1).float(), r64.reshape(-1).double()
        if value.numel() != a32.numel() or a64.numel() != a32.numel():
            entry[f"{role}_error"] = f"{value.numel()} values, the reference {a32.numel()} (durations differ upstream)"
            continue
        # an angle on the other side of its branch cut is the same angle: on the float64's side
        (value, wrapped), (a32, _) = unwrapped(value, a64), unwrapped(a32, a64)
        m = compare_to_floor(value, a32, a64)
        ok, why = check(m)
        bad = nonfinite(value, a64)  # a NaN never passes, noise-dependent or not
        noise = stochastic(role) and not bad
        entry[role] = {"rel_l2": m["rel_l2"], "floor_rel_l2": m["floor_rel_l2"], "ok": (ok or noise) and not bad,
                       "why": bad or (why if not noise else "phase/noise dependent: the audio band judges it"),
                       "kind": difference_kind(value.reshape(1, -1), a64.reshape(1, -1)),
                       **({"nonfinite": True} if bad else {}),
                       **({"wrapped": f"{wrapped} of {value.numel()} angles on the other side of their branch cut "
                                      "(-pi for +pi: the same angle), counted as the reference's"}
                          if wrapped else {})}
        if noise and not ok:  # outside the floor, but not judged here: its table word says so, not "ok"
            entry[role]["by_band"] = True
    return entry


def band_rows(session, case_id: str, traces, audio, tol) -> dict:
    """Audio metrics of `audio` (the reference durations forced) against the noise band."""
    band = noise_band(session.model, session.cases[case_id], traces, session_k(session))
    am = audio_metrics(traces.chain["audio"][0].double().numpy(), np.asarray(audio, dtype=np.float64).reshape(-1))
    return judge_band(audio, am, band["band"], tol)


def judge_band(audio, am: dict, bands: dict, tol) -> dict:
    """Each band metric of `audio` (`am`) against its noise band: a NaN or Inf in the audio, or a
    non-finite metric whose band is finite, fails and is said first (`nonfinite` leads the dict)."""
    check = band_comparator(tol)
    out = {}
    bad = nonfinite(torch.as_tensor(np.asarray(audio, dtype=np.float64)).reshape(-1))
    if bad:  # a NaN never passes, and is said first
        out["nonfinite"] = {"value": None, "band": None, "ok": False, "why": f"audio: {bad}"}
    for metric, direction in DIRECTIONS.items():
        value = am.get(metric, math.nan)
        ok, why = check(metric, value, bands[metric], direction)
        if not math.isfinite(value) and all(map(math.isfinite, bands[metric])):
            ok, why = False, f"NaN: {metric} is non-finite (its noise band is finite)"
        out[metric] = {"value": value, "band": bands[metric], "ok": ok, "why": why}
    return out


def row_sub(rows: dict, path: str):
    return rows.get(path, {}).get("subgraph")


def stage_lines(b: dict) -> list[str]:
    """The table of one ONNX localization (harness/port/onnx_steps.localize_modules): what was cut
    (a step, a chain's stage, else a whole model), how its names were read, its noise and
    durations; each module's row; the audio forced; the defects ranked; the repro."""
    durations = None if "forced_durations" not in b else (
        "the artifact's durations differ: the stages after them ran with the reference's durations forced"
        if b["forced_durations"] else "durations as the artifact computes them")
    what = f"step {b['step']}" if "step" in b else f"stage {b['port_stage']!r} of a chain" if "port_stage" in b else None
    about = [x for x in (what, b.get("names"), b.get("noise") and f"noise: {b['noise']}", durations) if x]
    lines = [f"stages inside {Path(b['artifact']).name}" + (f" ({'; '.join(about)})" if about else "") + ":"]
    for e in b["stages"]:
        if not e["mapped"]:
            lines.append(f"  {e['stage']:<34} not mapped: {e['why']}")
        elif e["stage"] == "pred_dur":
            lines.append(f"  {'durations':<34} {e['tokens_differ']} tokens differ (max {e['max_frames_diff']} frames)")
        else:
            c, loc = e.get("chained") or {}, e.get("local") or {}
            verdict = lambda m: "-" if not m else ("OVER" if not m["ok"] else "band" if m.get("by_band") else "ok")  # noqa: E731,E501
            lines.append(f"  {e['stage']:<34} floor {fmt(loc.get('floor_rel_l2') or c.get('floor_rel_l2')):>8}  "
                         f"local {fmt(loc.get('rel_l2')):>8} {verdict(loc):<4} chained {fmt(c.get('rel_l2')):>8} "
                         f"{verdict(c):<4} {loc.get('kind') or c.get('kind', '')}"
                         + (f"; local not run: {e['local_error']}" if e.get("local_error") not in (None, "not run")
                            and not loc else "")
                         + (f"; fed {', '.join(sorted(set(e['fed'].values())))}" if e.get("fed") else "")
                         + (f"; {loc['wrapped'].split(' (')[0]}" if loc.get("wrapped") else "")
                         + (f"; chained: {e['chained_error']}" if e.get("chained_error") else "")
                         + (f"; {e['note']}" if e.get("note") else ""))
    if b.get("forced_audio"):
        lines.append("  audio with the reference durations forced, against the noise band: " + "; ".join(
            v["why"] for v in b["forced_audio"].values()))
    if any((e.get(r) or {}).get("by_band") for e in b["stages"] for r in ("chained", "local")):
        lines.append("  band: outside the floor sample by sample, but phase or noise dependent (after the harmonic "
                     "source's phase): not judged here, the audio's noise band judges it")
    lines.append(f"first stage whose local error leaves its tolerance: {b.get('first_stage', 'none')}")
    if b.get("defects"):
        n = len(b["defects"])
        ranked = any(math.isfinite(d.get("moves_audio_snr_db", math.nan)) for d in b["defects"])
        lines.append(f"{n} defect{'s' if n > 1 else ''} " + ("(ranked by their effect on the audio, each taken out alone):"
                                                             if ranked else "(none ranked by its effect on the audio):"))
        lines += [f"  {d['rank']}. {d['stage']}: {d['kind']}; {effect_text(d)}" for d in b["defects"]]
    if b.get("unmapped"):
        lines.append(f"could not be mapped: {', '.join(b['unmapped'])}")
    if b.get("repro"):
        lines.append(f"repro: {b['repro']}")
    return lines


# ---- repro bundle --------------------------------------------------------------------------------

REPRO = '''"""Repro of one stage of an ONNX artifact: its subgraph fed the reference's inputs.
Needs numpy and onnxruntime only. Exit 1: reproduced; 0: fixed; 2: cannot run here."""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
try:
    import numpy as np
    import onnxruntime as ort
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)
meta = json.loads((here / "meta.json").read_text())
inputs = dict(np.load(here / "inputs.npz"))
expected = np.load(here / "expected.npy").astype(np.float64)
sess = ort.InferenceSession(str(here / "stage.onnx"), providers=["CPUExecutionProvider"])
got = np.asarray(sess.run([meta["output"]], inputs)[0], dtype=np.float64).reshape(expected.shape)
rel = float(np.linalg.norm(got - expected) / np.linalg.norm(expected))
print(f"stage {meta['stage']}: rel_l2 {rel:.3e} against the reference (tolerance {meta['tolerance']:.3e})")
sys.exit(1 if not np.isfinite(rel) or rel > meta["tolerance"] else 0)
'''


def write_repro(out: Path, row: dict, ref: dict, path: str, tol, where: dict | None = None) -> str:
    """The stage's bundle (plumbing.bundle's layout): its subgraph, inputs, float64 expected
    output, meta.json, REPORT.md and a repro.py needing numpy and onnxruntime only; when the stage
    ran in onnxruntime-web (`where`: the job's `ran_on`), also the static page that runs it there
    (harness.port.web_repro)."""
    src = Path(row["subgraph"])
    expected = ref["fp64"][path].double().numpy()
    floor = error_metrics(ref["fp32"][path], ref["fp64"][path])["rel_l2"]
    tolerance = max(tol.rel_l2, tol.floor_multiplier * floor) if not math.isnan(floor) else tol.rel_l2
    local = row.get("local")  # the subgraph's own output on the reference's inputs
    try:
        rel = error_metrics(torch.as_tensor(best_layout(np.asarray(local, np.float32), ref["fp32"][path])),
                            ref["fp64"][path])["rel_l2"]
    except (ValueError, TypeError):  # no local output, or none of the reference's size
        rel = None
    meta = {"stage": path, "output": row["tensor"], "tolerance": tolerance, "rel_l2": rel, "floor_rel_l2": floor}
    report = (f"# {path}: an ONNX stage computes its output outside PyTorch's float32 error\n\n"
              f"The subgraph `stage.onnx` (module `{path}`, output `{row['tensor']}`), fed `inputs.npz`, "
              f"gives relative L2 error {_num(rel)} against the float64 expected output `expected.npy`; "
              f"PyTorch float32's own error is {_num(floor)}, the tolerance {tolerance:.3e}.\n\n"
              "`python repro.py` (numpy and onnxruntime only): exit 1 reproduced, 0 fixed, 2 cannot run here.\n")
    page = {}
    if where and where.get("ort_web"):
        page, section = browser_files(src, src.parent / "inputs.npz", expected, meta, where)
        meta["ran_on"] = {k: where[k] for k in ("ort_web", "browser") if k in where}
        report += section
    write_bundle_dir(out, {"stage.onnx": src, "inputs.npz": src.parent / "inputs.npz",
                           "expected.npy": lambda p: np.save(p, expected), "REPORT.md": report, "repro.py": REPRO,
                           **page}, meta=meta)
    return str(out)


def _num(x) -> str:
    return "n/a" if x is None else f"{x:.3e}"


def localized_on(rec, runtime: str, where: dict | None, log) -> None:
    """Say, in the record and the output, that an item judged on a browser runtime had its stages
    run there too (`where`: the job's `ran_on`, what ran them); nothing for onnxruntime CPU."""
    if runtime == NATIVE or not isinstance(rec.bisect, OnnxStages):
        return
    web, browser = (where or {}).get("ort_web") or {}, (where or {}).get("browser") or {}
    browser_is = (f"the device's browser, {browser.get('user_agent', '?')}" if browser.get("device")
                  else f"Chromium {browser.get('version', '?')}")
    rec.bisect.runtime = f"onnxruntime-web {web.get('version', '?')} {web.get('execution_provider', '?')} ({browser_is})"
    rec.bisect.judged_on = runtime
    rec.bisect.ran_on = where
    rec.bisect.note = (f"localized on {runtime}: the marked model and every stage's subgraph ran in "
                       f"{rec.bisect.runtime}, as the judged run")
    log(rec.bisect.note)

