"""A probe: one subprogram of the step, compiled and run on the backend, each output judged
against the same subprogram's fp32 and fp64 values (torch's noise-floor rule, per node).

Probes go through the same child-process jobs and the same artifact cache as items (keyed by the
backend's `artifact_key`), so a probe compiled for one fault or item is reused by the next. Inside
`probe_worker()` (a whole localization) the jobs run one after another in one worker process.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..metrics.tensor import compare_to_floor
from ..plumbing import cache
from ..plumbing.files import atomic_write_json, canonical, content_key, save_tensors
from ..plumbing.jobs import JobResult, run_job
from ..plumbing.worker import JobProcess
from .graph import BisectError, evaluate, restore_names

BISECT_VERSION = 7  # bump when carving or exporting probes changes: it invalidates cached probes
PROBE_METRICS = (  # what a probe keeps of each output's metrics
    "rel_l2", "floor_rel_l2", "floor_ratio", "max_abs", "cosine", "nan_rate", "new_nonfinite")
NO_ANSWER = ("compile_error", "run_error", "crashed", "timeout")  # statuses of a probe that did not run


def key_metrics(m: dict) -> dict:
    return {k: m[k] for k in PROBE_METRICS if k in m}


@dataclass
class Probe:
    """What one probe did and found. `status`: pass, fail, or one of NO_ANSWER."""

    phase: str  # module | bisect | local | window
    label: str
    outputs: list[str]
    inputs: list[str]
    n_ops: int
    key: str
    status: str = ""
    why: str = ""
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    failing: list[str] = field(default_factory=list)
    compile: str = "miss"
    seconds: float = 0.0
    timing: dict[str, float] = field(default_factory=dict)
    log: str = ""
    fed: list[str] = field(default_factory=list)  # inputs fed the backend's own values (`run_probe(feed=)`)
    values: dict[str, Any] = field(default_factory=dict, repr=False)  # what the backend returned; not saved

    @property
    def ran(self) -> bool:
        return self.status in ("pass", "fail")

    def diverges(self, errors_count: bool) -> bool | None:
        """True (diverges), False (matches) or None (no answer). With `errors_count`, a probe that
        does not compile or run is itself the failure being localized (an item that did not
        compile); otherwise it says nothing about values (an item whose values were wrong)."""
        if self.ran:
            return self.status == "fail"
        if self.status == "compiled":  # compiled, cannot run here (Core ML off macOS): no value to judge
            return False if errors_count else None
        return True if errors_count else None

    def summary(self) -> dict:
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("outputs", "key", "values")}
        return {k: v for k, v in own.items() if v not in ("", {}, [])}


def export_probe(graph, outputs: list[str], stop) -> tuple[Any, list[str], list, str, Path]:
    """Carve and export the subprogram (cached by content): (carved gm, input names, input values,
    key, cache entry with program.pt2 and inputs.pt)."""
    gm, in_names = graph.carve(outputs, stop)
    # canonical strides, for export too: a value the interpreter left as a transposed view ([1, N, 1]
    # with strides (N, 1, N)) exports with a non-standard dim order that ExecuTorch's own kernels
    # then reject ("different dim orders"; XNNPACK: "Propagating input shapes failed")
    inputs = [canonical(t) for t in graph.values32(in_names)]
    key = content_key("bisect-probe", BISECT_VERSION, graph.program_key, outputs, in_names)

    def build(tmp: Path) -> None:
        with torch.no_grad():
            program = torch.export.export(gm, tuple(inputs), strict=False)
        if not restore_names(program, gm):
            raise BisectError("export renamed nodes beyond recovery")
        torch.export.save(program, str(tmp / "program.pt2"))
        save_tensors(tmp / "inputs.pt", inputs)
        atomic_write_json(tmp / "probe.json", {"outputs": outputs, "inputs": in_names})

    try:
        entry, _ = cache.get_or_build("bisect", key, build)
    except Exception as e:  # noqa: BLE001 - the harness's own limit, reported as such
        raise BisectError(f"cannot export the subprogram ending in {outputs[-1]}: {type(e).__name__}: {e}") from e
    return gm, in_names, inputs, key, entry


PROBES_PER_PROCESS = 12  # a worker that lowered this many probes is replaced (its memory grows)
_WORKER: JobProcess | None = None
_PAGE = None  # a browser target (web_device.DeviceTarget) whose page runs the probes: the item ran there
RUN_JOB = "harness.backends:run_artifact_job"


@contextlib.contextmanager
def probe_worker(page=None):
    """One process for a localization's probe jobs. A fresh child per probe paid torch's and the
    runtime's imports each time (coremltools about 8 s, ExecuTorch 6 s) for a compile of a few
    seconds; the worker pays them once. Isolation stays a job's (harness.plumbing.worker): a
    probe that crashes its process or outlives its limit is that probe's outcome, and the next
    probe starts a new process. `page`: the browser target of an item that ran on the user's
    device; each probe compiles here and runs on that page, as the item did."""
    global _WORKER, _PAGE
    (outer, _WORKER), (outer_page, _PAGE) = (_WORKER, JobProcess(max_jobs=PROBES_PER_PROCESS)), (_PAGE, page)
    try:
        yield
    finally:
        _WORKER.stop()
        _WORKER, _PAGE = outer, outer_page


def _probe_job(function: str, kwargs: dict, workdir: Path, timeout: float) -> JobResult:
    if _WORKER is None:
        return run_job(function, kwargs, workdir, timeout)
    return _WORKER.run_job(function, kwargs, workdir, timeout)


def compile_and_run(backend, probe_key: str, entry: Path, run_dir: Path, limits,
                    inputs_path: Path | None = None) -> tuple[str | None, Any, bool]:
    """Compile (through the artifact cache) and run, in child processes; on a cache miss both
    happen in one child, which halves the interpreter start-ups of a bisection. Runs on the
    probe's own inputs unless `inputs_path` is given. Returns (the phase that failed or None,
    JobResult, compiled now?)."""
    key = backend.artifact_key(probe_key)
    outputs_path = run_dir / "outputs.pt"
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs_path.unlink(missing_ok=True)
    run_kwargs = dict(backend=backend.name, inputs_path=str(inputs_path or entry / "inputs.pt"),
                      outputs_path=str(outputs_path))
    if _PAGE is not None and _PAGE.runnable(backend)[0]:  # an onnxruntime-web probe (not a band's backend)
        return _run_on_page(backend, probe_key, entry, run_dir, limits, run_kwargs)
    if cache.lookup("artifacts", key):
        result = _probe_job(RUN_JOB,
                         dict(run_kwargs, artifact_path=str(cache.entry("artifacts", key) / backend.artifact_name)),
                         run_dir, limits.run_s)
        return (None if result.ok else "run"), result, False
    outcome = {}

    def build(tmp: Path) -> None:
        outcome["result"] = _probe_job("harness.backends:compile_run_job",
                                    dict(run_kwargs, program_path=str(entry / "program.pt2"), out_dir=str(tmp)),
                                    tmp, limits.compile_s + limits.run_s)
        if not (tmp / "compiled.json").exists():
            raise _NotCompiled()  # nothing to cache

    try:
        cache.get_or_build("artifacts", key, build)
    except _NotCompiled:
        return "compile", outcome["result"], True
    result = outcome["result"]
    return (None if result.ok else "run"), result, True


class _NotCompiled(Exception):
    pass


def _run_on_page(backend, probe_key: str, entry: Path, run_dir: Path, limits, run_kwargs: dict):
    """`compile_and_run` for an item on a browser target: compiled here, run on the device's page."""
    failed, result, compiled = compile_only(backend, probe_key, entry, limits)
    if failed:
        return failed, result, compiled
    artifact = cache.entry("artifacts", backend.artifact_key(probe_key)) / backend.artifact_name
    result = _PAGE.job_or_error(RUN_JOB, dict(run_kwargs, artifact_path=str(artifact)), run_dir, limits.run_s)
    return (None if result.ok else "run"), result, compiled


def compile_only(backend, probe_key: str, entry: Path, limits) -> tuple[str | None, Any, bool]:
    """For a backend that compiles here but cannot run (`Backend.runnable`): compile through the
    artifact cache in a child process, no run. Returns (the phase that failed or None, JobResult
    or None on a cache hit, compiled now?)."""
    key = backend.artifact_key(probe_key)
    if cache.lookup("artifacts", key):
        return None, None, False
    outcome = {}

    def build(tmp: Path) -> None:
        outcome["result"] = _probe_job("harness.backends:compile_job",
                                    dict(backend=backend.name, program_path=str(entry / "program.pt2"),
                                         out_dir=str(tmp)), tmp, limits.compile_s)
        if not outcome["result"].ok:
            raise _NotCompiled()

    try:
        cache.get_or_build("artifacts", key, build)
    except _NotCompiled:
        return "compile", outcome["result"], True
    return None, outcome["result"], True


def run_probe(graph, backend, check, limits, run_root: Path, phase: str, label: str, outputs: list[str],
              stop=(), feed: dict | None = None) -> Probe:
    """Compile and run the subprogram computing `outputs` (inputs: `stop`) on the backend, and
    judge each output with `check` against its own fp32/fp64 references.

    `feed`: values for the subprogram's inputs that the backend itself computed (a tapped run's
    outputs); the outputs then carry the error made before them and are judged against the step's
    references, as if the whole prefix had run, without compiling it. The outputs stay in
    `Probe.values` (not serialized), for the next probe's feed."""
    start = time.monotonic()
    gm, in_names, inputs, key, entry = export_probe(graph, outputs, stop)
    probe = Probe(phase, label, list(outputs), in_names, sum(1 for n in gm.graph.nodes if n.op == "call_function"), key)
    probe.timing["export_s"] = round(time.monotonic() - start, 2)
    run_dir = run_root / key[:16]
    runnable, not_here = backend.runnable()
    fed_path = None
    if feed and runnable:
        probe.fed = sorted(set(feed) & set(in_names))
        fed_path = run_dir / "fed_inputs.pt"
        run_dir.mkdir(parents=True, exist_ok=True)
        save_tensors(fed_path, [canonical(feed[n]) if n in feed else x for n, x in zip(in_names, inputs)])
    if runnable:
        failed, result, compiled = compile_and_run(backend, key, entry, run_dir, limits, fed_path)
    else:
        failed, result, compiled = compile_only(backend, key, entry, limits)
    probe.timing["compile_run_s"] = round(result.seconds, 2) if result is not None else 0.0
    probe.compile = "miss" if compiled else "hit"
    if not failed and not runnable:
        probe.status, probe.why = "compiled", f"compiled; {not_here}"
    elif failed:
        probe.status = {"crashed": "crashed", "timeout": "timeout"}.get(result.status, f"{failed}_error")
        probe.why = f"{failed}: {result.error}"
        probe.log = "\n".join(result.log_tail.splitlines()[-8:])
    else:
        got = torch.load(run_dir / "outputs.pt", weights_only=True)
        (run_dir / "outputs.pt").unlink()
        if len(got) != len(outputs):
            probe.status, probe.why = "run_error", f"run: {len(got)} outputs, expected {len(outputs)}"
        else:
            if fed_path or all(name in graph.inputs for name in in_names):  # the step's own references
                refs = graph.values(outputs, "float32"), graph.values(outputs, "float64")
            else:
                refs = evaluate(gm, inputs, "float32"), evaluate(gm, inputs, "float64")
            _judge(probe, got, refs, check)
            probe.values = dict(zip(outputs, got))
    probe.seconds = round(time.monotonic() - start, 2)
    return probe


def _judge(probe: Probe, got: list, refs: tuple[list, list], check) -> None:
    ref32, ref64 = refs
    whys = []
    for name, out, r32, r64 in zip(probe.outputs, got, ref32, ref64):
        if tuple(out.shape) != tuple(r64.shape):
            probe.failing.append(name)
            whys.append(f"{name}: shape {tuple(out.shape)} != {tuple(r64.shape)}")
            continue
        if not r64.is_floating_point():  # an integer or boolean value (a probe of an error search): exact
            if not torch.equal(out.to(r64.dtype), r64):
                probe.failing.append(name)
                whys.append(f"{name}: {r64.dtype} values differ")
            continue
        m = compare_to_floor(out, r32, r64)
        probe.metrics[name] = key_metrics(m)
        ok, why = check(m)
        if not ok:
            probe.failing.append(name)
            whys.append(f"{name}: {why}")
    probe.status, probe.why = ("fail" if probe.failing else "pass"), "; ".join(whys)
