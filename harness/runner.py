"""The runner: items -> records. It schedules the work of one item (traces, export, compile, run,
metrics, verdict) through the cache and child-process jobs, and counts what it did."""
from __future__ import annotations

import json
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__, cache
from .backends import Backend, compile_job, get_backend  # noqa: F401 - compile_job is a job target
from .cases import Case, load_cases
from .files import content_key
from .jobs import JobResult, run_job
from .metrics.tensor import compare_to_floor, error_metrics
from .programs import PROGRAM_VERSION
from .record import Record
from .verdict import Profile, Verdict, judge

MODES = ("dynamic", "static")


@dataclass(frozen=True)
class Item:
    case: str
    step: str
    backend: str
    mode: str

    @property
    def id(self) -> str:
        return f"{self.case}-{self.step}-{self.backend}-{self.mode}"


@dataclass
class Limits:
    export_s: float = 1200
    compile_s: float = 2400
    run_s: float = 900

    @classmethod
    def parse(cls, specs: list[str]) -> "Limits":
        """From `PHASE=SECONDS` strings (`--time-limit compile=600`)."""
        limits = cls()
        for spec in specs:
            phase, _, seconds = spec.partition("=")
            if phase not in ("export", "compile", "run"):
                raise ValueError(f"--time-limit {spec!r}: the phase is export, compile or run")
            try:
                setattr(limits, f"{phase}_s", float(seconds))
            except ValueError:
                raise ValueError(f"--time-limit {spec!r}: {seconds!r} is not a number of seconds") from None
        return limits


@dataclass
class Session:
    """One run over a model and its cases. Traces and the model load lazily, once."""

    weights: str | None = None
    case_ids: list[str] | None = None
    report_dir: Path = Path("reports")
    profile: Profile = field(default_factory=Profile.load)
    limits: Limits = field(default_factory=Limits)
    extra_patches: tuple[str, ...] = ()  # added to every backend's own (e.g. length_aware_lstm)
    counts: Counter = field(default_factory=Counter)
    _model: object = None
    _traces: dict = field(default_factory=dict)
    _cases: dict | None = None

    # -- lazily loaded state --------------------------------------------------------------
    @property
    def cases(self) -> dict[str, Case]:
        if self._cases is None:
            self._cases = {c.id: c for c in load_cases(only=self.case_ids)}
        return self._cases

    @property
    def model(self):
        if self._model is None:
            from .model import load_model

            self._model = load_model(self.weights)
        return self._model

    def traces(self, case_id: str):
        if case_id not in self._traces:
            from .reference import load_traces

            self._traces[case_id] = load_traces(self.model, self.cases[case_id])
        return self._traces[case_id]

    def items(self, backends: list[str], steps: list[str] | None = None, modes=MODES) -> list[Item]:
        from .steps import ITEM_STEPS

        return [Item(c, s, b, m) for c in self.cases for s in (steps or ITEM_STEPS) for b in backends for m in modes]

    # -- one item -------------------------------------------------------------------------
    def run(self, item: Item) -> Record:
        record = self._run(item)
        record.write(self.report_dir / "records")
        self.counts[f"verdict_{record.verdict.value}"] += 1
        return record

    def _run(self, item: Item) -> Record:
        from .patches import PATCHES, canonical

        backend = get_backend(item.backend)
        patches = list(canonical((*backend.patches, *self.extra_patches)))
        rec = Record(item.case, item.step, item.backend, item.mode, Verdict.SKIPPED, patches=patches,
                     semantic_patches=[p for p in patches if not PATCHES[p].preserves_semantics],
                     model={"name": self.model.name, "digest": self.model.digest, "source": self.model.source},
                     versions=versions(backend))
        ok, why = backend.available()
        if not ok:
            rec.reason = why
            return rec

        if item.step == "e2e":
            from .e2e import run_e2e

            return run_e2e(self, backend, item, patches, rec)
        traces = self.traces(item.case)
        outputs = self.execute(backend, item.step, traces.inputs(item.step, item.mode, "float32"), patches, rec, item.id)
        return rec if outputs is None else self._judge(rec, item, traces, outputs)

    def execute(self, backend: Backend, step: str, inputs: dict, patches: list[str], rec: Record,
                run_name: str, tag: str = "") -> list | None:
        """Export (cached), compile (cached) and run `step` on `inputs`. Fills the record's timings,
        cache and audit (keys prefixed with `tag`); on failure sets its verdict and returns None."""
        import torch

        shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()]
        # export (once per step, shapes and patches; shared by every backend). Only the patches that
        # can change this step are applied and keyed, so a backend with an extra LSTM patch shares
        # the decoder's program with the others.
        from .patches import affecting, graph_code_digest

        patches = list(affecting(patches, step))

        program_key = content_key("program", PROGRAM_VERSION, step, shapes, patches, self.model.digest,
                                  torch.__version__, graph_code_digest(tuple(patches)))
        program_dir, result = self._cached_job(
            "programs", program_key, "exports", "harness.programs:export_step", self.limits.export_s,
            lambda tmp: dict(weights=self.weights, expected_digest=self.model.digest, step=step,
                             patches=patches, inputs_path=str(_save_inputs(tmp, inputs)),
                             out_path=str(tmp / "program.pt2")))
        rec.cache[f"{tag}program"] = "hit" if result is None else "miss"
        if result is not None:
            rec.timings[f"{tag}export_s"] = result.seconds
            rec.peak_rss_mb[f"{tag}export"] = result.peak_rss_mb
            if not result.ok:
                _failed(rec, result, Verdict.EXPORT_ERROR)
                return None

        # compile (once per program and backend version)
        artifact_key = content_key("artifact", program_key, backend.name, backend.version())
        artifact_dir, result = self._cached_job(
            "artifacts", artifact_key, "compiles", "harness.backends:compile_job", self.limits.compile_s,
            lambda tmp: dict(backend=backend.name, program_path=str(program_dir / "program.pt2"), out_dir=str(tmp)),
            admission_key=f"compile/{backend.name}/{step}")
        rec.cache[f"{tag}artifact"] = "hit" if result is None else "miss"
        if result is not None:
            rec.timings[f"{tag}compile_s"] = result.seconds
            if result.extra.get("admission_wait_s"):
                rec.timings[f"{tag}compile_wait_s"] = result.extra["admission_wait_s"]
            rec.peak_rss_mb[f"{tag}compile"] = result.peak_rss_mb
            if not result.ok:
                rec.audit.update((result.value or {}).get("audit", {}))  # the op audit made before compiling
                _failed(rec, result, Verdict.COMPILE_ERROR)
                return None
        meta = json.loads((artifact_dir / "result.json").read_text())["value"]
        rec.audit.update(meta["audit"])
        rec.artifact_bytes = (rec.artifact_bytes or 0) + meta["artifact_bytes"]
        ok, why = backend.runnable()
        if not ok:  # compiled (its outcome and audit recorded), cannot run on this machine
            rec.verdict, rec.reason = Verdict.SKIPPED, f"compiled; {why}"
            return None

        # run (always)
        run_dir = self.report_dir / "runs" / run_name
        _save_inputs(run_dir, inputs)
        result = run_job("harness.backends:run_job",
                         dict(backend=backend.name, artifact_path=str(artifact_dir / backend.artifact_name),
                              inputs_path=str(run_dir / "inputs.pt"), outputs_path=str(run_dir / "outputs.pt")),
                         run_dir, self.limits.run_s)
        self.counts["runs"] += 1
        rec.timings[f"{tag}run_s"] = result.value["run_s"] if result.ok else result.seconds
        rec.timings[f"{tag}run_job_s"] = result.seconds
        rec.peak_rss_mb[f"{tag}run"] = result.peak_rss_mb
        if not result.ok:
            _failed(rec, result, Verdict.RUN_ERROR)
            return None
        rec.audit.update(result.value.get("audit") or {})
        return torch.load(run_dir / "outputs.pt", weights_only=True)

    def references(self, item: Item, patches: list[str]) -> tuple[dict, dict, dict, tuple[str, ...]]:
        """(fp32, fp64, unpatched fp32) outputs of the item's effective reference, and its variant.

        A backend is judged against the reference with the same patches its program has; patches
        that are neutral for a mode's reference are left out (see NEUTRAL_PATCHES)."""
        from .patches import affecting
        from .reference import NEUTRAL_PATCHES, REFERENCE_PATCHES, variant_outputs

        traces = self.traces(item.case)
        base32 = traces.outputs(item.step, item.mode, "float32")
        variant = affecting([p for p in patches if p not in REFERENCE_PATCHES[item.mode] and p not in NEUTRAL_PATCHES],
                            item.step)
        if not variant:
            return base32, traces.outputs(item.step, item.mode, "float64"), base32, variant
        ref = variant_outputs(self.model, self.cases[item.case], traces, item.step, item.mode, variant)
        return ref["float32"], ref["float64"], base32, variant

    def _judge(self, rec: Record, item: Item, traces, outputs) -> Record:
        from .steps import get_step

        names = get_step(item.step).output_names
        if len(outputs) != len(names):
            rec.verdict, rec.reason = Verdict.RUN_ERROR, f"{len(outputs)} outputs, expected {len(names)} ({names})"
            return rec
        fp32, fp64, base32, variant = self.references(item, rec.patches)
        if item.mode == "static":
            from .reference import dynamic_counterpart

            dynamic32 = dynamic_counterpart(self.model, self.cases[item.case], traces, item.step, variant)
        for name, out in zip(names, outputs):
            ref = fp64[name]
            if tuple(out.shape) != tuple(ref.shape):
                rec.verdict, rec.reason = Verdict.FAIL, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
                return rec
            v = lambda t: traces.valid_region(item.step, name, t)  # noqa: E731
            rec.metrics[name] = compare_to_floor(v(out), v(fp32[name]), v(ref))
            if variant:
                drift = error_metrics(v(fp32[name]), v(base32[name]))
                rec.patch_drift[name] = {k: drift[k] for k in ("rel_l2", "max_abs", "snr_db")}
            if item.mode == "static":
                drift = error_metrics(v(fp32[name]), dynamic32[name])
                rec.rewrite_drift[name] = {k: drift[k] for k in ("rel_l2", "max_abs", "snr_db")}
                rec.rewrite_drift[name]["floor_rel_l2"] = rec.metrics[name]["floor_rel_l2"]
        self._write_audio(rec, item, traces, dict(zip(names, outputs)), fp64)
        rec.audio_metrics = self._audio_metrics(item, traces, dict(zip(names, outputs)), fp64)
        rec.verdict, rec.reason = judge(rec.metrics, self.profile.for_(item.step, item.backend, item.mode),
                                        rec.audio_metrics)
        return rec

    def _audio_metrics(self, item: Item, traces, outputs: dict, reference: dict) -> dict:
        """PESQ, MCD and friends for outputs along `samples` (valid region, against float64)."""
        from .metrics.audio import audio_metrics
        from .model import SAMPLE_RATE
        from .steps import get_step

        out = {}
        for t in get_step(item.step).outputs:
            if "samples" in t.axes.values():
                v = lambda x: traces.valid_region(item.step, t.name, x)[0].double().numpy()  # noqa: E731
                ref = v(reference[t.name])
                out[t.name] = {**audio_metrics(ref, v(outputs[t.name])), "duration_s": len(ref) / SAMPLE_RATE}
        return out

    # -- listenable audio for the dashboard (issue 6) ---------------------------------------
    def _write_audio(self, rec: Record, item: Item, traces, outputs: dict, reference: dict) -> None:
        """Reference and backend WAVs (valid region) of outputs along `samples`, so that a person can
        hear a difference that the metrics summarize: <report_dir>/audio/<item_id>/{reference,backend}.wav."""
        from .metrics.audio import write_wav
        from .steps import get_step

        names = [t.name for t in get_step(item.step).outputs if "samples" in t.axes.values()]
        for name in names:
            prefix = "" if len(names) == 1 else f"{name}-"
            for role, tensor in (("reference", reference[name]), ("backend", outputs[name])):
                rel = Path("audio") / item.id / f"{prefix}{role}.wav"
                write_wav(self.report_dir / rel, traces.valid_region(item.step, name, tensor).detach().cpu().numpy())
                rec.audio[prefix + role] = rel.as_posix()

    def _cached_job(self, kind, key, counter, function, timeout, make_kwargs,
                    admission_key: str | None = None) -> tuple[Path, JobResult | None]:
        """Run a job whose output directory is a cache entry. Returns (entry, None) on a hit.
        With `admission_key`, the job waits for the memory its last run peaked at (admission.py)."""
        from . import admission

        entry = cache.entry(kind, key)
        if cache.lookup(kind, key):
            self.counts[f"{kind}_hits"] += 1
            return entry, None
        outcome: dict = {}

        def build(tmp: Path) -> None:
            if admission_key is None:
                result = run_job(function, make_kwargs(tmp), tmp, timeout)
            else:
                with admission.admitted(admission_key) as waited:
                    result = run_job(function, make_kwargs(tmp), tmp, timeout)
                result.extra["admission_wait_s"] = round(waited, 1)
                admission.record_peak_mb(admission_key, result.peak_rss_mb)
            outcome["result"] = result
            if not result.ok:
                raise _JobFailed()

        self.counts[counter] += 1
        self.counts[f"{kind}_misses"] += 1
        try:
            entry, hit = cache.get_or_build(kind, key, build)
        except _JobFailed:
            return entry, outcome["result"]
        return entry, outcome.get("result")


class _JobFailed(Exception):
    pass


def _save_inputs(directory: Path, inputs: dict) -> Path:
    import torch

    from .files import atomic_write

    directory.mkdir(parents=True, exist_ok=True)
    return atomic_write(directory / "inputs.pt", lambda f: torch.save([t.contiguous() for t in inputs.values()], f))


def _failed(rec: Record, result: JobResult, error_verdict: Verdict) -> Record:
    rec.verdict = {"crashed": Verdict.CRASHED, "timeout": Verdict.TIMEOUT}.get(result.status, error_verdict)
    rec.reason = result.error
    rec.log = result.log_tail
    return rec


def versions(backend: Backend) -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "harness": __version__, "backend": backend.version(),
           "platform": platform.platform()}
    for pkg in ("torch", "kokoro", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
