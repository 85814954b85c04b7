"""`--artifact STEP=PATH`: judge an artifact a user already has against the references of a step.

A thin adapter over the prebuilt backend (harness/backends/prebuilt.py): the artifact is a backend
whose compile is a copy of the user's file, run through `Session.run_artifact` like every backend
(child process, records, history). This module only maps the step's inputs onto the artifact's
declared ones, by name (else by position) with shapes checked. A whole-model file (`e2e=PATH`)
and port files go through harness/port instead (a one-stage port and a chain of stages).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .backends.prebuilt import KINDS, ArtifactMismatch, Port, kind_of, run_artifact  # noqa: F401
from .backends.prebuilt import NATIVE, PrebuiltBackend, describe as describe_ports, display_name, runtimes_for
from .patches import canonical
from .port.onnx_steps import localize_artifact_item
from .port.pte_stages import etrecord_for, localize_pte
from .record import Audit, backend_label, item_id
from .runner import Item, Resolved
from .steps import STEP_NAMES, get_step
from .verdict import Verdict
from .plumbing.errors import UsageError


@dataclass(frozen=True)
class ArtifactItem:
    """A (case, step, artifact, mode) item: what `--artifact STEP=PATH` adds to a run."""

    case: str
    step: str
    path: str
    mode: str
    runtime: str = NATIVE  # `--artifact-runtime`: native, or onnxruntime-web for an ONNX (ort-web-wasm, ...)
    target: str = "local"  # a browser target (a page on the user's device) for a browser runtime

    @property
    def backend(self) -> str:
        return display_name(self.path, self.runtime)

    @property
    def id(self) -> str:
        return item_id(self.case, self.step, backend_label(self.backend, self.target), self.mode)

    # harness.pipeline: how this kind of item runs and is localized
    def run(self, session):
        return check_artifact(session, self)

    def localizable(self, record, how) -> bool:
        return record.verdict.value == "fail"

    def localize(self, session, record, how, log) -> None:
        """Inside a .pte through ExecuTorch's ETRecord and ETDump; inside an ONNX stage by stage;
        any other format is judged whole, with the reason in the record."""
        if self.path.lower().endswith(".pte"):
            localize_pte(session, self, record, etrecord_for(self, list(how.etrecords)), log=log)
        else:
            localize_artifact_item(session, self, record, log=log, runtime=self.runtime)


def parse_spec(spec: str) -> tuple[str, str]:
    """"STEP=PATH" -> (step, path), checking both."""
    step, sep, path = spec.partition("=")
    if not sep or not step or not path:
        raise UsageError(f"--artifact {spec!r}: expected STEP=PATH, e.g. decoder=kokoro_decoder.onnx")
    if step not in STEP_NAMES:
        raise UsageError(f"--artifact {spec!r}: unknown step {step!r}; steps: {', '.join(STEP_NAMES)}, or e2e "
                         f"for a whole-model file (another cut: a port file, --port)")
    if not Path(path).exists():
        raise FileNotFoundError(f"--artifact {spec!r}: {path} does not exist")
    kind_of(path)
    return step, path


def describe(path: str | Path) -> tuple[list[Port], int | None]:
    """(declared inputs, number of outputs or None) of an artifact, without running it."""
    ins, outs = describe_ports(path)
    return ins, None if outs is None else len(outs)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def map_inputs(ports: list[Port], inputs: dict, where: str = "") -> list[str]:
    """The step input name for each artifact input, by name (exact, then case- and punctuation-
    insensitive), else by position when the counts agree; shapes checked where declared."""
    names = list(inputs)
    if len(ports) != len(names):
        raise ArtifactMismatch(
            f"{where}the artifact takes {len(ports)} inputs {[p.name or f'#{i}' for i, p in enumerate(ports)]}, "
            f"the step gives {len(names)} {names}")
    by_norm = {_norm(n): n for n in names}
    mapped = [p.name if p.name in inputs else by_norm.get(_norm(p.name)) if p.name else None for p in ports]
    if None in mapped or len(set(mapped)) != len(mapped):
        mapped = names  # positional: the only rule left when names are absent or foreign
    for port, name in zip(ports, mapped):
        shape = tuple(inputs[name].shape)
        if port.shape is None:
            continue
        fits = len(port.shape) == len(shape) and all(not isinstance(a, int) or a in (b, -1)
                                                       for a, b in zip(port.shape, shape))
        if not fits:
            label = port.name or f"#{ports.index(port)}"
            raise ArtifactMismatch(f"{where}artifact input {label!r} has shape {list(port.shape)}, the step's "
                                   f"{name!r} has {list(shape)}")
    return mapped


# ---- one item -----------------------------------------------------------------------------

def check_artifact(session, item: ArtifactItem):
    """Judge `item.path` against the references of its step: a Record like any backend's, the file
    made ready by the one prebuilt sequence (`Session.prebuilt`) and run in a child process."""
    backend = PrebuiltBackend(item.path, item.runtime)
    rec = session.new_record(item, list(canonical(session.extra_patches)), backend)
    rec.audit = Audit(artifact=str(backend.path), kind=backend.kind)
    ready = session.prebuilt(item.path, rec, session.report_dir / "runs" / item.id, runtime=item.runtime)
    if ready is None:
        return session.finish(rec)
    traces = session.traces(item.case)
    step = get_step(item.step)
    try:
        mapped = _map_for_mode(session, traces, item, ready.inputs)
    except ArtifactMismatch as e:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, f"artifact does not fit step {item.step!r}: {e}"
        return session.finish(rec)
    if mapped is None:
        other = "static" if item.mode == "dynamic" else "dynamic"
        rec.verdict, rec.reason = Verdict.SKIPPED, f"the artifact's input shapes fit the {other} mode, not {item.mode}"
        return session.finish(rec)
    if ready.outputs is not None and len(ready.outputs) != len(step.output_names):
        rec.verdict = Verdict.RUN_ERROR
        rec.reason = (f"artifact does not fit step {item.step!r}: {len(ready.outputs)} outputs, the step has "
                      f"{step.output_names}")
        return session.finish(rec)
    rec.audit.input_mapping = dict(zip([p.name or f"#{i}" for i, p in enumerate(ready.inputs)], mapped))
    inputs = traces.inputs(item.step, item.mode, "float32")
    outputs = session.run_artifact(backend, ready.path, [inputs[n] for n in mapped], rec, item.id)
    if outputs is None:
        return session.finish(rec)
    outputs = [o.float() if o.is_floating_point() else o for o in outputs]
    resolved = Resolved(Item(item.case, item.step, item.backend, item.mode), step, session.cases[item.case], traces,
                        backend, rec.patches)
    return session.finish(session.judge(rec, resolved, outputs))


def _map_for_mode(session, traces, item: ArtifactItem, ports: list[Port]) -> list[str] | None:
    """The mapping for the item's mode; None when only the other mode's shapes fit."""
    where = f"case {item.case!r}, {item.mode}: "
    try:
        return map_inputs(ports, traces.inputs(item.step, item.mode, "float32"), where)
    except ArtifactMismatch as mismatch:
        other = "static" if item.mode == "dynamic" else "dynamic"
        try:
            map_inputs(ports, traces.inputs(item.step, other, "float32"))
        except ArtifactMismatch:
            raise mismatch from None
        return None


def artifact_items(session, specs: list[str], modes, runtimes=(NATIVE,)) -> list[ArtifactItem]:
    """Items of `--artifact STEP=PATH`: per case, mode and runtime (`--artifact-runtime`) that runs it."""
    items = []
    if not specs:
        return items
    device = session.target if session.target_for(session.target).kind == "browser" else "local"
    for spec in specs:
        step, path = parse_spec(spec)
        items += [ArtifactItem(c, step, path, m, r, device if r != NATIVE else "local")
                  for r in runtimes_for(spec, path, runtimes) for c in session.cases for m in modes]
    return items
