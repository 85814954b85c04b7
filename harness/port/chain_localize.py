"""`--bisect` on a port item: localization inside every stage of its chain that can be looked into.

- *An ONNX stage*, a whole model (tokens, style, speed -> audio: a one-stage port, `--artifact
  e2e=PATH`) or a chain's (Kokoro tensors in and out): one localizer (onnx_steps.localize_modules),
  as for one step's ONNX. The Kokoro modules its node names reach (onnx_steps' placement over the
  whole model's modules) with parameters, down to the generator's resblocks, each judged chained
  (the stage fed the reference's values at its boundary) and locally (its subgraph fed the
  reference's inputs of the module); durations inside forced; every defect ranked by its effect on
  the audio when the stage outputs it. A one-stage port's localization is the record's `bisect`
  (kind `onnx-stages`).
- *A chain's `.pte` stage* with its ETRecord (the stage's `etrecord:` field, or `<stem>.etrecord`
  beside it): one run with ETDump fed the reference's values at its boundary, each Kokoro module its
  ETRecord's module stacks reach judged chained inside it (pte_stages.localize_pte_file).
- *Anything else is judged whole*, one line each saying why: a `.pte` without an ETRecord, a Core ML package or
  compiled library (no intermediate values), a harness step (its backend's item is localized), a
  bucketed stage (module references exist for the exact lengths only).

A stage run on onnxruntime-web is localized there too (onnx_stages.stage_runner). With more
than one stage, `bisect` is `{"kind": "port-chain", "stages": {stage: its localization}}`, each
stage's bundle in its own directory, and the reason lists the defects found inside every stage,
each named `stage/module`.
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import onnx

from ..backends.prebuilt import describe, kind_of
from ..patches import NOISE_INPUTS
from ..record import OnnxStages, PortChain, PteEtdump, Unlocalized
from .noise import noise_inside
from .onnx_graph import draws_noise
from .onnx_stages import stage_lines
from .onnx_steps import localize_modules, model_modules, reached, step_node_paths, step_roots
from .portfile import Port, StageSpec, open_port
from .pte_stages import NO_ETRECORD, PteTarget, localize_pte_file, pte_lines
from .tensors import reference, to_artifact

WHOLE_MODEL_INPUTS = {"input_ids", "ref_s", "speed"}  # a stage fed only these computes the whole model


def localize_item(session, item, rec, log=print) -> None:
    """Localize inside each stage of a failing port item (harness.pipeline's `localize`); a
    one-stage port's localization is the record's `bisect` itself. Rewrites the record."""
    port = open_port(item.spec, item.runtime)
    modules = functools.cache(lambda: model_modules(session.model, session.traces(item.case)))  # one hooked run
    found = {}
    for stage in port.stages:
        sub = SimpleNamespace(bisect=None, reason="")  # what one stage's localization fills
        say = log if len(port.stages) == 1 else (lambda line, name=stage.name: log(f"[{name}] {line}"))
        localize_stage(session, item, port, stage, sub, say, modules)
        found[stage.name] = sub
    if len(port.stages) == 1:
        (sub,) = found.values()
        rec.bisect, reason = sub.bisect, sub.reason
    else:
        rec.bisect = PortChain(port=port.name, stages={n: s.bisect for n, s in found.items()})
        defects = chain_defects(rec.bisect)
        rec.bisect.defects = defects
        reason = (f"{len(defects)} defect{'s' if len(defects) > 1 else ''} inside its stages: " + "; ".join(
            f"{d['stage']}/{d['module']} ({d['kind']})" for d in defects)) if defects else ""
        repro = next((b["repro"] for b in rec.bisect.stages.values() if b.get("repro")), None)
        if repro:
            rec.bisect.repro = repro  # the first stage's bundle, where the dashboard looks
        for line in chain_summary(rec.bisect):
            log(line)
    if reason:
        rec.reason = (rec.reason + "; " if rec.reason else "") + reason
    rec.write(session.report_dir / "records")


def localize_stage(session, item, port: Port, stage: StageSpec, rec, log, modules) -> None:
    """One stage's localization into `rec.bisect` (and its defects into `rec.reason`), or one
    line saying why the stage is judged whole; `modules()`: the whole model's (model_modules)."""
    chain = len(port.stages) > 1
    why = judged_whole(port, stage)
    if why:
        rec.bisect = Unlocalized(error=why)
        log(why)
        return
    path = stage.file_for(port.root)
    tol = session.profile.for_(stage.precision if stage.precision != "float32" else "port", item.backend, item.mode)
    run_dir = session.report_dir / "runs" / item.id / "localize"
    if kind_of(path) == "executorch":
        localize_pte_stage(session, item, stage, port.root, rec, tol, run_dir / stage.name, log)
    else:
        localize_port_stage(session, item, port, stage, path, modules(), rec, tol,
                            run_dir / stage.name if chain else run_dir, log)


def whole_model(stage: StageSpec) -> bool:
    return {r.tensor for r in stage.inputs.values()} <= WHOLE_MODEL_INPUTS and \
        "audio" in {r.tensor for r in stage.outputs.values()}


def judged_whole(port: Port, stage: StageSpec) -> str | None:
    """Why a stage is not looked into, or None."""
    if stage.step is not None:
        return (f"stage {stage.name!r} runs the harness step {stage.step!r}: judged whole here (`--bisect` on "
                f"that step's backend item localizes inside it)")
    path = port.root / stage.artifact
    kind = kind_of(path)
    if kind == "executorch" and not stage.buckets:
        return None if stage.etrecord_for(port.root) else (
            f"stage {stage.name!r} ({path.name}): not localized: {NO_ETRECORD.removeprefix('judged whole: ')}; "
            f"give it as the stage's field `etrecord:` or as {path.with_suffix('.etrecord').name} beside the .pte: "
            f"judged whole")
    if kind not in ("onnx", "executorch"):
        return (f"stage {stage.name!r} ({path.name}): a {kind} artifact exposes no intermediate values to the "
                f"harness: judged whole")
    if stage.buckets:
        return (f"stage {stage.name!r} ({path.name}): bucketed; module references exist for the exact lengths "
                f"only: judged whole")
    return None


def localize_port_stage(session, item, port: Port, stage: StageSpec, path: Path, ran: dict, rec, tol,
                        run_dir: Path, log) -> dict:
    """An ONNX stage fed the reference's tensors at its boundary (a whole model: tokens, style,
    speed): the Kokoro modules of `ran` (model_modules) its node names reach, each judged chained
    and locally by the one ONNX localizer (onnx_steps.localize_modules): durations inside forced
    when they differ from the reference's, so the modules after them are on the reference's
    frames, as the chain judged the stage; every defect ranked by its effect on the audio when the
    stage outputs it. A chain's stage is named in the record (`port_stage`); a one-stage port's
    whole model is the record's `bisect` as the whole file's."""
    traces = session.traces(item.case)
    roots = step_roots(ran["order"])
    model = onnx.load(str(path), load_external_data=False)
    place, _ = step_node_paths(model, ran["paths"], roots)
    feed = {p.name: value.numpy() for p, value in boundary_feed(stage, path, traces)}
    audio = next((name for name, r in stage.outputs.items() if r.tensor == "audio"), None)
    if len(port.stages) == 1 and whole_model(stage):
        where = {"what": "the whole model", "repro": f"{item.case}-{path.stem}"}
    else:  # durations a chain's stage outputs are the next stage's input, forced there by the chain
        where = {"port_stage": stage.name, "what": f"stage {stage.name!r}", "repro": f"{item.id}/{stage.name}",
                 "durations": not any(r.tensor in ("pred_dur", "duration") for r in stage.outputs.values())}
    # noise would arise inside it and its graph draws none (whatever the port says for its verdict: a whole
    # model's is judged by the noise band): it computes the zero-noise values, judged against those captures
    quiet = noise_inside(stage) and not draws_noise(model)
    return localize_modules(session, path, item.case, reached(ran, map(place, model.graph.node)), feed, rec,
                            tol, run_dir, {**where, "roots": roots, "audio": audio}, log=log, runtime=stage.runtime,
                            zero_noise=quiet)


def localize_pte_stage(session, item, stage: StageSpec, root: Path, rec, tol, run_dir: Path, log) -> None:
    """A chain's .pte stage fed the reference's tensors at its boundary, one run with ETDump: each
    Kokoro module its ETRecord's module stacks reach, judged chained inside the stage
    (pte_stages.localize_pte_file; the Kokoro module it computes is found from those stacks)."""
    traces = session.traces(item.case)
    feed = [value for _p, value in boundary_feed(stage, stage.file_for(root), traces)]
    target = PteTarget(stage.file_for(root), stage.etrecord_for(root), item.case, None, "dynamic", tol,
                       any(r.tensor in NOISE_INPUTS for r in stage.inputs.values()), stage.name)
    localize_pte_file(session, target, feed, rec, run_dir, log)


def boundary_feed(stage: StageSpec, path: Path, traces) -> list:
    """[(artifact input, the reference's float32 value of the Kokoro tensor the port maps to it)],
    in the artifact's order, in its rank and dtype: a stage fed the reference at its boundary."""
    ins, _ = describe(path)
    feed = []
    for i, p in enumerate(ins):  # by name, else by position (a .pte's inputs have no names)
        ref = stage.inputs.get(p.name) or list(stage.inputs.values())[i]
        feed.append((p, to_artifact(reference(ref.tensor, traces, "float32"), p, ref.dtype)))
    return feed


# ---- the chain's findings --------------------------------------------------------------------------

def stage_defects(b: dict) -> list[tuple[str, str]]:
    """(module, kind) of every defect one stage's localization found: its ranked defects, or each
    module whose local error leaves its tolerance (the innermost: a block holding a failing module
    fails with it) and whose chained value does not hold it (that would be the cut's)."""
    if b.get("defects"):
        return [(d["stage"], d["kind"]) for d in b["defects"]]
    if isinstance(b, PteEtdump):  # chained errors: the first failing module; those after it accumulate
        first = next((e for e in b.get("stages") or () if e["stage"] == b.get("first_stage")), None)
        return [(first["stage"], first["chained"]["kind"])] if first else []
    failing = [e for e in b.get("stages") or () if e.get("mapped") and not (e.get("local") or {"ok": True})["ok"]
               and "fed otherwise" not in e.get("note", "")]
    names = {e["stage"] for e in failing}
    return [(e["stage"], e["local"]["kind"]) for e in failing
            if not any(n.startswith(e["stage"] + ".") for n in names)]


def chain_defects(b: dict) -> list[dict]:
    return [{"stage": name, "module": module, "kind": kind}
            for name, sb in b["stages"].items() for module, kind in stage_defects(sb or {})]


def chain_summary(b: dict) -> list[str]:
    """The chain's last lines: each stage localized or why not, then the defects."""
    lines = [f"localized inside the chain {b.get('port', '')!r}:"]
    for name, sb in b["stages"].items():
        sb = sb or {}
        lines.append(f"  {name:<16} " + (sb["error"] if "error" in sb else
                                         f"first stage whose local error leaves its tolerance: "
                                         f"{sb.get('first_stage', 'none')}"
                                         + (f"; repro: {sb['repro']}" if sb.get("repro") else "")))
    if b.get("defects"):
        lines.append("defects: " + "; ".join(f"{d['stage']}/{d['module']} ({d['kind']})" for d in b["defects"]))
    return lines


def chain_lines(b: dict) -> list[str]:
    """A chain's localization under its item (report.format_bisect): each stage's table, then the summary."""
    lines = []
    for name, sb in b["stages"].items():
        sb = sb or {}
        if "stages" in sb:
            lines.append(f"[{name}]")
            lines += stage_lines(sb) if isinstance(sb, OnnxStages) else pte_lines(sb)
    return lines + chain_summary(b)
