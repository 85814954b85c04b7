"""Where an ExecuTorch lowering spends its time and memory, phase by phase (issue 9).

For one step of a shipped case it does the harness's own work in this process: the export job
(`harness.programs.export_step`, with the backend's patches), then what `compile_job` does for
the backend (`audit`, then `compile`). Probes wrap the phase functions of torch.export and
ExecuTorch (decompositions, edge conversion, verification, partitioning, XNNPACK preprocess,
memory planning, emit, serialization), so the figures are those of the code the harness runs.

Each probe records calls, wall seconds (inclusive, and self = without the probes inside it), peak
RSS growth (peak RSS while it ran minus RSS when it started; RSS is sampled from /proc/self/statm
by a thread every 10 ms, plus at each phase boundary) and the size of the graph it returns.
Each step runs in a child process of its own, so its memory figures start from a fresh process.

    flock /tmp/kokoro-parity-heavy.lock .venv/bin/python benchmarks/profile_lowering.py \
        --step duration_encoder --step f0n --case en_short --mode static
"""
from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from harness.plumbing.files import atomic_write_json  # noqa: E402

_PAGE = os.sysconf("SC_PAGE_SIZE")


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


@dataclass
class PhaseStat:
    name: str
    parent: str
    depth: int
    order: int
    calls: int = 0
    total_s: float = 0.0
    self_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time (all threads), less sensitive than wall time to other load
    peak_rss_growth_mb: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)  # what the last call returned (graph size)


@dataclass
class _Frame:
    name: str
    start: float
    cpu0: float
    rss0: float
    peak: float
    child_s: float = 0.0


class Profiler:
    """Nested wall-clock and RSS probes. A phase is keyed by (parent, name), so the same function
    called from two places (run_decompositions in the audit and in to_edge) gets two rows."""

    def __init__(self, interval_s: float = 0.01):
        self.stats: dict[tuple[str, str], PhaseStat] = {}
        self._stack: list[_Frame] = []
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> "Profiler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            rss = current_rss_mb()
            for frame in list(self._stack):
                frame.peak = max(frame.peak, rss)

    @contextlib.contextmanager
    def phase(self, name: str):
        rss = current_rss_mb()
        parent = self._stack[-1].name if self._stack else ""
        frame = _Frame(name, time.perf_counter(), time.process_time(), rss, rss)
        self._stack.append(frame)
        key = (parent, name)
        stat = self.stats.get(key) or self.stats.setdefault(key, PhaseStat(name, parent, len(self._stack) - 1, len(self.stats)))
        try:
            yield stat
        finally:
            seconds = time.perf_counter() - frame.start
            self._stack.pop()
            frame.peak = max(frame.peak, current_rss_mb())
            stat.calls += 1
            stat.total_s += seconds
            stat.self_s += seconds - frame.child_s
            stat.cpu_s += time.process_time() - frame.cpu0
            stat.peak_rss_growth_mb = max(stat.peak_rss_growth_mb, frame.peak - frame.rss0)
            if self._stack:
                self._stack[-1].child_s += seconds

    def wrap(self, owner: Any, attr: str, name: str | Callable[..., str],
             describe: Callable[[Any], dict] | None = None) -> Callable[[], None]:
        """Replace `owner.attr` (function, static/class method or property) by a probed one;
        returns the function that puts the original back."""
        raw = inspect.getattr_static(owner, attr)
        own = attr in vars(owner) if isinstance(owner, type) else True
        if isinstance(raw, (staticmethod, classmethod)):
            fn, rewrap = raw.__func__, type(raw)
        elif isinstance(raw, property):
            fn, rewrap = raw.fget, property
        else:
            fn, rewrap = raw, (lambda f: f)
        profiler = self

        def probed(*args, **kwargs):
            label = name(*args, **kwargs) if callable(name) else name
            with profiler.phase(label) as stat:
                result = fn(*args, **kwargs)
                if describe is not None:
                    stat.result = describe(result)
                return result

        probed.__wrapped__ = fn
        setattr(owner, attr, rewrap(probed))

        def restore() -> None:
            if own:
                setattr(owner, attr, raw)
            else:
                delattr(owner, attr)

        return restore

    def rows(self) -> list[PhaseStat]:
        return sorted(self.stats.values(), key=lambda s: s.order)


# ---- what a phase returns -------------------------------------------------------------------

def graph_size(result: Any) -> dict:
    """Call-function nodes (with LSTM and delegate-call counts) of a program-like result."""
    import torch

    programs = list(result.values()) if isinstance(result, dict) else [result]
    graphs = []
    for p in programs:
        if hasattr(p, "exported_program") and callable(p.exported_program):
            p = p.exported_program()
        gm = getattr(p, "graph_module", p)
        if isinstance(gm, torch.fx.GraphModule):
            graphs.append(gm)
    if not graphs:
        return {}
    ops: Counter = Counter()
    for gm in graphs:
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return {"nodes": sum(ops.values()),
            "lstm_nodes": sum(v for k, v in ops.items() if "lstm" in k),
            "delegate_calls": sum(v for k, v in ops.items() if "executorch_call_delegate" in k),
            "top_ops": dict(ops.most_common(4))}


def partition_count(result: Any) -> dict:
    return {"partitions": len(getattr(result, "partition_tags", None) or {})}


def byte_count(result: Any) -> dict:
    data = getattr(result, "processed_bytes", result)
    return {"bytes": len(data)} if isinstance(data, (bytes, bytearray)) else {}


def decomposition_label(self, decomp_table=None, *args, **kwargs) -> str:
    if decomp_table is None:
        return "run_decompositions (core ATen table)"
    if not decomp_table:
        return "run_decompositions({}) (functionalize only)"
    return "run_decompositions (ExecuTorch table)"


def install_probes(profiler: Profiler) -> list[Callable[[], None]]:
    """Probes on the phase functions the harness's export, audit and compile go through."""
    import executorch.exir as exir
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend as XnnpackDelegate
    from executorch.exir.backend import backend_api
    from executorch.exir.passes.memory_planning_pass import MemoryPlanningPass
    from executorch.exir.program import _program
    from torch.export import ExportedProgram

    from harness.backends import executorch as harness_et

    probes = [
        (torch.export, "export", "torch.export.export", graph_size),
        (torch.export, "save", "torch.export.save (.pt2)", None),
        (torch.export, "load", "torch.export.load (.pt2)", graph_size),
        (ExportedProgram, "run_decompositions", decomposition_label, graph_size),
        (ExportedProgram, "_validate", "verification (ExportedProgram._validate)", None),
        (exir, "to_edge_transform_and_lower", "to_edge_transform_and_lower", graph_size),
        (_program, "_gen_edge_manager_for_partitioners", TO_EDGE, graph_size),
        (_program, "_generate_edge_program", "edge dialect conversion (passes)", graph_size),
        (XnnpackPartitioner, "ops_to_not_decompose", "partitioner.ops_to_not_decompose", None),
        (_program.EdgeProgramManager, "to_backend", "to_backend (partition + delegate)", graph_size),
        (backend_api, "get_fake_program", "fake copy of the program", None),
        (XnnpackPartitioner, "partition", "partitioning: tag supported nodes", partition_count),
        (backend_api, "_create_partitions", "partitioning: fuse tagged subgraphs", None),
        (backend_api, "lower_all_submodules_to_backend", "delegate lowering (all partitions)", None),
        (XnnpackDelegate, "preprocess", "XNNPACK preprocess (serialize a partition)", byte_count),
        (harness_et, "_delegation", "harness: delegation info", None),
        (_program.EdgeProgramManager, "to_executorch", "to_executorch (passes + memory plan + emit)", None),
        (MemoryPlanningPass, "run", "memory planning", None),
        (_program, "emit_program", "emit", None),
        (_program, "serialize_for_executorch", "serialize .pte (flatbuffer)", None),
        (_program.ExecutorchProgramManager, "buffer", "buffer (bytes of the .pte)", byte_count),
    ]
    return [profiler.wrap(owner, attr, name, describe) for owner, attr, name, describe in probes]


EXPORT_JOB = "export job (harness.programs.export_step)"
EXPORT_BARE = "export (bare nn.LSTM, --lstm)"
TO_EDGE = "to_edge (decompositions + edge dialect)"


# ---- one step ---------------------------------------------------------------------------------

def step_inputs(case: str, step: str, mode: str) -> tuple[dict, str]:
    """The item's inputs (from the harness's cached traces) and the model digest."""
    from harness.runner import Session

    session = Session(case_ids=[case])
    return session.traces(case).inputs(step, mode, "float32"), session.model.digest


@contextlib.contextmanager
def lstm_impl(impl: str):
    """The length_aware_lstm patch builds LengthAwareLSTM(child) with the default impl ("aten");
    this sets that default for the export in this process only."""
    from harness.patches.length_aware_lstm import LengthAwareLSTM

    defaults = LengthAwareLSTM.__init__.__defaults__
    LengthAwareLSTM.__init__.__defaults__ = (impl,)
    try:
        yield
    finally:
        LengthAwareLSTM.__init__.__defaults__ = defaults


def export_bare_lstm(steps: int, program_path: Path) -> dict:
    """A bare bidirectional nn.LSTM of the shape of predictor.shared (640 -> 2 x 256), random
    weights, over `steps` time steps: how the lowering scales with the steps that get unrolled."""
    import torch

    class BareLSTM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(640, 256, batch_first=True, bidirectional=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(0)
    inputs = {"x": torch.randn(1, steps, 640)}
    with torch.no_grad():
        program = torch.export.export(BareLSTM().eval(), tuple(inputs.values()), strict=False)
    torch.export.save(program, str(program_path))
    return inputs


def profile_step(step: str, case: str, mode: str, backend_name: str, extra_patches: list[str],
                 impl: str, workdir: Path) -> dict:
    """The harness's export job, then its compile job's audit and compile, under probes."""
    from harness.backends import get_backend
    from harness.patches import canonical
    from harness.programs import export_step
    from harness.plumbing.files import save_tensors

    backend = get_backend(backend_name)
    patches = list(canonical((*backend.patches, *extra_patches)))
    start_rss, load_before = current_rss_mb(), os.getloadavg()
    with Profiler() as prof:
        restore = install_probes(prof)
        try:
            program_path = workdir / "program.pt2"
            if step.startswith("lstm:"):
                with prof.phase(EXPORT_BARE):
                    inputs = export_bare_lstm(int(step[len("lstm:"):]), program_path)
            else:
                with prof.phase("setup: model + traces (cached)"):
                    inputs, digest = step_inputs(case, step, mode)
                    inputs_path = save_tensors(workdir / "inputs.pt", inputs)
                with prof.phase(EXPORT_JOB), lstm_impl(impl):
                    export_step(None, digest, step, patches, str(inputs_path), str(program_path))
            out_dir = workdir / "artifact"
            out_dir.mkdir(exist_ok=True)
            with prof.phase("compile job: audit (XnnpackBackend.audit)"):
                audit = backend.audit(program_path)
            with prof.phase("compile job: compile (XnnpackBackend.compile)"):
                audit.update(backend.compile(program_path, out_dir) or {})
        finally:
            for undo in restore:
                undo()
    artifact = out_dir / backend.artifact_name
    return {"step": step, "case": case, "mode": mode, "backend": backend_name, "patches": patches,
            "lstm_impl": impl if "length_aware_lstm" in patches else None,
            "shapes": {k: list(v.shape) for k, v in inputs.items()},
            "load_average_before": load_before, "load_average_after": os.getloadavg(),
            "start_rss_mb": start_rss, "max_rss_mb": _maxrss_mb(),
            "artifact_bytes": artifact.stat().st_size, "audit": audit,
            "phases": [asdict(s) for s in prof.rows()]}


def _maxrss_mb() -> float:
    """VmHWM, not ru_maxrss (which, after a fork from a larger parent, starts at the parent's RSS)."""
    from harness.plumbing.jobs import own_peak_rss_mb

    return own_peak_rss_mb()


# ---- summary ----------------------------------------------------------------------------------

# The phases: (label, probe names, parent they must be called from or None, self time?).
SUMMARY = (
    ("torch.export", ("torch.export.export",), (EXPORT_JOB, EXPORT_BARE), False),
    ("audit: run_decompositions (core ATen)", ("run_decompositions (core ATen table)",), None, False),
    ("to_edge: decompositions", ("run_decompositions({}) (functionalize only)", "run_decompositions (ExecuTorch table)"),
     (TO_EDGE,), False),
    ("to_edge: edge dialect conversion", ("edge dialect conversion (passes)",), (TO_EDGE,), False),
    ("verification (ExportedProgram._validate, everywhere)", ("verification (ExportedProgram._validate)",), None, True),
    ("partitioning (fake copy + tag + fuse)", ("fake copy of the program", "partitioning: tag supported nodes",
                                               "partitioning: fuse tagged subgraphs"), None, False),
    ("delegate preprocess (XNNPACK serialization)", ("delegate lowering (all partitions)",), None, False),
    ("to_executorch (passes + memory planning + emit)", ("to_executorch (passes + memory plan + emit)",), None, False),
    ("serialize .pte + buffer", ("serialize .pte (flatbuffer)", "buffer (bytes of the .pte)"), None, False),
)


def summarize(phases: list[dict]) -> list[dict]:
    rows = []
    for label, names, parent, use_self in SUMMARY:
        chosen = [p for p in phases if p["name"] in names and (parent is None or p["parent"] in parent)]
        seconds = sum(p["self_s"] if use_self else p["total_s"] for p in chosen)
        graphs = [p["result"] for p in chosen if p["result"].get("nodes") is not None]
        rows.append({"phase": label, "calls": sum(p["calls"] for p in chosen), "wall_s": seconds,
                     "cpu_s": None if use_self else sum(p.get("cpu_s", 0.0) for p in chosen),
                     "peak_rss_growth_mb": max((p["peak_rss_growth_mb"] for p in chosen), default=0.0),
                     "nodes_after": graphs[-1]["nodes"] if graphs else None})
    return rows


def print_report(result: dict) -> None:
    print(f"\n== {result['step']} / {result['case']} / {result['mode']} / {result['backend']}"
          f"  patches: {', '.join(result['patches'])}  inputs: {result['shapes']}")
    print(tabulate([[("  " * p["depth"]) + p["name"], p["calls"], p["total_s"], p["self_s"], p.get("cpu_s"),
                     p["peak_rss_growth_mb"], _result_text(p["result"])] for p in result["phases"]],
                   headers=["phase (nested)", "calls", "total s", "self s", "cpu s", "peak RSS +MB", "result"], floatfmt=".1f",
                   preserve_whitespace=True))  # keeps the nesting indent
    print()
    print(tabulate(result["summary"], headers="keys", floatfmt=".1f"))
    audit = result["audit"]
    print(f"process max RSS {result['max_rss_mb']:.0f} MB (started at {result['start_rss_mb']:.0f} MB); "
          f".pte {result['artifact_bytes'] / 2**20:.1f} MB; delegated subgraphs {audit.get('delegated_subgraphs')}, "
          f"coverage {audit.get('delegate_coverage', 0):.3f}, non-delegated nodes {audit.get('non_delegated_nodes')}; "
          f"load average before/after {_load(result.get('load_average_before'))} / {_load(result.get('load_average_after'))}")


def _load(values) -> str:
    return "?" if not values else f"{values[0]:.1f}"


def _result_text(r: dict) -> str:
    parts = [f"{k}={v}" for k, v in r.items() if k != "top_ops" and v]
    if r.get("top_ops"):
        parts.append(", ".join(f"{k.split('.')[-2] if k.count('.') > 1 else k} x{v}" for k, v in r["top_ops"].items()))
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--step", action="append", help="step(s) to profile (default: duration_encoder and f0n)")
    ap.add_argument("--case", default="en_short")
    ap.add_argument("--mode", default="static")
    ap.add_argument("--backend", default="xnnpack", help="xnnpack, or portable to see the cost without partitioning")
    ap.add_argument("--no-partition", action="store_true", help="same as --backend portable")
    ap.add_argument("--with-patch", action="append", default=[], help="extra patch (e.g. length_aware_lstm)")
    ap.add_argument("--lstm", type=int, action="append", default=[], metavar="T",
                    help="also profile a bare bidirectional nn.LSTM(640, 256) over T steps (repeatable)")
    ap.add_argument("--impl", default="aten", choices=("aten", "unrolled"), help="LengthAwareLSTM implementation")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "history")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: one step, JSON on stdout
    args = ap.parse_args(argv)
    backend = "portable" if args.no_partition else args.backend
    steps = (args.step or ([] if args.lstm else ["duration_encoder", "f0n"])) + [f"lstm:{t}" for t in args.lstm]

    if args.one:
        with tempfile.TemporaryDirectory(prefix="kp-profile-") as tmp:
            result = profile_step(steps[0], args.case, args.mode, backend, args.with_patch, args.impl, Path(tmp))
        result["summary"] = summarize(result["phases"])
        print("PROFILE-JSON " + json.dumps(result, default=str))
        return 0

    results = []
    for step in steps:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--step", step, "--case", args.case,
               "--mode", args.mode, "--backend", backend, "--impl", args.impl,
               *(a for p in args.with_patch for a in ("--with-patch", p))]
        start = time.perf_counter()
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("PROFILE-JSON ")), None)
        if r.returncode != 0 or line is None:
            print(f"{step}: profiling failed ({r.returncode})\n{r.stderr[-3000:]}", file=sys.stderr)
            return 1
        result = json.loads(line[len("PROFILE-JSON "):])
        result["process_wall_s"] = time.perf_counter() - start
        results.append(result)
        print_report(result)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = atomic_write_json(args.out / f"profile-{date.replace(':', '')}.json",
                             {"date": date, "command": " ".join(sys.argv), "results": results})
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
