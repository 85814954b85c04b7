"""Run a port on one case and judge it stage by stage: one Record.

Each stage is a prebuilt backend (harness/backends/prebuilt.py): its artifact is "compiled" by a
copy into the cache and run in a child process like every backend. Each stage is judged twice:
*locally* (fed the reference's tensors at its boundary) and *chained* (fed the previous stages'
outputs, with the harness's host glue between them: durations -> alignment -> aligned features),
as the app runs it. Per stage: the local error against its fp32 floor, the chained error, the kind
of difference; durations where a stage outputs them; the audio of the last stage against the
noise band when the stage draws its own noise. The reason names every stage whose *local* error
leaves its floor, in chain order: a defect of its own, not the error the chain accumulated. A value
that is NaN or Inf where the reference is finite fails its row under every noise rule.

A user's host glue (`glue:` in the port file) is judged like a stage, row `glue:<tensor>`: fed the
reference's values (local) and the chain's (chained). A bucketed stage (`buckets:`) gets its
inputs padded to the bucket that fits (the harness's padding rules: harness.steps' pad values,
the bucket's own prefix of the case's noise) and its outputs trimmed to the valid length.

A stage may name a harness step (`step:`) instead of an artifact: it is exported and compiled for
the item's backend through the session's cache (`Session.execute`, `HarnessSteps`). The `e2e` item
is such a port (harness/data/ports/e2e.yaml, harness/e2e.py): one runner for both.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from . import tensors
from .defects import defects_reason, score_defects, without_own_error
from .tensors import to_artifact
from .differences import MAX_SHIFT, difference_kind, nonfinite  # noqa: F401 (the chain's judges use them)
from .durations import FoundDurations, compare_durations, forced_output, found_durations, run_with_durations
from .noise import DIRECTIONS, noise_band, noise_inside, session_k, zero_noise_reference  # noqa: F401
from .portfile import BUCKET_UNITS, HOST_GLUE, Port, PortError, StageSpec, open_port, resolve_glue

from ..backends.prebuilt import NATIVE, display_name, runtimes_for
from ..metrics.audio import audio_metrics, write_wav
from ..metrics.tensor import compare_to_floor, error_metrics
from ..model import SAMPLE_RATE, SAMPLES_PER_FRAME
from ..record import (Audit, Judged, NoiseBand, Record, StageRow, ZeroNoise, compiled_not_run, item_id, real_time,
                      versions)
from ..reference import (CASE_INPUTS, NEUTRAL_PATCHES, REFERENCE_PATCHES, BoundaryError, module_captures,
                         stage_reference)
from ..steps import STEPS, get_step
from ..verdict import Verdict, apply_float16_floor, audio_comparator, band_comparator, comparator
from ..plumbing.errors import UnknownName, UsageError


@dataclass(frozen=True)
class PortItem:
    """(case, port, mode): ids `case-port:<name>-<backend>-mode` (or `case-e2e-artifact-...` for a
    whole-model file), selectable with -k."""

    case: str
    spec: str  # the port file, or e2e=PATH for a whole-model artifact
    mode: str = "dynamic"
    error: str = ""  # a port that failed validation: the item reports it (nothing else is lost)
    label: str = ""  # port name (or whole-model artifact's backend name)
    runtime: str = NATIVE  # a whole-model file's `--artifact-runtime` (a port file names its stages' own)

    @property
    def whole_model(self) -> bool:
        return self.spec.startswith("e2e=")

    @property
    def step(self) -> str:
        return "e2e" if self.whole_model else f"port:{self.label}"

    @property
    def backend(self) -> str:
        return display_name(self.spec[4:], self.runtime) if self.whole_model else "port"

    @property
    def id(self) -> str:
        return item_id(self.case, self.step, self.backend, self.mode)

    # harness.pipeline: how this kind of item runs and is localized
    def run(self, session):
        return run_port_item(session, self)

    def localizable(self, record, how) -> bool:
        return record.verdict.value == "fail"

    def localize(self, session, record, how, log) -> None:
        from .chain_localize import localize_item  # a cycle: it feeds the stages as this module does

        localize_item(session, self, record, log=log)  # inside each stage it can look into; repro bundles


def port_items(session, specs: list[str], modes=("dynamic",), runtimes=(NATIVE,)) -> list[PortItem]:
    """Items of the ports given (`--port FILE`, `--artifact e2e=PATH`, the latter once per runtime
    of `--artifact-runtime` that runs it); a port that does not validate gives items that report its
    error instead of stopping the run."""
    items = []
    for spec in specs:
        whole = spec.startswith("e2e=")
        for runtime in runtimes_for(spec, spec[4:], runtimes) if whole else [NATIVE]:
            try:
                port = open_port(spec, runtime)
                label, error = port.name, ""
            except (PortError, ValueError, FileNotFoundError) as e:
                label, error = Path(spec.partition("=")[2] if whole else spec).stem, str(e)
            # one item per case: a port runs the lengths its artifacts take (buckets come from the port file)
            items += [PortItem(c, spec, "dynamic", error, label, runtime) for c in session.cases]
    return items


# ---- running ------------------------------------------------------------------------------------

def run_port_item(session, item: PortItem):
    """Run and judge a port item; the record is written like any other."""

    rec = Record(item.case, item.step, item.backend, item.mode, Verdict.SKIPPED,
                 model={"name": session.model.name, "digest": session.model.digest, "source": session.model.source})

    rec.versions = versions(None)
    if item.error:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, item.error
        return session.finish(rec)
    try:
        port = open_port(item.spec, item.runtime)
    except (PortError, ValueError, FileNotFoundError) as e:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, str(e)
        return session.finish(rec)
    rec.audit.port = port_audit(port)
    try:
        run_chain(session, port, item, rec)
    except PortError as e:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, f"{port.source}: {e}"
    return session.finish(rec)


def port_audit(port: Port) -> dict:
    """What the record says about the port it ran: its stages and their mapping."""
    return {"name": port.name, "source": port.source,
            "stages": [{"name": s.name, "artifact": s.artifact, **({"step": s.step} if s.step else {}),
                        "precision": s.precision, "noise": s.noise, "runtime": s.runtime,
                        **({"noise_found": True} if s.name in getattr(port, "found_noise", ()) else {}),
                        "inputs": {k: v.tensor for k, v in s.inputs.items()},
                        "outputs": {k: v.tensor for k, v in s.outputs.items()}} for s in port.stages]}


@dataclass(frozen=True)
class HarnessSteps:
    """What a `step:` stage runs on: the item's backend and patches (export and compile through
    the session's cache, as every item), and whether its buckets apply (static mode) or it runs
    the exact lengths (dynamic mode: isolates the backend from the padding rewrite)."""

    backend: object  # harness.backends.Backend
    patches: list[str]
    static: bool


def run_chain(session, port: Port, item, rec, steps: HarnessSteps | None = None, end=None,
              profile_step: str = "port", references: dict | None = None) -> None:
    """Run every stage locally and chained, one row per stage in `rec.stages`, then `end` (default
    `judge_end`) gives the verdict from the chained values (and the last stage's local ones);
    `profile_step`: the tolerance profile's step for the stage rows; `references`: {tensor:
    {"float32": ..., "float64": ...}} judged against instead of the plain reference (a backend's
    semantics-changing patches make their own variant, harness.reference.synthesizer_reference)."""
    _Chain(session, port, item, rec, steps, profile_step, references).run(end or judge_end)


class _Chain:
    """One run of a port's chain: what the stages share while it runs (the chained values, the
    user's glue and which of it was judged, the rows whose local error leaves their floor, the
    app's own runs, the stages only compiled here). `run` reads as the chain runs; a stage's
    pieces (glue rows, local and chained runs, its row) are methods."""

    def __init__(self, session, port: Port, item, rec, steps, profile_step: str, references) -> None:
        self.session, self.port, self.item, self.rec, self.steps = session, port, item, rec, steps
        self.profile_step, self.references = profile_step, references
        self.traces = session.traces(item.case)
        self.case = session.cases[item.case]
        self.chained: dict[str, torch.Tensor] = {}  # what the app's stages produced so far (plus host glue)
        self.defects: list[tuple[str, str, dict]] = []  # (stage, tensor, local metrics) leaving the floor
        self.judged_glue: set[tuple[str, str]] = set()
        self.app_runs: list[str] = []  # the timing tags of the runs the app makes (each stage's chained run)
        self.local_out: dict = {}
        self.compiled_only: list[tuple[str, str]] = []  # stages compiled that this target cannot run
        self.user: dict = {}
        self.ran: dict[str, dict] = {}  # per stage: what it was fed and gave, to run the chain on without its defect
        self.ranked: list[dict] = []  # with two defects or more: each one's effect on the audio (rank_chain_defects)

    def run(self, end) -> None:
        self._capture_cuts()
        try:
            self.user = {name: UserGlue(spec, resolve_glue(spec, self.port.root))
                         for name, spec in self.port.spec.glue.items()}
        except UsageError as e:
            raise PortError(f"field 'glue': {e}") from None
        for i, stage in enumerate(self.port.stages):
            if stage.step is not None and self.steps is None:
                raise PortError(f"stage {stage.name!r}, field 'step': a harness step runs on a backend; a port of "
                                f"prebuilt artifacts names an `artifact:` per stage")
            if not self._stage(i, stage):
                return
        if self.compiled_only:
            self.rec.verdict = Verdict.SKIPPED
            self.rec.reason = (f"{self.compiled_only[0][1]}; every stage compiled: "
                               + ", ".join(name for name, _ in self.compiled_only))
            return
        if "audio" in self.chained:  # the app's run time: each stage's chained run, for the audio it made
            self.rec.real_time = real_time(sum(self.rec.timings.get(f"{tag}run_s", 0.0) for tag in self.app_runs),
                                           self.chained["audio"].shape[-1] / SAMPLE_RATE)
        end(self.session, self.port, self.item, self.rec, self.chained, self.traces, self.case, local=self.local_out)
        if len({d[0] for d in self.defects}) > 1 and "audio" in self.chained and self.rec.verdict is Verdict.FAIL:
            self.ranked = rank_chain_defects(self)
        self._reason()

    def _capture_cuts(self) -> None:
        """The port's cuts inside modules: hooks on one reference run per dtype, cached."""
        refs = tensors.module_refs(r.tensor for s in self.port.stages
                                   for r in (*s.inputs.values(), *s.outputs.values()))
        if refs:
            try:
                module_captures(self.session.model, self.case, self.traces, refs)
            except UsageError as e:
                raise PortError(str(e)) from None

    def _run_stage(self, stage, role: str, valid, meta: dict, rec=None):
        """run_stage on the stage (or on its copy that finds its durations)."""
        return lambda s, values: run_stage(self.session, self.port, s or stage, values, rec or self.rec, self.item,
                                           role, self.traces, valid, meta, self.steps)

    def chained_run(self, stage, values: dict, own: dict, found, meta: dict, role: str = "chained", rec=None):
        """The stage fed the chain's `values` through the host glue (its own, the user's, the
        harness's), its durations found and forced as in any run: (outputs or None, durations)."""
        traces = self.traces
        chain_in = {ref.tensor: own[ref.tensor](glue_view(values, traces, self.user)) if ref.tensor in own
                    else glue(ref.tensor, values, traces, self.user) for ref in stage.inputs.values()}
        valid = valid_lengths(traces, values, self.user) if stage.buckets else None
        return run_with_durations(self._run_stage(stage, role, valid, meta, rec), found, chain_in, traces)

    def _stage(self, i: int, stage) -> bool:
        """One stage: its glue's rows, its local run, its chained run, its row. False: the chain
        stops here (the stage's verdict is the item's)."""
        traces = self.traces
        if self.compiled_only:  # converting only: each stage on the reference's inputs, no glue, no chained run
            out = run_stage(self.session, self.port, stage, {r.tensor: boundary(r.tensor, traces)
                                                             for r in stage.inputs.values()},
                            self.rec, self.item, "local", traces, valid_lengths(traces) if stage.buckets else None,
                            {}, self.steps)
            if out is None and not compiled_not_run(self.rec):
                return False  # a stage that does not convert: that is the verdict
            self.compiled_only.append((stage.name, self.rec.reason))
            return True
        # float16: the port's tolerance against the float16 floor (judge_tensor); int8: its own entry
        tol = self.session.profile.for_(stage.precision if stage.precision not in ("float32", "float16")
                                        else self.profile_step, self.item.backend, self.item.mode)
        own, glued = self._glue_rows(stage, tol)
        local_in = {ref.tensor: boundary(ref.tensor, traces) for ref in stage.inputs.values()}
        meta: dict = {}
        found = stage_durations(self.port, stage, self.session.report_dir / "runs" / self.item.id / "durations")
        self.local_out, durations = run_with_durations(
            self._run_stage(stage, "local", valid_lengths(traces) if stage.buckets else None, meta), found, local_in,
            traces)
        durations = {"local": durations} if durations else {}
        if self.local_out is None and compiled_not_run(self.rec):  # a Core ML chain off macOS: convert every stage
            self.compiled_only.append((stage.name, self.rec.reason))
            return True
        if self.local_out is None:
            return False
        if i == 0 and not glued:
            chained_out = self.local_out
            self.app_runs.append(stage_tag(self.port, stage, "local"))
        else:
            chained_out, chained_dur = self.chained_run(stage, self.chained, own, found, meta)
            if chained_dur:
                durations["chained"] = chained_dur
            if chained_out is None:
                return False
            self.app_runs.append(stage_tag(self.port, stage, "chained"))
        self.ran[stage.name] = {"index": i, "before": dict(self.chained), "own": own, "found": found,
                                "local": self.local_out, "chained": chained_out, "reference": {}}
        self.chained.update(chained_out)
        forced = forced_output(self.chained, traces)  # its output durations: the reference's from here on
        if forced:
            durations["chained"] = forced
        self.rec.stages.append(StageRow(**judge_stage(
            self.session, stage, self.item, traces, tol, local_in, self.local_out, chained_out,
            {"bucket": meta, "durations": durations}, self.steps, self.references, self.defects,
            self.ran[stage.name]["reference"])))
        return True

    def _glue_rows(self, stage, tol) -> tuple[dict, dict]:
        """The user's host code feeding this stage, each (glue, tensor) judged once in a row of
        its own; returns (the stage's own glue, all glue it runs)."""
        try:
            own = {ref.tensor: UserGlue(ref.glue, resolve_glue(ref.glue, self.port.root))
                   for ref in stage.inputs.values() if ref.glue is not None}
        except UsageError as e:
            raise PortError(f"stage {stage.name!r}, field 'inputs.*.glue': {e}") from None
        used = set().union(*(glue_used(r.tensor, self.chained, self.user)
                             for r in stage.inputs.values() if r.glue is None))
        glued = {**{t: self.user[t] for t in sorted(used)}, **own}
        for tensor, g in glued.items():
            if (g.spec, tensor) not in self.judged_glue:
                self.judged_glue.add((g.spec, tensor))
                row = judge_glue(g, tensor, self.chained, self.traces, self.user, tol, stage)
                self.rec.stages.append(StageRow(**row))
                if not row["local_ok"]:
                    self.defects.append((row["stage"], tensor, row["outputs"][tensor]["local"]))
        return own, glued

    def _reason(self) -> None:
        rec = self.rec
        rec.reason += forced_note(rec)
        if len(self.port.stages) == 1 or rec.verdict is Verdict.PASS:
            pass  # one stage: the verdict says it all (`--bisect` looks inside an ONNX); a pass names nothing
        elif self.ranked:  # two defects or more: ranked by what each, taken out alone, does to the audio
            rec.reason += "; " + defects_reason(self.ranked)
        elif self.defects:  # every stage the table reads DEFECT, in chain order
            rec.reason += "; first stage whose local error leaves its floor: " + "; also: ".join(
                f"{stage!r} ({tensor}: {m.get('why', '')}; {m.get('kind', '')})" for stage, tensor, m in self.defects)
        else:
            rec.reason += "; no stage leaves its floor locally (the error accumulates along the chain)"
        rec.reason = rec.reason.lstrip("; ")


def rank_chain_defects(chain: _Chain) -> list[dict]:
    """Each stage whose local error leaves its floor, ranked by what it does to the audio
    (defects.score_defects, as inside a whole-model ONNX): its outputs without their own error
    (defects.without_own_error: the first stage, fed the reference, gives the reference's values)
    and the later stages run chained on from there, with the same host glue, case noise and forced
    durations as the chained run; the audio with it is the chained run's. A defect that cannot be
    taken out (a host glue's, an output of another shape than the reference's, a run that fails)
    is listed unranked with why. Each stage's row gets its `defect` (rank, effect); in rank order."""
    found, pairs = [], {}
    stages = {s.name: s for s in chain.port.stages}
    for name, tensor, m in chain.defects:
        if name in {f["stage"] for f in found}:
            continue
        d = {"stage": name, "kind": m.get("kind", ""), "local_rel_l2": m.get("rel_l2"),
             "floor_rel_l2": m.get("floor_rel_l2"), "nonfinite": m.get("why", "").startswith(("NaN", "Inf"))}
        found.append(d)
        ran = chain.ran.get(name)
        if ran is None:
            d["unranked"] = "a host glue's value is computed where a stage reads it: not fed in its place"
            continue
        values = fixed_outputs(chain, name, ran)
        if isinstance(values, str):
            d["unranked"] = values
            continue
        values = {**ran["before"], **ran["chained"], **values}
        scratch = chain.rec.model_copy(update=dict(reason="", timings={}, cache={}, audit=Audit(), peak_rss_mb={}))
        for later in chain.port.stages[ran["index"] + 1:]:
            own = chain.ran[later.name]
            out, _ = chain.chained_run(stages[later.name], values, own["own"], own["found"], {},
                                       f"without-{name}", scratch)
            if out is None:
                d["unranked"] = f"stage {later.name!r} did not run without it: {scratch.reason}"
                break
            values.update(out)
        else:
            pairs[name] = (chain.chained["audio"].reshape(-1).double().numpy(),
                           values["audio"].reshape(-1).double().numpy())
    want = end_reference(chain.session, chain.port, chain.item, chain.traces)
    ranked = score_defects(found, pairs, want)
    for row in chain.rec.stages:
        d = next((d for d in ranked if d["stage"] == row["stage"]), None)
        if d is not None:
            row["defect"] = {k: d[k] for k in ("rank", "moves_audio_snr_db", "audio_effect", "unranked") if k in d}
    return ranked


def fixed_outputs(chain: _Chain, name: str, ran: dict) -> dict | str:
    """A defective stage's outputs with their own error taken out (defects.without_own_error,
    durations: the reference's), or why they cannot be."""
    out = {}
    for tensor, value in ran["chained"].items():
        local = ran["local"][tensor]
        r32 = ran["reference"].get(tensor)
        r32 = boundary(tensor, chain.traces) if r32 is None else r32
        if not value.is_floating_point():
            out[tensor] = r32.to(value.dtype) if value.shape == r32.shape else value
        elif value.shape == local.shape == r32.shape:
            out[tensor] = torch.from_numpy(without_own_error(value, local, r32)).to(value.dtype)
        else:
            return (f"its output {tensor!r} has shape {list(value.shape)}, locally {list(local.shape)}, the "
                    f"reference {list(r32.shape)}: its error cannot be taken out")
    return out


def end_reference(session, port: Port, item, traces):
    """The audio the chain's end is judged against: run 0 of the noise band, or the zero-noise
    reference when the last stage draws no noise."""
    last = port.stages[-1]
    if last.noise == "none" and noise_inside(last):
        return zero_noise_reference(session, item.case)["float32"][0].double().numpy()
    return traces.chain["audio"][0].double().numpy()


def judge_stage(session, stage: StageSpec, item, traces, tol, local_in: dict, local_out: dict, chained_out: dict,
                runs: dict, steps, references: dict | None, defects: list, judged_against: dict | None = None) -> dict:
    """A stage's row: each output's local and chained values judged (against the reference the
    stage's bucket, precision or noise asks for: stage_references), what its runs were (`runs`:
    the bucket each took, the durations found inside it); a local error leaving its floor is
    added to `defects` (once per stage); `judged_against` gets each output's float32 reference."""
    meta, durations = runs["bucket"], runs["durations"]
    row = {"stage": stage.name, "artifact": stage.artifact, **({"step": stage.step} if stage.step else {}),
           "precision": stage.precision, "outputs": {}}
    if meta:
        row["bucket"] = meta
    if durations:  # found inside the stage (harness.port.durations): the later stages ran on the reference's
        row["durations"] = durations
    own, note = stage_references(session, stage, local_in, traces, item, steps, references)
    if stage.noise == "none" and noise_inside(stage) and "audio" in chained_out and "audio" not in own:
        own["audio"] = zero_noise_reference(session, item.case)
        note = "judged against the zero-noise reference (the stage draws no noise)"
    if note:
        row["reference"] = note
    for tensor in chained_out:
        ref = {**((references or {}).get(tensor) or {}), **own.get(tensor, {})}
        # the chained run took another bucket: its padded reference is not this one
        chain_ref = ref if meta.get("chained", meta.get("local")) == meta.get("local") else \
            {k: v for k, v in ref.items() if k not in ("float32", "float64", "exact", "bucket")} | \
            dict(ref.get("exact", {}))
        local = judge_tensor(tensor, local_out[tensor], traces, tol, stage, ref or None)
        if judged_against is not None and "float32" in ref:
            judged_against[tensor] = ref["float32"]
        chain = local if chained_out is local_out else judge_tensor(tensor, chained_out[tensor], traces, tol,
                                                                    stage, chain_ref or None)
        row["outputs"][tensor] = {"local": local, "chained": chain}
        if not local.get("ok", True) and stage.name not in {d[0] for d in defects}:
            defects.append((stage.name, tensor, local))
    row["local_ok"] = all(o["local"].get("ok", True) for o in row["outputs"].values())
    row["chained_ok"] = all(o["chained"].get("ok", True) for o in row["outputs"].values())
    return row


def stage_durations(port: Port, stage: StageSpec, work: Path) -> FoundDurations | None:
    """A stage's durations found inside it (harness.port.durations), or None; a graph that cannot
    be read for it is one error naming the stage."""
    try:
        return found_durations(port, stage, work)
    except Exception as e:  # noqa: BLE001 - a file onnx cannot read or infer: one error, named
        raise PortError(f"stage {stage.name!r}, field 'artifact': cannot look for its durations: "
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def forced_note(rec) -> str:
    """What the reason says of durations found inside a stage that differ from the reference's."""
    notes = []
    for row in rec.stages:
        d = (row.get("durations") or {}).get("chained") or (row.get("durations") or {}).get("local")
        if d and d.get("forced"):
            if not rec.durations:
                rec.durations = {k: v for k, v in d.items() if isinstance(v, int) and not isinstance(v, bool)}
            where = "in the output of" if d.get("output") else "inside"
            notes.append(f"{d['tokens_differ']} of {d['tokens']} durations differ {where} {row['stage']!r} "
                         f"({d['frames']} frames, the reference {d['frames_reference']}): from there on the "
                         f"stages ran with the reference's durations forced")
    return "".join(f"; {n}" for n in notes)


def boundary(name: str, traces) -> torch.Tensor:
    """The reference's tensor at a port boundary (fp32, exact lengths, the case's noise)."""
    return tensors.reference(name, traces, "float32")


def stage_references(session, stage: StageSpec, local_in: dict, traces, item, steps: HarnessSteps | None = None,
                     references: dict | None = None) -> tuple[dict, str]:
    """What a stage's outputs are judged against beyond the plain reference, and a note for its row.

    A bucketed stage: its outputs recomputed by Kokoro's reference from its local inputs padded to
    the bucket it ran (pad_to_bucket; harness.reference.stage_reference, static patches, fp32 and
    fp64), trimmed like the stage's outputs: {tensor: {"float32", "float64", "bucket", "exact":
    {"float32", "float64"}}} — Kokoro is not padding-invariant, so the padded reference isolates the
    backend's error and the exact-length one measures what the padding costs. A `precision: float16`
    stage: {"float16", "float16_base"} (eager float16 and float64 of the same computation, at the
    bucket or the exact lengths): its float16 floor. A stage whose outputs cannot be recomputed from
    its inputs (it starts inside a module) keeps the exact-length reference; the note says so."""

    bucketed = bool(stage.buckets) and (stage.step is None or (steps is not None and steps.static))
    fp16 = stage.precision == "float16"
    if not bucketed and not fp16:
        return {}, ""
    names = tuple(dict.fromkeys(r.tensor for r in stage.outputs.values() if r.tensor != "pred_dur"))
    inputs = {**{n: boundary(n, traces) for n in CASE_INPUTS if n not in local_in}, **local_in}
    mode = "static" if bucketed else "dynamic"
    variant = tuple(p for p in (steps.patches if steps is not None and stage.step else ())
                    if p not in REFERENCE_PATCHES[mode] and p not in NEUTRAL_PATCHES)
    chosen = None
    if bucketed:
        chosen = choose_buckets(stage, local_in, traces)
        inputs = pad_to_bucket(stage, inputs, chosen, traces)
        listed = {u: b for u, b in chosen.items() if stage.bucket_units[u] != "case"} or chosen
        chosen = next(iter(listed.values())) if len(listed) == 1 else listed
    precisions = (("float32", "float64") if bucketed else ("float64",)) + (("float16",) if fp16 else ())
    try:
        ref = stage_reference(session.model, session.cases[item.case], inputs, names, mode, precisions, variant)
    except BoundaryError as e:
        return {}, (f"no reference at bucket {chosen}: {e}; judged against the exact-length reference"
                    if bucketed else f"no float16 floor: {e}; judged against the fp32 floor")
    out = {}
    for t in names:
        exact = (references or {}).get(t) or {p: tensors.reference(t, traces, p) for p in ("float32", "float64")}
        shape = tuple(exact["float32"].shape)
        got = {p: _like(v[t], shape) for p, v in ref.items()}
        if fp16:
            got["float16_base"] = got.pop("float64") if not bucketed else got["float64"]
        if bucketed:
            got |= {"bucket": chosen, "exact": exact}
        out[t] = got
    note = f"judged against the reference padded to bucket {chosen}" if bucketed else ""
    return out, note


def _like(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A padded reference cut to the exact reference's shape (the valid region, as `trim` does)."""
    if value.dim() != len(shape):
        return value
    for axis, size in enumerate(shape):
        if value.shape[axis] > size:
            value = value.narrow(axis, 0, size)
    return value.contiguous()


@dataclass(frozen=True)
class UserGlue:
    """A user's host glue: `package.module:function`, called with the Kokoro tensors so far."""

    spec: str
    fn: object

    def __call__(self, values: Mapping) -> torch.Tensor:
        try:
            value = self.fn(values)
        except PortError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's code: its error, named
            raise PortError(f"glue {self.spec!r} raised {type(e).__name__}: {e}") from None
        try:
            return torch.as_tensor(value)
        except Exception:  # noqa: BLE001
            raise PortError(f"glue {self.spec!r} returned a {type(value).__name__}, not a tensor") from None


class GlueView(Mapping):
    """What a user's glue reads: any Kokoro tensor at this point of the chain (an earlier stage's
    output, the case's, or the host glue over them), computed when it is read."""

    def __init__(self, get):
        self._get, self._seen = get, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if not tensors.known(name):
            raise UnknownName(f"{name!r} is not a Kokoro tensor (docs/own-port.md)")
        if name not in self._seen:
            self._seen[name] = self._get(name)
        return self._seen[name]

    def __iter__(self):
        return iter(tensors.VOCAB)

    def __len__(self) -> int:
        return len(tensors.VOCAB)


def glue_view(values: dict, traces, user: dict, without: str | None = None) -> GlueView:
    """The chain's values for a user's glue; `without`: the tensor that glue computes (it reads the
    harness's own value of it, e.g. to pad it to its bucket)."""
    others = {k: g for k, g in user.items() if k != without}
    return GlueView(lambda n: glue(n, values, traces, others))


def glue(name: str, values: dict[str, torch.Tensor], traces, user: dict | None = None) -> torch.Tensor:
    """A chained stage's input: an earlier stage's output, the user's host glue (`glue:`), the host
    glue over them (the harness's own reference code), or the case's input."""
    user = user or {}
    if name in values:
        return values[name]
    if name in user:
        return user[name](glue_view(values, traces, user, without=name))
    if name == "pred_dur" and "duration" in values:
        return torch.round(values["duration"].reshape(-1)[: traces.valid.tokens]).clamp(min=1).long()
    if name in ("aln", "frame_lengths"):
        pred = glue("pred_dur", values, traces, user)
        frames = int(pred.sum())
        if name == "frame_lengths":
            return torch.tensor([frames])
        aln = torch.zeros(1, traces.valid.tokens, frames)
        aln[0, torch.repeat_interleave(torch.arange(len(pred)), pred), torch.arange(frames)] = 1
        return aln
    if name == "en":
        return glue("d", values, traces, user).transpose(-1, -2) @ glue("aln", values, traces, user)
    if name == "asr":
        return glue("t_en", values, traces, user) @ glue("aln", values, traces, user)
    if name in tensors.NOISE:
        return noise_for(name, values, traces, user)
    return boundary(name, traces)


def glue_used(name: str, values: dict, user: dict) -> set[str]:
    """The tensors whose user glue `glue(name, values, ...)` calls: directly, or under the
    harness's glue (`asr = t_en @ aln` with the user's `aln`)."""

    if name in values:
        return set()
    if name in user:
        return {name}
    deps = HOST_GLUE.get(name, ()) + (("frame_lengths",) if name in tensors.NOISE and name != "rand_ini" else ())
    return set().union(*(glue_used(d, values, user) for d in deps))


def valid_lengths(traces, values: dict | None = None, user: dict | None = None) -> dict[str, int]:
    """The valid length per axis unit: the reference's (local), or the chain's frames (from its
    durations, or the user's `frame_lengths` glue)."""
    frames = traces.valid.frames if values is None else int(glue("frame_lengths", values, traces, user))
    return {"tokens": traces.valid.tokens, "frames": frames, "frames2": 2 * frames,
            "samples": frames * SAMPLES_PER_FRAME}


def trim(name: str, value: torch.Tensor, valid: dict[str, int]) -> torch.Tensor:
    """A Kokoro tensor cut to the valid length along its unit axes (a bucket's padding dropped)."""
    t = tensors.VOCAB.get(name)
    if t is None or value.dim() != t.shape.count(",") + 1:
        return value
    for axis, unit in t.axes.items():
        if value.shape[axis] > valid[unit]:
            value = value.narrow(axis, 0, valid[unit])
    return value.contiguous()


def choose_buckets(stage: StageSpec, values: dict, traces) -> dict[str, int]:
    """unit -> the bucket this run takes: the smallest listed size that holds the stage's inputs,
    or the case's own bucket (`case`, its file's `bucket.tokens` / `bucket.frames`)."""
    chosen = {}
    for unit, sizes in stage.bucket_units.items():
        need = bucket_size(stage, values, unit)
        if sizes == "case":
            chosen[unit] = traces.bucket.of(unit)
            if need > chosen[unit]:
                raise PortError(f"stage {stage.name!r}, field 'buckets': {need} {unit} exceed the case's bucket "
                                f"({chosen[unit]})")
        else:
            chosen[unit] = stage.bucket_for(need, unit)
    return chosen


def pad_to_bucket(stage: StageSpec, values: dict, bucket: int | dict[str, int], traces) -> dict[str, torch.Tensor]:
    """A bucketed stage's inputs padded to `bucket` ({unit: size}; an int: the stage's one unit)
    along the axes in its units, with the harness's rules (harness.reference.pad_inputs): each
    step input's pad value (text_mask: True), zero rows and columns of the alignment, and for the
    noise the bucket's own prefix of the case's draw."""
    chosen = bucket if isinstance(bucket, dict) else {stage.bucket_unit: bucket}
    lengths = {u: size * m for unit, size in chosen.items() for u, m in BUCKET_UNITS[unit].items()}
    out = {}
    for name, value in values.items():
        if name in tensors.NOISE and name != "rand_ini":
            full = traces.chain[f"case_{name}"]
            need = lengths.get("samples") or value.shape[1]
            if full.shape[1] < need:
                raise PortError(f"stage {stage.name!r}, field 'buckets': the case's {name} covers "
                                f"{full.shape[1]} samples, bucket {chosen} needs {need}")
            out[name] = full[:, :need].contiguous()
            continue
        t = tensors.VOCAB.get(name)
        if t is not None and value.dim() == t.shape.count(",") + 1:
            for axis, unit in t.axes.items():
                if unit not in lengths:
                    continue
                extra = lengths[unit] - value.shape[axis]
                if extra < 0:
                    raise PortError(f"stage {stage.name!r}, field 'buckets': {name} has {value.shape[axis]} {unit}, "
                                    f"more than bucket {bucket} holds ({lengths[unit]})")
                if extra:
                    shape = list(value.shape)
                    shape[axis] = extra
                    value = torch.cat([value, torch.full(shape, _pad_value(name), dtype=value.dtype)], dim=axis)
        out[name] = value.contiguous()
    return out


def _pad_value(name: str) -> float:
    return next((t.pad_value for s in STEPS for t in (*s.inputs, *s.outputs) if t.name == name), 0.0)


def bucket_size(stage: StageSpec, values: dict, unit: str | None = None) -> int:
    """The length a bucket must hold, in `unit` (default: the bucket's): the longest of the stage's
    inputs along their axes in that unit (a user's glue that pads an input chooses the bucket)."""
    unit = unit or stage.bucket_unit
    units = BUCKET_UNITS[unit]
    sizes = []
    for name, value in values.items():
        t = tensors.VOCAB.get(name)
        if t is None or name in tensors.NOISE or value.dim() != t.shape.count(",") + 1:
            continue
        sizes += [-(-value.shape[axis] // units[u]) for axis, u in t.axes.items() if u in units]
    if not sizes:
        raise PortError(f"stage {stage.name!r}, field 'buckets': no input with a {unit} axis")
    return max(sizes)


def judge_glue(g: UserGlue, tensor: str, chained: dict, traces, user: dict, tol, stage: StageSpec) -> dict:
    """The user's host glue as a row: fed the reference's values (local) and the chain's (chained),
    its value (trimmed to the valid length) against the reference's tensor."""
    local = trim(tensor, g(GlueView(lambda n: glue(n, {}, traces))), valid_lengths(traces))
    chain = trim(tensor, g(glue_view(chained, traces, user, without=tensor)), valid_lengths(traces, chained, user))
    out = {"local": judge_tensor(tensor, local, traces, tol, stage),
           "chained": judge_tensor(tensor, chain, traces, tol, stage)}
    return {"stage": f"glue:{tensor}", "artifact": g.spec, "precision": "float32", "outputs": {tensor: out},
            "local_ok": out["local"].get("ok", True), "chained_ok": out["chained"].get("ok", True)}


def noise_for(name: str, values: dict, traces, user: dict | None = None) -> torch.Tensor:
    """The case's noise, cut to the chained frames (every length takes a prefix of the same draw)."""
    full = traces.chain[f"case_{name}"]
    if name == "rand_ini":
        return full
    frames = int(glue("frame_lengths", values, traces, user)) \
        if ("pred_dur" in values or "duration" in values or "frame_lengths" in (user or {})) else traces.valid.frames
    return full[:, : frames * SAMPLES_PER_FRAME].contiguous()


def from_artifact(value: torch.Tensor, name: str, declared_dtype: str | None) -> torch.Tensor:
    """An artifact's output in Kokoro's convention: the vocabulary's rank, float32 or int64."""
    t = tensors.VOCAB.get(name)
    value = torch.as_tensor(value)
    if name == "audio" and not value.is_floating_point():
        value = value.float() / 32768.0
    if t is not None:
        rank = t.shape.count(",") + 1
        while value.dim() > rank and value.shape[0] == 1:
            value = value[0]
        while value.dim() < rank:
            value = value.unsqueeze(0)
        if t.dtype.startswith("int"):
            value = value.round().long() if value.is_floating_point() else value.long()
        elif value.is_floating_point():
            value = value.float()
    return value


def stage_tag(port: Port, stage: StageSpec, role: str) -> str:
    """The prefix of a stage run's timings, cache and audit keys in the record."""
    return f"{stage.name}.{role}." if len(port.stages) > 1 else ""


def run_stage(session, port: Port, stage: StageSpec, values: dict, rec, item, role: str, traces,
              valid: dict[str, int] | None = None, meta: dict | None = None, steps: HarnessSteps | None = None):
    """Run one stage (its artifact, or its harness step on `steps`' backend) on Kokoro tensors; its
    outputs as Kokoro tensors, or None with the record's verdict set. A bucketed stage runs the
    bucket that fits, its inputs padded to it and its outputs trimmed to `valid` (valid_lengths);
    `meta[role]` records the bucket (a size, or {unit: size} with buckets per unit)."""

    chosen = {}
    if stage.buckets and (stage.step is None or (steps is not None and steps.static)):
        chosen = choose_buckets(stage, values, traces)
        values = pad_to_bucket(stage, values, chosen, traces)
        listed = {u: b for u, b in chosen.items() if stage.bucket_units[u] != "case"}  # `case`: the case file's
        if meta is not None and listed:
            meta[role] = next(iter(listed.values())) if len(listed) == 1 else listed
    tag = stage_tag(port, stage, role)
    if stage.step is not None:
        return run_step(session, stage, values, rec, item, role, tag, steps,
                        valid or (valid_lengths(traces) if chosen else None))
    bucket = (chosen if isinstance(stage.buckets, dict) else chosen[stage.bucket_unit]) if chosen else None
    path = stage.file_for(port.root, bucket)
    ready = session.prebuilt(path, rec, session.report_dir / "runs" / item.id / f"{stage.name}-{role}", tag,
                             where=f"stage {stage.name!r} ({path.name}): ", runtime=stage.runtime)
    if ready is None:
        if rec.verdict is Verdict.RUN_ERROR:
            rec.reason = f"port {port.source}, {rec.reason}"
        return None
    backend, ins, outs = ready.backend, ready.inputs, ready.outputs
    feed = []
    for i, p in enumerate(ins):
        key = p.name if p.name is not None else f"#{i}"
        ref = stage.inputs.get(key) or list(stage.inputs.values())[i]
        feed.append(to_artifact(values[ref.tensor], p, ref.dtype))
    out = session.run_artifact(backend, ready.path, feed, rec, f"{item.id}/{stage.name}-{role}", tag)
    if out is None:
        rec.reason = f"port {port.source}, stage {stage.name!r} ({path.name}): {rec.reason}"
        return None
    names = [p.name if p.name is not None else f"#{i}" for i, p in enumerate(outs)] if outs else list(stage.outputs)
    if len(out) != len(names):
        rec.verdict = Verdict.RUN_ERROR
        rec.reason = f"port {port.source}, stage {stage.name!r}: {path.name} returned {len(out)} outputs, declared {names}"
        return None
    result_values = {}
    for name, value in zip(names, out):
        ref = stage.outputs.get(name)
        if ref is None:
            continue
        try:
            result_values[ref.tensor] = from_artifact(value, ref.tensor, ref.dtype)
        except Exception as e:  # noqa: BLE001
            raise PortError(f"stage {stage.name!r}, output {name!r}: {e}") from None
        if bucket is not None:
            result_values[ref.tensor] = trim(ref.tensor, result_values[ref.tensor], valid or valid_lengths(traces))
    return result_values


def run_step(session, stage: StageSpec, values: dict, rec, item, role: str, tag: str, steps: HarnessSteps,
             valid: dict[str, int] | None):
    """A `step:` stage: the harness step exported, compiled (both cached) and run on the item's
    backend with its patches, fed the Kokoro tensors its inputs map; outputs trimmed to `valid`
    (a bucketed run) and returned as Kokoro tensors, or None with the record's verdict set."""

    step = get_step(stage.step)
    inputs = {name: values[stage.inputs[name].tensor] for name in step.input_names}
    out = session.execute(steps.backend, step.name, inputs, steps.patches, rec, f"{item.id}/{stage.name}-{role}", tag)
    if out is None:
        rec.reason = f"stage {stage.name!r} ({role} run): {rec.reason}"
        return None
    result = {}
    for name, value in zip(step.output_names, out):
        tensor = stage.outputs[name].tensor
        result[tensor] = trim(tensor, value, valid) if valid is not None else value
    return result


# ---- judging --------------------------------------------------------------------------------------

# Frames from a half within which the reference's unrounded duration may round either way: a port's
# own error there moves a duration by one frame (an int8 front does, 1 token in 50) without a defect.
ROUNDING = 0.1


def rounding_ties(value: torch.Tensor, ref: torch.Tensor, traces) -> int:
    """The tokens whose durations differ by one frame where the reference's float64 duration before
    rounding is within ROUNDING of a half; a length that differs counts none."""
    value, ref = value.reshape(-1).long(), ref.reshape(-1).long()
    if len(value) != len(ref):
        return 0
    raw = tensors.reference("duration", traces, "float64").reshape(-1)[: len(ref)]
    near = ((raw - raw.floor() - 0.5).abs() <= ROUNDING) & ((value - ref).abs() == 1)
    return int(near.sum())


def judge_tensor(name: str, value: torch.Tensor, traces, tol, stage: StageSpec, ref: dict | None = None) -> dict:
    """One output of one stage against the reference (`ref`: {"float32", "float64"} instead of the
    plain one): durations exactly, noise-dependent tensors of a stage that draws its own noise by
    their difference only (the band judges the audio), everything else against the fp32 floor
    (harness.verdict.comparator)."""

    ref = ref or {}
    ref32 = ref["float32"] if "float32" in ref else tensors.reference(name, traces, "float32")
    if name == "pred_dur":
        info = compare_durations(value, ref32)
        differ, ties = info["tokens_differ"], rounding_ties(value, ref32, traces)
        why = f"{differ} of {len(ref32)} durations differ" if differ else "durations equal"
        if differ and ties == differ:
            why += f" by one frame where the reference's unrounded duration is within {ROUNDING} of a half (rounding)"
        return {**info, "ok": ties == differ, "why": why, "kind": "durations"}
    if tuple(value.shape) != tuple(ref32.shape):
        kind = (f"length {value.shape[-1] - ref32.shape[-1]:+d} samples" if name == "audio" and value.dim() == ref32.dim()
                else "shape")
        bad = nonfinite(value, None if torch.isfinite(ref32).all() else ref32)
        return {"ok": False, "why": (f"{bad}; " if bad else "") + f"shape {list(value.shape)} != reference "
                f"{list(ref32.shape)}", "kind": kind, "shape": list(value.shape)}
    ref64 = ref["float64"] if "float64" in ref else tensors.reference(name, traces, "float64")
    m = compare_to_floor(value, ref32, ref64)
    m["kind"] = difference_kind(value, ref64)
    if "bucket" in ref:  # a bucketed stage: judged at its bucket; the exact-length error reported
        exact = ref["exact"]
        m["reference"] = f"padded to bucket {ref['bucket']}"
        if tuple(exact["float64"].shape) == tuple(value.shape):
            m["exact_rel_l2"] = error_metrics(value, exact["float64"])["rel_l2"]
            m["rewrite_drift_rel_l2"] = error_metrics(ref32, exact["float32"])["rel_l2"]
    if "float16" in ref:  # a float16 stage: float16 eager's own error is its floor, the fp32 one beside it
        apply_float16_floor(m, error_metrics(ref["float16"], ref.get("float16_base", ref64)), stage.precision)
    bad = nonfinite(value, ref64)  # a NaN never passes: not by the noise band, not by any floor
    if bad:
        m["ok"], m["why"] = False, bad
        return m
    t = tensors.VOCAB.get(name)
    if t is not None and t.stochastic and stage.noise == "own":
        m["ok"], m["why"] = True, "draws its own noise: judged by the noise band"
        return m
    m["ok"], m["why"] = comparator(tol)(m)
    return m


def judge_end(session, port: Port, item: PortItem, rec, values: dict, traces, case, local=None) -> None:
    """The verdict: every chained output of every stage, and the final audio (against the noise
    band when its stage draws its own noise, else against the floor), plus the durations."""

    last = port.stages[-1]
    tol = session.profile.for_(last.precision if last.precision not in ("float32", "float16") else "port",
                               item.backend, item.mode)
    failures = []
    for row in rec.stages:
        for tensor, m in row.outputs.items():
            c = m.chained
            if not c.why.startswith("draws its own noise"):  # band-judged audio: its rel L2 means nothing
                rec.metrics[f"{row.stage}:{tensor}"] = {k: v for k, v in c.model_dump().items()
                                                        if isinstance(v, (int, float))}
            if tensor == "pred_dur":
                rec.durations = {k: v for k, v in c.model_dump().items() if isinstance(v, int) and not isinstance(v, bool)}
            if not c.ok:  # durations too: beyond a rounding tie they are a defect (judge_tensor)
                failures.append(f"{row.stage}:{tensor}: {c.why}")
            bad = next((j.why for j in (m.local, m.chained) if _is_nonfinite(j)), None)
            if bad and not c.why.startswith(("NaN", "Inf")):  # a local NaN fails the item too
                failures.append(f"{row.stage}:{tensor} (local): {bad}")
    if "audio" in values:
        audio = values["audio"]
        ref = end_reference(session, port, item, traces)
        cand = audio.reshape(-1).double().numpy()
        rec.audio_metrics["audio"] = {**audio_metrics(ref, cand), "duration_s": len(cand) / SAMPLE_RATE}
        am = rec.audio_metrics["audio"]
        bad = nonfinite(torch.from_numpy(cand))
        if bad:
            failures.append(f"audio: {bad}")
        if len(cand) != len(ref):
            failures.append(f"audio: {len(cand)} samples, the reference has {len(ref)} "
                            f"({(len(cand) - len(ref)) / 600:+.1f} frames)")
        if last.noise == "own":
            band = noise_band(session.model, case, traces, session_k(session))
            check = band_comparator(tol)
            for metric, direction in DIRECTIONS.items():
                ok, why = check(metric, am.get(metric, math.nan), band["band"][metric], direction)
                if not math.isfinite(am.get(metric, math.nan)) and all(map(math.isfinite, band["band"][metric])):
                    ok, why = False, f"NaN: {metric} is non-finite (its noise band is finite)"
                rec.bands[metric] = NoiseBand(value=am.get(metric), band=band["band"][metric], ok=ok,
                                              direction=direction, why=why, k=band["k"])
                if not ok:
                    failures.append(f"audio: {why}")
            zero = band["zero_noise_audio"][0]
            if zero.shape[-1] == len(cand):
                z = error_metrics(torch.from_numpy(cand), zero.double())
                rec.bands["zero_noise"] = ZeroNoise(
                    rel_l2=z["rel_l2"], snr_db=z["snr_db"], kind=difference_kind(torch.from_numpy(cand), zero.double()),
                    why="sample by sample against the reference with every noise input zero")
        else:
            ok, why = audio_comparator(tol)(am)
            if not ok:
                failures.append(f"audio: {why}")
        for role, wav in (("reference", ref), ("artifact", cand)):
            path = session.report_dir / "audio" / item.id / f"{role}.wav"
            write_wav(path, wav)
            rec.audio[role] = path.relative_to(session.report_dir).as_posix()
    if failures:  # a non-finite value first: no other figure of the item means anything beside it
        failures.sort(key=lambda f: not any(w in f for w in (": NaN: ", ": Inf: ")))
        rec.verdict, rec.reason = Verdict.FAIL, "; ".join(failures)
    else:
        parts = [f"{k}: {v.why}" for k, v in rec.bands.items() if isinstance(v, NoiseBand)]
        rec.verdict, rec.reason = Verdict.PASS, "; ".join(parts) or "every stage within its floor"


def _is_nonfinite(m: Judged) -> bool:
    return not m.ok and m.why.startswith(("NaN: ", "Inf: "))


