"""The runner: items in, records out.

An item (case, step, backend, mode) is resolved once into the things it needs (its Step, its
case's traces, its Backend, its patches); then export, compile and run go through the cache and
child-process jobs (`execute`), and the outputs are judged by `verdict.judge_outputs` against the
reference that `reference.references_for` picks. Everything else (tables, history, dashboard)
reads the records this writes.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import progress
from .backends import Backend, get_backend, precision_of
from .bisect import BISECTABLE, bisect_item
from .cases import Case, case_dirs, configured_dirs, load_cases
from .e2e import run_e2e
from .metrics.audio import audio_metrics, write_audio
from .model import SAMPLE_RATE, load_model, load_vocab
from .backends.web_device import DeviceTarget
from .backends.onnxruntime_web import browser_provider
from .backends.web_page import SharedBrowser
from .backends.prebuilt import NATIVE, PrebuiltBackend, describe_as_json, ports_from_job
from .patches import PATCHES, canonical as canonical_patches
from .plumbing import cache, run_cache
from .plumbing.files import canonical, load_arrays, save_arrays, save_tensors, size_of
from .plumbing.heap import return_freed_memory
from .plumbing.jobs import MEMORY_SHARE, JobResult, Limits, cached_job, run_job  # noqa: F401 (Limits: imported from here too)
from .plumbing.targets import TargetUnreachable, compile_on_target, get_target
from .plumbing.worker import COMPILER, stop_worker
from .programs import ensure_program, program_key, program_sizes
from .record import Record, backend_label, failed, item_id, real_time, skip_compiled_not_run, versions
from .reference import MODES, load_traces, references_for, release_models
from .steps import ITEM_STEPS, STAGES, get_step
from .verdict import Profile, Verdict, judge_outputs
from .plumbing.errors import UsageError


@dataclass(frozen=True)
class Item:
    case: str
    step: str
    backend: str
    mode: str
    target: str = "local"  # harness.plumbing.targets: where its run job executes

    @property
    def id(self) -> str:
        return item_id(self.case, self.step, backend_label(self.backend, self.target), self.mode)

    # harness.pipeline: how this kind of item runs and is localized
    def run(self, session: "Session") -> Record:
        return session.run(self)

    def localizable(self, record: Record, how) -> bool:
        """A backend step's failure, error or crash is bisected on its graph; a pass only when forced."""
        return record.verdict.value in BISECTABLE or (how.force and record.verdict is Verdict.PASS)

    def localize(self, session: "Session", record: Record, how, log) -> None:
        bisect_item(session, self, record, depth=how.depth, verify=how.verify, log=log, band_from=how.band_from)


def _amount(value: float, unit: str) -> str:
    if unit == "s":  # 923 s against a 900 s limit reads "15.4 min", not "15 min"
        return f"{value / 60:.0f} min" if value >= 1800 else f"{value / 60:.1f} min" if value >= 120 else f"{value:.0f} s"
    return f"{value:.1f} {unit}"


@dataclass(frozen=True)
class Resolved:
    """An item with what it needs, looked up once."""

    item: Item
    step: object  # harness.steps.Step; None for e2e, a two-stage port run by the port chain (harness.e2e)
    case: Case
    traces: object  # harness.reference.CaseTraces
    backend: Backend
    patches: list[str]


@dataclass
class Session:
    """One run over a model and its cases. Traces and the model load lazily, once.

    About 400 lines: the lazily loaded state, the three phases of an item (program, artifact,
    run), the saved runs a warm re-run judges instead, and the judging share that state and
    nothing else; each method is short."""

    weights: str | None = None
    case_ids: list[str] | None = None
    report_dir: Path = Path("reports")
    profile: Profile = field(default_factory=Profile.load)
    limits: Limits = field(default_factory=Limits)
    extra_patches: tuple[str, ...] = ()  # added to every backend's own (e.g. length_aware_lstm)
    counts: Counter = field(default_factory=Counter)
    target: str = "local"  # the target its items run on (targets.yaml; compile stays on this machine)
    cases_dirs: tuple[str, ...] = ()  # the user's cases, before the shipped ones (harness.cases.case_dirs)
    targets_file: str | None = None  # default: ./targets.yaml, then the user's config dir
    reuse_runs: bool = False  # judge a local run's saved outputs instead of running it again (run_cache)
    reuse_only: bool = False  # and never export, compile or run: what this cache does not hold is SKIPPED
    noise_k: int | None = None  # reference runs with other noise seeds for the noise band (harness.port.noise)
    described_artifacts: dict = field(default_factory=dict)  # artifact key -> its described ports (port chains)
    zero_noise_references: dict = field(default_factory=dict)  # case -> the decoder's audio with no noise (port.noise)
    _model: object = None
    _targets: dict = field(default_factory=dict)
    _browsers: dict = field(default_factory=dict)  # execution provider -> the run's SharedBrowser
    _traces: dict = field(default_factory=dict)
    _cases: dict | None = None

    @classmethod
    def from_config(cls, config) -> "Session":
        """The Session of a run configuration (harness.options.RunConfig), whichever face read it."""
        return cls(weights=config.weights, case_ids=list(config.case_ids) if config.case_ids else None,
                   report_dir=Path(config.report_dir), profile=Profile.load(config.profile),
                   limits=Limits.parse(list(config.time_limit), config.memory_limit),
                   extra_patches=tuple(config.with_patch), target=config.target, cases_dirs=config.cases_dirs,
                   targets_file=config.targets_file, reuse_runs=config.reuse_runs, reuse_only=config.reuse_only,
                   noise_k=config.noise_k)

    # -- lazily loaded state --------------------------------------------------------------
    @property
    def cases(self) -> dict[str, Case]:
        if self._cases is None:
            # each case checked whole before any work: one error naming the file and the field
            cases = load_cases(case_dirs(self.cases_dirs or configured_dirs()), only=self.case_ids,
                               vocab=load_vocab())
            self._cases = {c.id: c for c in cases}
        return self._cases

    @property
    def model(self):
        if self._model is None:
            self._model = load_model(self.weights)
        return self._model

    def traces(self, case_id: str):
        if case_id not in self._traces:
            self._traces[case_id] = load_traces(self.model, self.cases[case_id])
        return self._traces[case_id]

    def items(self, backends: list[str], steps: list[str] | None = None, modes=MODES) -> list[Item]:
        for s in steps or ():
            if s in {st.name for st in STAGES}:
                raise UsageError(f"--step {s}: a stage of the e2e item, not an item of its own; run --step e2e")
            if s not in ITEM_STEPS:
                raise UsageError(f"--step {s}: unknown step; steps: {', '.join(ITEM_STEPS)}")
        return [Item(c, s, b, m, self.target) for c in self.cases for s in (steps or ITEM_STEPS) for b in backends
                for m in modes]

    def target_for(self, name: str = "local"):
        """The target (harness.plumbing.targets), loaded once; an unknown one is a TargetError."""
        if name not in self._targets:
            target = get_target(name, self.targets_file)
            if target.kind == "browser":  # a page on the user's device (harness.backends.web_device)
                target = DeviceTarget(target.name, target.spec)
            self._targets[name] = target
        return self._targets[name]

    def close(self) -> None:
        """End the targets' connections, the warm worker (harness.plumbing.worker) and the run's browsers."""
        for t in self._targets.values():
            t.close()
        stop_worker()
        self.close_browsers()
        release_models()  # the reference models this process kept (about 1 GB)

    def close_browsers(self) -> None:
        """End the run's shared browsers (`shared_browser`); a later item starts one again."""
        for b in self._browsers.values():
            b.close()

    def shared_browser(self, backend: Backend, target) -> SharedBrowser | None:
        """The run's headless Chromium for a browser runtime's local run (one per execution
        provider: their flags differ), started on first use and again when the last one died;
        None for any other run, or when it cannot start (the run then starts its own)."""
        provider = browser_provider(backend) if target.kind == "local" else None
        if not provider:
            return None
        browser = self._browsers.setdefault(provider, SharedBrowser(webgpu=provider == "webgpu"))
        if browser.error:
            return None
        try:
            browser.ensure()
        except (OSError, RuntimeError) as e:
            browser.error = str(e)
            progress.say(f"kokoro-parity: no shared browser for {provider} ({e}); each run starts its own")
            return None
        return browser

    def patches_for(self, backend: Backend) -> list[str]:
        """The backend's own patches (less its patch-workarounds switched off: `--no-workaround`)
        and the session's extra ones, in the registry's order."""
        off = backend.workaround_patches_disabled()
        return list(canonical_patches((*(p for p in backend.patches if p not in off), *self.extra_patches)))

    def resolve(self, item: Item) -> Resolved:
        backend = get_backend(item.backend)
        step = None if item.step == "e2e" else get_step(item.step)
        return Resolved(item, step, self.cases[item.case], self.traces(item.case), backend, self.patches_for(backend))

    def new_record(self, item: Item, patches: list[str], backend: Backend | None) -> Record:
        return Record(item.case, item.step, item.backend, item.mode, Verdict.SKIPPED, patches=list(patches),
                      semantic_patches=[p for p in patches if not PATCHES[p].preserves_semantics],
                      model={"name": self.model.name, "digest": self.model.digest, "source": self.model.source},
                      versions=versions(backend), workarounds=workarounds_of(backend),
                      target={"name": getattr(item, "target", "local")})

    # -- one item -------------------------------------------------------------------------
    def run(self, item: Item) -> Record:
        record = self._run(item)
        return self.finish(record)

    def finish(self, record: Record) -> Record:
        record.write(self.report_dir / "records")
        self.counts[f"verdict_{record.verdict.value}"] += 1
        return_freed_memory()  # what the item allocated and freed, back to the system
        return record

    def _run(self, item: Item) -> Record:
        backend = get_backend(item.backend)
        rec = self.new_record(item, self.patches_for(backend), backend)
        remote_compile = backend.compile_where == "target" and getattr(item, "target", "local") != "local"
        ok, why = (True, "") if remote_compile else self.target_for(item.target).available(backend)
        if not ok:
            rec.reason = why
            return rec
        r = self.resolve(item)
        if item.step == "e2e":  # the harness's own two-stage port, through harness.port.chain.run_chain
            return run_e2e(self, r, rec)
        outputs = self.execute(backend, item.step, r.traces.inputs(item.step, item.mode, "float32"), r.patches, rec,
                               item.id)
        if outputs is None:
            return rec

        with progress.phase("judging"):
            return self.judge(rec, r, outputs)

    # -- export, compile, run ---------------------------------------------------------------
    def execute(self, backend: Backend, step: str, inputs: dict, patches: list[str], rec: Record,
                run_name: str, tag: str = "") -> list | None:
        """Export (cached), compile (cached) and run `step` on `inputs`. Fills the record's timings,
        cache and audit (keys prefixed with `tag`); on failure sets its verdict and returns None."""
        target = self.target_for(rec.target.get("name") or "local")
        if self.reuse_runs and target.kind == "local":
            saved = self.saved_run(backend, step, inputs, patches, rec, run_name, tag)
            if saved is not None:
                return saved
        program_dir, program_key = self.program(step, inputs, patches, rec, tag)
        if program_dir is None:
            return None
        on_target = backend.compile_where == "target" and target.kind != "local"
        if on_target:  # compiled where it runs (TVM Metal, ExecuTorch MPS): the target must take it first
            ok, why = target.runnable(backend)
            rec.target.update(target.describe())
            if not ok:
                rec.verdict, rec.reason = Verdict.SKIPPED, f"not compiled: compiles on the target; {why}"
                return None
        over = self.over_budget(backend, step, program_dir, program_key, here=target.kind == "local")
        if over:
            rec.verdict, rec.reason = Verdict.SKIPPED, over
            return None
        if target.kind == "local" and target.runnable(backend)[0]:
            target.prestart(run_preload(backend))  # the run's process imports while the compile runs
        artifact_dir = self.artifact(backend, step, program_dir, program_key, rec, tag, target if on_target else None)
        if artifact_dir is None:
            return None
        ok, why = target.runnable(backend)  # on a remote target: its probe (reachable, package, OS)
        rec.target.update(target.describe())
        if not ok:  # compiled (its outcome and audit recorded), cannot run on this machine / that target
            skip_compiled_not_run(rec, why)
            return None
        return self.run_artifact(backend, artifact_dir / backend.artifact_name, inputs, rec, run_name, tag)

    def program(self, step: str, inputs: dict, patches: list[str], rec: Record,
                tag: str = "") -> tuple[Path | None, str]:
        """The step's exported program (harness.programs: the one program key, shared with bisection)."""
        if self.reuse_only and cache.lookup("programs", program_key(step, inputs, patches, self.model.digest)[0]) is None:
            return self.not_warm(rec, "export", step), ""
        entry, key, result = ensure_program(self.weights, self.model.digest, step, inputs, patches,
                                            self.limits.export_s, self.counts)
        rec.cache[f"{tag}program"] = "hit" if result is None else "miss"
        if result is not None:
            rec.timings[f"{tag}export_s"] = result.seconds
            rec.peak_rss_mb[f"{tag}export"] = result.peak_rss_mb
            if not result.ok:
                failed(rec, result, Verdict.EXPORT_ERROR)
                return None, key
        return entry, key

    def over_budget(self, backend: Backend, step: str, program_dir: Path, program_key: str, here: bool) -> str:
        """Why this program is not compiled (nor run) at all, or "": a cost law of the backend
        (harness.backends.cost) estimates its compile time, compile memory or run time past the
        limit. The laws were measured on this kind of machine: they judge only what runs `here`
        (a remote target's compile, or its run, is its own). An artifact already in the cache is
        never skipped for its compile: it costs nothing."""
        compiles_here = here or backend.compile_where != "target"
        laws = ((backend.compile_time if compiles_here else None, self.limits.compile_s, "compile",
                 "--time-limit compile=SECONDS"),
                (backend.compile_memory if compiles_here else None, self.limits.memory_gb(), "compile memory",
                 "--memory-limit GB"),
                (backend.run_time if here else None, self.limits.run_s, "run", "--time-limit run=SECONDS"))
        if not any(law for law, *_ in laws) or not (program_dir / "result.json").exists():
            return ""
        compiled = cache.lookup("artifacts", backend.artifact_key(program_key)) is not None
        sizes = program_sizes(program_dir, step)
        for law, limit, what, flag in laws:
            size = sizes.get(law.size) if law else None
            if not size or (compiled and what != "run"):
                continue
            estimate = law.estimate(size)
            if estimate > limit:
                need, has = (_amount(estimate, law.unit), _amount(limit, law.unit))
                verb = "take" if law.unit == "s" else "need"
                return (f"not {'run' if what == 'run' else 'compiled'}: {backend.name}'s {what} {law.describe()}, "
                        f"so this program's {size:,.{0 if size >= 100 else 1}f} {law.size} would {verb} about {need}, "
                        f"over the {what} limit of {has} ({flag} to try)")
        return ""

    def artifact(self, backend: Backend, step: str, program_dir: Path, program_key: str, rec: Record,
                 tag: str = "", target=None) -> Path | None:
        """The backend's compiled artifact (once per program and backend version); with a remote
        `target`, compiled there (`compile_where = "target"`) and cached here per target."""
        key = backend.artifact_key(program_key)
        here = {"audit_dir": str(program_dir / "audits")} if target is None else {}  # the op audit, kept by program
        make = lambda tmp: dict(backend=backend.name, program_path=str(program_dir / "program.pt2"),  # noqa: E731
                                out_dir=str(tmp), **here)
        to_build = target is not None or cache.lookup("artifacts", key) is None
        if to_build and self.reuse_only:
            return self.not_warm(rec, "compile", step)
        with progress.phase(f"lowering {tag}".strip("_. "), active=to_build):
            if target is None:
                entry, result = cached_job("artifacts", key, "harness.backends:compile_job", self.limits.compile_s,
                                           make, self.counts, admission_key=f"compile/{backend.name}/{step}",
                                           runner=COMPILER.runner(backend.name))
            else:
                entry, result = compile_on_target(target, backend, key, make, self.limits.compile_s, self.counts)
        rec.cache[f"{tag}artifact"] = "hit" if result is None else "miss"
        if result is not None:
            self.counts["compiles"] += 1
            cached = (result.value or {}).get("audit_cached")
            if cached is not None:
                self.counts["audits_hits" if cached else "audits_misses"] += 1
            rec.timings[f"{tag}compile_s"] = result.seconds
            if result.extra.get("admission_wait_s"):
                rec.timings[f"{tag}compile_wait_s"] = result.extra["admission_wait_s"]
            rec.peak_rss_mb[f"{tag}compile"] = result.peak_rss_mb
            if not result.ok:
                rec.audit.update((result.value or {}).get("audit", {}))  # the op audit made before compiling
                failed(rec, result, Verdict.COMPILE_ERROR)
                return None
        meta = json.loads((entry / "result.json").read_text())["value"]
        rec.audit.update(meta["audit"])
        rec.artifact_bytes = (rec.artifact_bytes or 0) + meta["artifact_bytes"]
        return entry

    def saved_run(self, backend: Backend, step: str, inputs: dict, patches: list[str], rec: Record,
                  run_name: str, tag: str = "") -> list | None:
        """With `reuse_runs`: the saved outputs of this step's last local run, found by its keys
        alone, so that a warm re-run needs neither the program nor the artifact in the cache (nearly
        all of its bytes: a matrix's fill the 40 GiB default, its runs 100 MB). The artifact's
        audit and size come with the saved run. None when no run was saved: export, compile, run."""
        key, _ = program_key(step, inputs, patches, self.model.digest)
        artifact_path = cache.entry("artifacts", backend.artifact_key(key)) / backend.artifact_name
        reused = self.reused_run(backend, run_cache.run_key(artifact_path, list(inputs.values() if isinstance(
            inputs, dict) else inputs), backend.name), inputs, rec, run_name, tag)
        if reused is None:
            return None
        outputs, saved = reused
        entry = cache.lookup("artifacts", artifact_path.parent.name)
        compiled = saved.get("artifact") or (
            json.loads((entry / "result.json").read_text())["value"] if entry is not None else None)
        rec.cache[f"{tag}program"] = "not needed"
        rec.cache[f"{tag}artifact"] = "not needed" if compiled else "evicted"  # evicted: no audit kept
        if compiled:
            rec.audit.update(compiled.get("audit") or {})
            rec.artifact_bytes = (rec.artifact_bytes or 0) + compiled.get("artifact_bytes", 0)
        return outputs

    def not_warm(self, rec: Record, work: str, what: str) -> None:
        """`reuse_only` (`--reuse-only`): the item is SKIPPED where it would have to do `work`."""
        rec.verdict = Verdict.SKIPPED
        rec.reason = (f"not warm: {what} would {work} here; --reuse-only judges only the saved runs, programs "
                      f"and artifacts this cache holds")

    def run_inputs(self, backend: Backend, inputs, run_name: str, write: bool = True) -> tuple[Path, bool]:
        """(a run's directory of the report, numpy files?), its inputs written there. An ONNX
        artifact runs in a child without torch (its import cost more than the run)."""
        run_dir = self.report_dir / "runs" / run_name
        onnx = (getattr(backend, "kind", None) == "onnx" and backend.name.startswith("prebuilt:")
                and getattr(backend, "runtime", NATIVE) == NATIVE)  # a browser runtime: the backend's job
        if write and onnx:
            save_arrays(run_dir / "inputs.npz", [canonical(t).detach().cpu().numpy() for t in inputs])
        elif write:
            save_tensors(run_dir / "inputs.pt", inputs)
        return run_dir, onnx

    def reused_run(self, backend: Backend, key: str | None, inputs, rec: Record, run_name: str,
                   tag: str = "") -> tuple[list, dict] | None:
        """(outputs, the stored run's figures) of the saved local run `key` (run_cache.run_key of an
        artifact and its inputs) with `reuse_runs`, or None. Fills the record's run figures as the run had."""
        if not key or not self.reuse_runs:
            return None
        run_dir, onnx = self.run_inputs(backend, inputs, run_name, write=False)
        saved = run_cache.load(key, run_dir / f"outputs{'.npz' if onnx else '.pt'}")
        if saved is None:
            return None
        self.run_inputs(backend, inputs, run_name)  # the report keeps what the run was given, as a run's
        self.counts["runs_reused"] += 1
        rec.cache[f"{tag}run"] = "hit"
        rec.timings.update({f"{tag}{k}": v for k, v in saved["timings"].items()})
        rec.peak_rss_mb[f"{tag}run"] = saved["peak_rss_mb"]
        rec.audit.update(saved.get("audit") or {})
        return self._outputs(run_dir, onnx), saved

    def prebuilt(self, path, rec: Record, run_dir: Path, tag: str = "", where: str = "",
                 runtime: str = NATIVE) -> "Prebuilt | None":
        """A user's file made ready to run on `runtime` (harness.backends.prebuilt.RUNTIMES), the same
        sequence for an `--artifact`, a port's stage and a whole-model file: available, its declared
        ports read (once per content and session), copied into the artifact cache (its "compile"),
        runnable here. None with the record's verdict and reason set (prefixed by `where`) when one
        of them fails: a runtime missing here (no Chromium, no WebGPU adapter) is SKIPPED, saying why."""
        backend = PrebuiltBackend(path, runtime)
        if runtime != NATIVE:  # the record names where the file ran, even when it could not
            rec.audit[f"{tag}runtime"] = runtime
        target = self.target_for(rec.target.get("name") or "local")
        ok, why = target.available(backend)
        if not ok:
            rec.verdict, rec.reason = Verdict.SKIPPED, f"{where}{why}"
            return None
        declared = self.declared_ports(backend, run_dir)
        if not declared.ok:
            failed(rec, declared, Verdict.RUN_ERROR)
            rec.reason = f"{where}cannot read {backend.path.name}: {rec.reason}"
            return None
        entry, result = cached_job("artifacts", backend.artifact_key(), "harness.backends:compile_job",
                                   self.limits.compile_s,
                                   lambda tmp: dict(backend=backend.name, program_path=str(backend.path),
                                                    out_dir=str(tmp)), self.counts)
        rec.cache[f"{tag}artifact"] = "hit" if result is None else "miss"
        if result is not None and not result.ok:
            failed(rec, result, Verdict.COMPILE_ERROR)
            return None
        rec.artifact_bytes = max(rec.artifact_bytes or 0, size_of(backend.path))
        ok, why = target.runnable(backend) if target.kind == "browser" else backend.runnable()
        if not ok:
            rec.verdict, rec.reason = Verdict.SKIPPED, f"{where}{why}"
            return None
        return Prebuilt(backend, *ports_from_job(declared.value), entry / backend.artifact_name)

    def declared_ports(self, backend, run_dir: Path):
        """An artifact's declared inputs and outputs (a job result), once per artifact content and
        session (a stage's local and chained runs share it): an ONNX read here, a protobuf parse
        that a port's validation already made (memoized); other formats in a child, since a
        runtime's loader can crash on a corrupted file."""
        key = backend.artifact_key()
        if key in self.described_artifacts:
            return self.described_artifacts[key]
        if backend.kind == "onnx":
            try:
                result = JobResult("ok", value=describe_as_json(backend.path))
            except Exception as e:  # noqa: BLE001 - the same error a child would report
                result = JobResult("error", error=f"{type(e).__name__}: {e}".splitlines()[0])
        else:
            result = run_job("harness.backends.prebuilt:describe_job", dict(path=str(backend.path)),
                             run_dir / "describe", self.limits.run_s)
        if result.ok:
            self.described_artifacts[key] = result
        return result

    def run_artifact(self, backend: Backend, artifact_path: Path, inputs: dict, rec: Record, run_name: str,
                     tag: str = "") -> list | None:
        """Run a compiled artifact on `inputs` in a child process. Its outputs are saved in the cache
        and, with `reuse_runs`, a local run whose artifact and inputs were run before is not run again."""
        target = self.target_for(rec.target.get("name") or "local")
        key = run_cache.run_key(artifact_path, list(inputs.values() if isinstance(inputs, dict) else inputs),
                                 backend.name) if target.kind == "local" else None
        reused = self.reused_run(backend, key, inputs, rec, run_name, tag)
        if reused is not None:
            return reused[0]
        if self.reuse_only:
            return self.not_warm(rec, "run", run_name)
        run_dir, onnx = self.run_inputs(backend, inputs, run_name)
        ext = ".npz" if onnx else ".pt"
        shared = None if onnx else self.shared_browser(backend, target)

        try:  # on a remote target the artifact is shipped (once per content), the inputs and outputs per run
            with progress.phase(f"running {tag}".strip("_. ")):
                result = target.run_job("harness.backends.onnx_child:run_onnx_job" if onnx else
                                        "harness.backends:run_artifact_job",
                                        dict(**({} if onnx else dict(backend=backend.name)),
                                             artifact_path=str(artifact_path),
                                             inputs_path=str(run_dir / f"inputs{ext}"),
                                             outputs_path=str(run_dir / f"outputs{ext}"),
                                             **({"browser": shared.endpoint} if shared else {})),
                                        run_dir, self.limits.run_s,
                                        files=dict(artifact_path="artifact_entry", inputs_path="input",
                                                   outputs_path="output"), warm=onnx,
                                        preload=None if onnx else run_preload(backend))
        except TargetUnreachable as e:
            if target.kind == "browser":  # the device's page that said it cannot (its adapter)
                rec.target.update(target.describe())
            skip_compiled_not_run(rec, f"target {target.name!r} unreachable: {e}")
            return None
        self.counts["runs"] += 1
        rec.timings[f"{tag}run_s"] = result.value["run_s"] if result.ok else result.seconds
        rec.timings[f"{tag}run_job_s"] = result.seconds
        if "transport_s" in result.extra:  # shipping, ssh and the remote Python's start, beyond the job itself
            rec.timings[f"{tag}transport_s"] = result.extra["transport_s"]
        rec.peak_rss_mb[f"{tag}run"] = result.peak_rss_mb
        rec.target.update(result.extra.get("device_target") or {})  # a device's page: its user agent and adapter
        if not result.ok:
            failed(rec, result, Verdict.RUN_ERROR)
            if shared:  # the pages the child left, a browser that stopped answering (restarted next time)
                rec.audit["browser"] = self.shared_about(shared, {"shared": True, "launched_by": "session"})
                shared.tidy()
            return None
        rec.audit.update(result.value.get("audit") or {})
        if shared and (rec.audit.get("browser") or {}).get("shared"):
            rec.audit["browser"] = self.shared_about(shared, rec.audit["browser"])
        if key:
            rec.cache[f"{tag}run"] = "miss"
            compiled = artifact_path.parent / "result.json"  # the artifact's audit and size, for saved_run
            compiled = (json.loads(compiled.read_text()).get("value") or {}) if compiled.exists() else {}
            run_cache.store(key, run_dir / f"outputs{ext}", {
                "timings": {k: rec.timings[f"{tag}{k}"] for k in ("run_s", "run_job_s")},
                "peak_rss_mb": result.peak_rss_mb, "audit": result.value.get("audit") or {},
                "artifact": {k: compiled[k] for k in ("audit", "artifact_bytes") if k in compiled}})
        return self._outputs(run_dir, onnx)

    @staticmethod
    def shared_about(browser: SharedBrowser, about: dict) -> dict:
        """A run's `browser` audit with the shared browser's process and how many the run started."""
        return {**about, "pid": browser.pid, "browsers_started": browser.launches}

    @staticmethod
    def _outputs(run_dir: Path, onnx: bool) -> list:
        if onnx:
            return [torch.from_numpy(a) for a in load_arrays(run_dir / "outputs.npz")]
        return torch.load(run_dir / "outputs.pt", weights_only=True)

    # -- judging ------------------------------------------------------------------------------
    def judge(self, rec: Record, r: Resolved, outputs: list) -> Record:
        """Fill the record's metrics, drifts, audio and verdict from the item's outputs."""
        item, traces = r.item, r.traces
        rec.precision = precision_of(r.backend)  # a float16 backend is judged by the float16 floor
        refs = references_for(self.model, r.case, traces, item.step, item.mode, rec.patches, rec.precision)
        names = r.step.output_names
        valid = lambda name, t: traces.valid_region(item.step, name, t)  # noqa: E731
        audio_names = [t.name for t in r.step.outputs if "samples" in t.axes.values()]
        j = judge_outputs(names, outputs, refs, valid, self.profile.for_(item.step, item.backend, item.mode),
                          audio=lambda: audio_metrics_of(audio_names, dict(zip(names, outputs)), refs.fp64, valid),
                          precision=rec.precision)
        rec.metrics, rec.patch_drift, rec.rewrite_drift = j.metrics, j.patch_drift, j.rewrite_drift
        rec.audio_metrics, rec.verdict, rec.reason = j.audio_metrics, j.verdict, j.reason
        rec.shippable, rec.shippable_reason = j.shippable, j.shippable_reason
        if j.audio_metrics:
            audio_s = max(a.get("duration_s", 0) for a in j.audio_metrics.values())
            rec.real_time = real_time(rec.timings.get("run_s"), audio_s)

            wavs = {n: (refs.fp64[n], out) for n, out in zip(names, outputs) if n in audio_names}
            rec.audio.update(write_audio(self.report_dir, item.id, wavs, valid))
        return rec


@dataclass(frozen=True)
class Prebuilt:
    """A user's file ready to run (`Session.prebuilt`): its declared ports and its cached copy."""

    backend: Backend
    inputs: list  # harness.backends.prebuilt.Port, in the artifact's order
    outputs: list | None  # None when the format does not declare them
    path: Path  # the copy in the artifact cache, what runs


def run_preload(backend: Backend) -> dict:
    """What a local run job's process imports before its job arrives (harness.plumbing.worker)."""
    return {"function": "harness.backends:prepare_run", "kwargs": {"backend": backend.name}}


def audio_metrics_of(names: list[str], outputs: dict, reference: dict, valid) -> dict:
    """PESQ, MCD and friends for the outputs along `samples` (valid region, against float64)."""
    out = {}
    for name in names:
        ref = valid(name, reference[name])[0].double().numpy()
        out[name] = {**audio_metrics(ref, valid(name, outputs[name])[0].double().numpy()),
                     "duration_s": len(ref) / SAMPLE_RATE}
    return out


def workarounds_of(backend: Backend | None) -> dict[str, list[str]]:
    """The backend's named workarounds (harness.backends.Workaround) applied and switched off."""
    if backend is None or not backend.workarounds:
        return {}
    off = backend.disabled_workarounds()
    return {"applied": sorted(set(backend.workarounds) - off), "disabled": sorted(off)}
