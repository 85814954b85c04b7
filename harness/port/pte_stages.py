"""Localization inside a user's `.pte` through ExecuTorch's own devtools: the ETRecord the user saved
at export, and an ETDump with intermediate outputs of one run on the case's inputs.

A `.pte` cannot be cut into stages the way an ONNX can (onnx_stages), but ExecuTorch can log the
output of every operator it runs (`_load_for_executorch(..., enable_etdump=True,
debug_buffer_size=...)`), and the ETRecord maps each runtime event through its debug handles to
the graph nodes it came from, whose `nn_module_stack` names the module that ran it. So:

- *Run* (child process): the .pte with ETDump and a debug buffer, read by devtools' `Inspector`
  with the ETRecord; per runtime event its nodes' module stacks and its first output. ExecuTorch's
  own `calculate_numeric_gap` compares the same events with the ETRecord's exported graph run on the
  same inputs: whether the runtime departs from its own graph or computes what was exported.
- *Map*: each module stack entry to a Kokoro module path (torch.export writes some entries relative
  to the calling module, `cnn.1` under `kmodel.text_encoder`; repeated calls carry `@N`, and only a
  module's first call is compared, as the reference captures only that one). A module's boundary is
  its last operator whose output has the size of the module's reference output.
- *Judge*: each boundary against `reference.module_captures` (float32 and float64, teacher-forced on
  the item's inputs): the error against the fp32 floor with the item's tolerance, and the kind of
  difference. The first module, in execution order, whose error leaves its tolerance is named. The
  errors are chained (everything before the module runs in the artifact): a .pte cannot be fed the
  reference's values in the middle.

An XNNPACK (or other) delegate logs only its outputs, not its ops': the modules inside one delegate
call have no boundary of their own, and the rows say so.
"""
from __future__ import annotations

import logging
import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..metrics.tensor import compare_to_floor
from ..plumbing.files import save_tensors
from ..plumbing.jobs import run_job
from ..patches import NOISE_INPUTS
from ..record import PteEtdump, Unlocalized
from ..reference import module_captures
from ..steps import STEP_NAMES, get_step
from ..verdict import comparator
from .differences import difference_kind
from .matching import best_layout
from .onnx_stages import stage_lines
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
et_devtools = deferred_import("executorch.devtools")
et_numerical_comparator = deferred_import("executorch.devtools.inspector.numerical_comparator")
et_portable_lib = deferred_import("executorch.extension.pybindings.portable_lib")

MAX_DEPTH = 3  # module levels below the step's module kept in the table (the first failing one always)
DEBUG_BUFFER_SLACK = 1.5  # the debug buffer: the graph's activations, times this, plus 16 MB
MAX_DEBUG_BUFFER = 6 << 30  # bytes; past it the run would take the machine's memory: a shorter case is asked for
NO_ETRECORD = ("judged whole: no ETRecord (export with `to_edge_transform_and_lower(..., generate_etrecord=True)` "
               "and save `get_etrecord()`; pass it with --etrecord, see docs/own-port.md)")


# ---- which ETRecord ----------------------------------------------------------------------

def etrecord_for(item, specs: list[str]) -> Path | None:
    """The ETRecord of an artifact item: `--etrecord STEP=PATH` for its step, a bare `--etrecord PATH`
    (every .pte), else `<artifact stem>.etrecord` beside the artifact; None when there is none."""
    path = Path(item.path)
    for spec in specs or []:
        step, sep, rest = spec.partition("=")
        if sep and step in (*STEP_NAMES, "e2e"):
            if step == item.step:
                return Path(rest)
        else:
            return Path(spec)
    beside = path.with_suffix(".etrecord")
    return beside if beside.is_file() else None


# ---- the run (child process) -----------------------------------------------------------------

def _activation_bytes(etrecord) -> int:
    """Bytes of every operator output in the ETRecord's edge graph: what the debug buffer must hold."""
    total = 0
    program = etrecord.edge_dialect_program
    graphs = program.values() if isinstance(program, dict) else [program]
    for ep in graphs:
        for node in ep.graph.nodes:
            vals = node.meta.get("val") if node.op == "call_function" else None
            for v in vals if isinstance(vals, (tuple, list)) else [vals]:
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size() if all(isinstance(d, int) for d in v.shape) else 0
    return total


def etdump_job(artifact: str, etrecord: str, inputs_path: str, out_dir: str) -> dict:
    """Job function: run the .pte once with ETDump and intermediate outputs, read them with the
    ETRecord, write one row per runtime operator (module stacks, first output) to events.pt."""
    warnings.filterwarnings("ignore")  # the Inspector warns once per unsupported kwarg of every node
    logging.getLogger("executorch").setLevel(logging.ERROR)
    out = Path(out_dir)
    record = et_devtools.parse_etrecord(etrecord)
    buffer_size = int(_activation_bytes(record) * DEBUG_BUFFER_SLACK) + (16 << 20)
    if buffer_size > MAX_DEBUG_BUFFER:
        raise RuntimeError(f"every operator's output of this program takes {buffer_size / 2**30:.1f} GiB of debug "
                           f"buffer (at most {MAX_DEBUG_BUFFER / 2**30:.0f} GiB): localize on a shorter case")
    inputs = [t.contiguous() for t in torch.load(inputs_path, weights_only=True)]
    module = et_portable_lib._load_for_executorch(artifact, enable_etdump=True, debug_buffer_size=buffer_size)
    module.forward(inputs)
    if not module.has_etdump():
        raise RuntimeError("this ExecuTorch build records no ETDump (ExecuTorchModule.has_etdump() is False)")
    module.write_etdump_result_to_file(str(out / "etdump.etdp"), str(out / "debug.bin"))
    record.update_representative_inputs([inputs])  # calculate_numeric_gap runs the exported graph on these
    inspector = et_devtools.Inspector(etdump_path=str(out / "etdump.etdp"), etrecord=record,
                                      debug_buffer_path=str(out / "debug.bin"))
    rows, seen = [], set()
    delegated_ops = 0
    for block in inspector.event_blocks:
        for event in block.events:
            if event.name in ("Method::init", "Program::load_method", "Method::execute") or event.debug_handles is None:
                continue
            if event.is_delegated_op:  # an op inside a delegate: timed, never its values
                delegated_ops += 1
                continue
            key = getattr(event, "_instruction_id", None)
            key = (block.name, key if key is not None else len(rows))
            if key in seen or not event.debug_data:
                continue
            seen.add(key)
            handles = (event.debug_handles,) if isinstance(event.debug_handles, int) else tuple(event.debug_handles)
            # a delegate call logs its arguments, inputs first: its outputs are the last num_outputs
            data = event.debug_data[-max(event.num_outputs, 1):] if event.name == "DELEGATE_CALL" else event.debug_data
            first = next((d for d in data if isinstance(d, torch.Tensor)), None)
            rows.append({"name": event.name, "ops": list(dict.fromkeys(event.op_types)), "handles": handles,
                         "delegate": event.name == "DELEGATE_CALL", "backend": event.delegate_backend_name,
                         "out": first.detach().clone() if first is not None else None})
    gaps, gap_error = {}, None
    try:
        frame = inspector.calculate_numeric_gap(_relative_l2_comparator())
        for handles, gap in zip(frame["runtime_debug_handle"], frame["gap"]):
            value = gap[0] if isinstance(gap, (list, tuple)) and gap else gap
            for h in (handles,) if isinstance(handles, int) else handles:
                gaps[h] = max(gaps.get(h, -1.0), float(value)) if not math.isnan(value) else gaps.get(h, math.nan)
    except Exception as e:  # noqa: BLE001 - the comparison with the exported graph is a bonus, not the verdict
        gap_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    torch.save({"events": rows, "graph_gaps": gaps, "handles": handle_stacks(record)}, out / "events.pt")
    return {"events": len(rows), "delegate_calls": sum(r["delegate"] for r in rows), "delegated_ops": delegated_ops,
            "debug_buffer_bytes": buffer_size, "graph_gap_error": gap_error}


def handle_stacks(etrecord) -> dict[int, dict]:
    """debug handle -> {"pos": its first node's place in the edge graph, "stacks": the module stacks
    of its nodes}: the graph before partitioning, so a delegate's nodes are there too."""
    program = etrecord.edge_dialect_program
    ep = program.get("forward", next(iter(program.values()))) if isinstance(program, dict) else program
    out: dict[int, dict] = {}
    for pos, node in enumerate(ep.graph.nodes):
        handle = node.meta.get("debug_handle") if node.op == "call_function" else None
        for h in (handle,) if isinstance(handle, int) else (handle or ()):
            entry = out.setdefault(h, {"pos": pos, "stacks": []})
            entry["stacks"].append([(k, *v) for k, v in (node.meta.get("nn_module_stack") or {}).items()])
    return out


def _relative_l2_comparator():
    """ExecuTorch's comparator interface with relative L2 (the harness's metric), NaN where the
    runtime's and the graph's outputs differ in size: the built-in MSE raises there, which ends the
    whole comparison (merged debug handles of an unrolled LSTM pair a 1024- with a 2048-value tensor)."""
    class RelativeL2(et_numerical_comparator.NumericalComparatorBase):
        def element_compare(self, a, b) -> float:
            if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.numel() != b.numel():
                return math.nan
            a, b = a.double().reshape(-1), b.double().reshape(-1)
            norm = float(a.norm())
            return float((a - b).norm()) / (norm or 1.0)

    return RelativeL2()


# ---- mapping runtime events to Kokoro's modules --------------------------------------------------

def _call_index(key: str) -> int:
    m = re.search(r"@(\d+)$", key)
    return int(m.group(1)) if m else 0


def kokoro_chain(stack, kmodel, step_path: str) -> list[tuple[str, int]]:
    """[(Kokoro module path, call index)] of one node's `nn_module_stack`, outermost first.

    An entry's path is tried as it is (without a step wrapper's `kmodel.`), under each module
    resolved so far (innermost first), and under the step's module; a candidate of the same class
    wins, else the first that exists (a patched module keeps its path, not its class)."""
    resolved: list[tuple[str, int]] = []
    for key, path, type_name in stack:
        path = path[len("kmodel."):] if path.startswith("kmodel.") else ("" if path == "kmodel" else path)
        bases = [p for p, _ in reversed(resolved)] + [step_path, ""]
        found = []
        for base in dict.fromkeys(bases):
            cand = ".".join(x for x in (base, path) if x)
            if not cand:
                continue
            try:
                sub = kmodel.get_submodule(cand)
            except AttributeError:
                continue
            found.append((type(sub).__name__ == str(type_name).rsplit(".", 1)[-1], cand))
        exact = [c for same, c in found if same]
        pick = exact[0] if exact else (found[0][1] if found and path else None)
        if pick and (not resolved or resolved[-1][0] != pick):
            resolved.append((pick, _call_index(key)))
    return resolved


def common_chain(chains: list[list[tuple[str, int]]]) -> list[tuple[str, int]]:
    """The modules every chain shares (outermost first)."""
    if not chains:
        return []
    common = chains[0]
    for c in chains[1:]:
        n = 0
        while n < min(len(common), len(c)) and common[n] == c[n]:
            n += 1
        common = common[:n]
    return common


def handle_modules(handles: dict[int, dict], kmodel, step_path: str) -> dict[int, list[tuple[str, int]]]:
    """debug handle -> the modules all its nodes belong to (several nodes share a handle when one
    ATen op was decomposed)."""
    return {h: common_chain([kokoro_chain(s, kmodel, step_path) for s in info["stacks"] if s])
            for h, info in handles.items()}


def boundaries(events: list[dict], handles: dict[int, dict], chains: dict[int, list], sizes: dict[str, int]
               ) -> tuple[dict, dict]:
    """(module -> index of its boundary event, module -> why it has none). A module's boundary is
    the runtime op that computes its last node (in graph order, first call): a portable op's output,
    or a delegate call's when the delegate ends with that node. A delegate that runs the node and
    ops after it hides it: delegates log their outputs, not their ops'."""
    last: dict[str, int] = {}
    for h, chain in chains.items():
        first_call = True
        for path, call in chain:
            first_call = first_call and call == 0
            if first_call and (path not in last or handles[h]["pos"] > handles[last[path]]["pos"]):
                last[path] = h
    found, why = {}, {}
    for path, h in last.items():
        size = sizes.get(path)
        if size is None:
            why[path] = "the reference module outputs no tensor (a packed LSTM gives a PackedSequence)"
            continue
        runs = [i for i, e in enumerate(events) if h in e["handles"]]
        if not runs:
            why[path] = "its last op logged no output in the ETDump"
            continue
        event = events[runs[-1]]
        after = max(handles[x]["pos"] for x in event["handles"] if x in handles)
        if event["delegate"] and after > handles[h]["pos"]:
            why[path] = (f"its last op runs inside a {event['backend']} delegate call with later ops: a delegate "
                         f"logs its outputs only, no per-op intermediate outputs")
        elif event["out"] is None or not event["out"].is_floating_point() or event["out"].numel() != size:
            got = "no tensor" if event["out"] is None else f"{event['out'].numel()} values"
            why[path] = f"its last op ({event['ops'][-1] if event['ops'] else event['name']}) outputs {got}, " \
                        f"the reference module {size}"
        else:
            found[path] = runs[-1]
    return found, why


# ---- the localization ------------------------------------------------------------------------

@dataclass
class PteTarget:
    """What one localization inside a .pte is about: the file and its ETRecord, the case, the Kokoro
    module it computes (`root`: a step's module; None for a port's stage: found from the ETRecord's
    module stacks), the reference's mode, the tolerance, and whether its noise is an input."""

    artifact: Path
    etrecord: Path
    case: str
    root: str | None
    mode: str
    tol: object
    noisy: bool
    label: str  # the step or stage, for the record


def localize_pte(session, item, rec, etrecord, log=print) -> dict:
    """`--bisect` on a failing `--artifact STEP=model.pte` item: fills `rec.bisect` (kind
    `pte-etdump`) and rewrites the record; without an ETRecord, says why nothing is localized."""
    path = Path(getattr(item, "path", "") or item.spec.partition("=")[2])
    error = None
    if item.step == "e2e" or not hasattr(item, "path"):
        error = f"{path.name}: judged whole: localization inside a .pte covers per-step artifacts (--artifact STEP=PATH)"
    elif etrecord is None:
        error = f"{path.name}: {NO_ETRECORD}"
    elif not Path(etrecord).is_file():
        error = f"--etrecord {etrecord}: no such file; {path.name} judged whole"
    if error:
        rec.bisect = Unlocalized(error=error)
        log(error)
        rec.write(session.report_dir / "records")
        return rec.bisect
    inputs = session.traces(item.case).inputs(item.step, item.mode, "float32")
    mapping = list((rec.audit or {}).get("input_mapping", {}).values()) or list(inputs)
    step = get_step(item.step)
    target = PteTarget(path, Path(etrecord), item.case, step.module_path, item.mode,
                       session.profile.for_(item.step, item.backend, item.mode),
                       any(n in step.input_names for n in NOISE_INPUTS), item.step)
    localize_pte_file(session, target, [inputs[n] for n in mapping], rec,
                      session.report_dir / "runs" / item.id / "localize", log)
    rec.write(session.report_dir / "records")
    return rec.bisect


def localize_pte_file(session, target: PteTarget, inputs: list[torch.Tensor], rec, run_dir: Path, log) -> None:
    """One run of the .pte with ETDump (a child process), judged module by module into `rec.bisect`."""
    path = target.artifact
    save_tensors(run_dir / "inputs.pt", inputs)
    log(f"localizing inside {path.name}: ETDump with intermediate outputs, ETRecord {target.etrecord.name} ...")
    result = run_job("harness.port.pte_stages:etdump_job",
                     dict(artifact=str(path.resolve()), etrecord=str(target.etrecord.resolve()),
                          inputs_path=str(run_dir / "inputs.pt"), out_dir=str(run_dir)),
                     run_dir / "job", session.limits.run_s * 2)
    if not result.ok:
        rec.bisect = Unlocalized(error=f"localization inside {path.name} failed ({result.status}): {result.error}")
        log(rec.bisect.error)
        return
    dumped = torch.load(run_dir / "events.pt", weights_only=False)
    rec.bisect = PteEtdump(**judge_events(session, target, dumped, result.value))
    for line in pte_lines(rec.bisect):
        log(line)


def stage_root(handles: dict[int, dict], kmodel) -> str:
    """The Kokoro module a user's .pte computes, from its ETRecord's module stacks: the module of
    the root entry's class under which most of the stacks' paths exist, else Kokoro itself (a
    wrapper whose paths start at `kmodel.`)."""
    stacks = [s for info in handles.values() for s in info["stacks"] if s]
    root_type = next((s[0][2] for s in stacks), "")
    paths = {p for s in stacks for _k, p, _t in s[1:] if p}

    def score(base: str) -> int:
        found = 0
        for p in paths:
            try:
                kmodel.get_submodule(".".join(x for x in (base, p.removeprefix("kmodel.")) if x))
                found += 1
            except AttributeError:
                pass
        return found

    same = [p for p, m in kmodel.named_modules() if p and type(m).__name__ == str(root_type).rsplit(".", 1)[-1]]
    best = max(["", *same], key=score)
    return best


def judge_events(session, target: PteTarget, dumped: dict, summary: dict) -> dict:
    """Each mapped module's boundary against the reference captures: rows in onnx_stages' shape."""
    events, gaps, handles = dumped["events"], dumped["graph_gaps"], dumped["handles"]
    kmodel = session.model.kmodel
    step_path = target.root if target.root is not None else stage_root(handles, kmodel)
    chains = handle_modules(handles, kmodel, step_path)
    paths = list(dict.fromkeys(p for h in sorted(chains, key=lambda h: handles[h]["pos"]) for p, _ in chains[h]))
    shared = _shared_instances(kmodel)
    case, traces = session.cases[target.case], session.traces(target.case)
    captures = _captures(session.model, case, traces, [p for p in paths if p not in shared], module_captures)
    sizes = {p: captures[(f"{p}:out", "float32")].numel() for p in paths if (f"{p}:out", "float32") in captures}
    found, why = boundaries(events, handles, chains, sizes)
    for path in paths:
        if path in shared:
            found.pop(path, None)
            why[path] = (f"one instance with {shared[path]} (Kokoro reuses the module): the reference "
                         f"captures only that one's first call")
    rows = [_judged_row(path, step_path, found, why, events, handles, gaps, captures, target.tol) for path in paths]
    failing = sorted((r for r in rows if r["mapped"] and not r["chained"]["ok"]),
                     key=lambda r: (r["pos"], -r["depth"]))
    first = failing[0]["stage"] if failing else None
    keep = [r for r in rows if r["depth"] <= MAX_DEPTH or (first and (first == r["stage"] or
                                                                      first.startswith(r["stage"] + ".")))]
    keep.sort(key=lambda r: (r.get("pos", math.inf), -r["depth"]))  # graph order, a module after its parts
    b = {"kind": "pte-etdump", "artifact": str(target.artifact), "etrecord": str(target.etrecord),
         "step": target.label, "root": step_path,
         "names": "module paths from the ETRecord's nn_module_stack; errors chained: a .pte cannot be cut",
         "noise": "given as inputs (the case's)" if target.noisy else "none drawn", "forced_durations": False,
         "stages": keep, "unmapped": [r["stage"] for r in keep if not r["mapped"]],
         "events": summary.get("events"), "delegate_calls": summary.get("delegate_calls"),
         "delegated_ops": summary.get("delegated_ops"), "graph_gap_error": summary.get("graph_gap_error"),
         "modules_seen": len(paths), "modules_mapped": len(found)}
    if first:
        b["first_stage"] = first
    if target.mode != "dynamic":
        b["note"] = "module references are the dynamic run's: a static (padded) artifact's sizes differ"
    return b


def _judged_row(path, step_path, found, why, events, handles, gaps, captures, tol) -> dict:
    """One module's row: its boundary event against the reference, or why it has none."""
    depth = path.count(".") - step_path.count(".") if step_path else path.count(".") + 1
    entry = {"stage": path, "depth": depth, "mapped": path in found}
    if path not in found:
        entry.update(what="", why=why.get(path, "not run"))
        return entry
    event = events[found[path]]
    r32, r64 = captures[(f"{path}:out", "float32")], captures[(f"{path}:out", "float64")]
    value = torch.as_tensor(best_layout(event["out"].float().numpy(), r32))
    m = compare_to_floor(value, r32, r64)
    ok, reason = comparator(tol)(m)
    gap = max((gaps.get(h, math.nan) for h in event["handles"]), default=math.nan)
    kind = difference_kind(value.reshape(1, -1), r64.reshape(1, -1))
    if not ok and not math.isnan(gap):
        within = gap <= max(tol.rel_l2, tol.floor_multiplier * m["floor_rel_l2"])
        kind += (f"; the runtime computes its exported graph (rel {gap:.1e}): the defect is in the export"
                 if within else f"; the runtime departs from its own exported graph by rel {gap:.1e}")
    pos = max(handles[x]["pos"] for x in event["handles"] if x in handles)
    entry.update(what=" + ".join(event["ops"][-1:]) or event["name"], event=found[path], pos=pos,
                 chained={"rel_l2": m["rel_l2"], "floor_rel_l2": m["floor_rel_l2"], "ok": ok, "why": reason,
                          "kind": kind}, graph_gap=gap)
    return entry


def _captures(model, case, traces, paths: list[str], module_captures) -> dict:
    """module_captures for every path it can capture: all at once, else one by one (a module that
    never runs forward on a tensor in the reference is left out, not fatal)."""
    refs = [f"{p}:out" for p in paths]
    try:
        return module_captures(model, case, traces, refs)
    except ValueError as e:  # it names the silent ones: the others in one more run
        silent = set(re.findall(r"'([^']+:out)'", str(e)))
        if not silent:
            raise
        return module_captures(model, case, traces, [r for r in refs if r not in silent])


def _shared_instances(kmodel) -> dict[str, str]:
    """Paths of a module instance that Kokoro reuses (TextEncoder's one LeakyReLU in every CNN
    block) -> the path the reference's first call is captured under."""
    first: dict[int, str] = {}
    shared = {}
    for path, module in kmodel.named_modules(remove_duplicate=False):
        if id(module) in first and path != first[id(module)]:
            shared[path] = first[id(module)]
        first.setdefault(id(module), path)
    return shared


def pte_lines(b: dict) -> list[str]:
    """onnx_stages' table (`stage_lines`), said of a .pte: chained errors only, and the first module."""
    if b.get("error"):
        return [b["error"]]
    lines = [line for line in stage_lines(b) if not line.startswith("first stage whose local error")]
    lines.insert(1, f"  ({b['modules_mapped']} of {b['modules_seen']} modules mapped; {b['events']} runtime ops logged "
                    f"their outputs, {b['delegate_calls']} of them delegate calls)")
    lines.append(f"first mapped module whose error leaves its tolerance: {b.get('first_stage', 'none')}")
    if b.get("graph_gap_error"):
        lines.append(f"ExecuTorch's calculate_numeric_gap (runtime vs its exported graph) failed: "
                     f"{b['graph_gap_error']}")
    if b.get("note"):
        lines.append(b["note"])
    return lines
