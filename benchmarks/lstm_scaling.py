"""How a LengthAwareLSTM's export, lowering and run cost grow with T, per implementation and backend
(issue 19, part 1).

A bare LengthAwareLSTM of Kokoro's predictor.shared / duration LSTM shape (bidirectional, 640 ->
2 x 256, B=1, random weights, seed 0) over T steps, with a length of 3T/4 (a bucket a quarter
padding), is exported with torch.export and compiled by the harness's own backend classes
(`Backend.compile`, then `Backend.run`: the code a matrix item runs). Each (impl, backend, T) runs
in a child process of its own, so its peak RSS (VmHWM from /proc, at the child's exit) is its own;
children run one at a time under an exclusive flock of --lock (the heavy-job lock shared with
other lowerings on this machine).

Per row: exported graph nodes (call_function nodes, a scan body counted once), delegated share
(XNNPACK: nodes inside delegates / all nodes, scan bodies included), compile wall and CPU seconds,
the child's peak RSS, run seconds (median of 3 `Backend.run` calls, each loading the artifact, after
one warm-up), and the relative L2 of the output against the float32 eager unrolled LengthAwareLSTM
and against the float64 packed reference (pack_padded_sequence -> nn.LSTM), beside the float32
floor (the eager unrolled float32 output against the same float64 reference).

    flock -s /tmp/kokoro-parity-heavy.lock true  # (the script takes the lock itself, per child)
    nice -n 19 .venv/bin/python benchmarks/lstm_scaling.py --impl scan --backend xnnpack \\
        --backend portable --T 64 --T 256 --T 1024 --T 1536
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

INPUT_SIZE, HIDDEN = 640, 256  # predictor.shared / predictor.lstm: d_hid + style_dim -> d_hid // 2
MARK = "LSTM-SCALING-JSON "


def valid_length(T: int) -> int:
    return max(1, T - T // 4)


def build(impl: str, T: int):
    """(module, (x, lengths)): the wrapped LengthAwareLSTM with seeded random weights and inputs."""
    import torch

    from harness.patches.length_aware_lstm import LengthAwareLSTM

    class Bare(torch.nn.Module):
        def __init__(self, lstm: torch.nn.LSTM):
            super().__init__()
            self.lstm = LengthAwareLSTM(lstm, impl=impl)

        def forward(self, x, lengths):
            return self.lstm(x, lengths)

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(INPUT_SIZE, HIDDEN, batch_first=True, bidirectional=True).eval()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, T, INPUT_SIZE, generator=g)
    return Bare(lstm).eval(), lstm, (x, torch.tensor([valid_length(T)], dtype=torch.int64))


def count_nodes(gm) -> tuple[int, int]:
    """(call_function nodes, of which inside delegates) of a graph module and, once each, the
    bodies of its control-flow ops (scan, cond, map) and delegates; getitem is not counted."""
    import operator

    import torch

    total = delegated = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if node.target is torch.ops.higher_order.executorch_call_delegate:
            lowered = getattr(gm, node.args[0].target)
            inner = count_nodes(lowered.original_module.graph_module)[0]
            total, delegated = total + inner, delegated + inner
            continue
        total += 1
        for arg in node.args:
            if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
                sub = getattr(gm, arg.target, None)
                if isinstance(sub, torch.fx.GraphModule):
                    t, d = count_nodes(sub)
                    total, delegated = total + t, delegated + d
    return total, delegated


def scaling_backend(name: str):
    """A harness backend by name, or `xnnpack-cf`: the xnnpack backend with the partitioner that
    also delegates control-flow bodies (harness.backends.control_flow), which no registered backend
    uses yet."""
    from harness.backends import get_backend

    if name != "xnnpack-cf":
        return get_backend(name)
    from harness.backends.control_flow import XnnpackControlFlowPartitioner
    from harness.backends.executorch import XnnpackBackend

    class XnnpackControlFlow(XnnpackBackend):
        def partitioners(self) -> list:
            return [XnnpackControlFlowPartitioner()]

    return XnnpackControlFlow()


def rel(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@contextlib.contextmanager
def _lowered_graph_probe(found: dict):
    """Keep the lowered edge graph of ExecuTorch's to_edge_transform_and_lower (for node counts)."""
    try:
        from executorch import exir
    except ImportError:
        yield
        return
    original = exir.to_edge_transform_and_lower

    def probed(*args, **kwargs):
        edge = original(*args, **kwargs)
        found["graph_module"] = edge.exported_program().graph_module
        return edge

    exir.to_edge_transform_and_lower = probed
    try:
        yield
    finally:
        exir.to_edge_transform_and_lower = original


def measure(impl: str, backend_name: str, T: int, workdir: Path, runs: int) -> dict:
    """One row, in this (child) process."""
    import torch

    from harness.patches.length_aware_lstm import LengthAwareLSTM, packed_lstm_reference
    from harness.plumbing.jobs import own_peak_rss_mb

    model, lstm, (x, lengths) = build(impl, T)
    row: dict = {"impl": impl, "backend": backend_name, "T": T, "length": int(lengths[0])}
    with torch.no_grad():
        unrolled = LengthAwareLSTM(lstm, "unrolled")(x, lengths)
        truth, _ = packed_lstm_reference(copy.deepcopy(lstm).double(), x.double(), lengths)
        row["fp32_floor"] = rel(unrolled, truth)
        start = time.perf_counter()
        program = torch.export.export(model, (x, lengths), strict=False)
        row["export_s"] = time.perf_counter() - start
    row["exported_nodes"] = count_nodes(program.graph_module)[0]
    program_path = workdir / "program.pt2"
    torch.export.save(program, str(program_path))
    del program
    backend = scaling_backend(backend_name)
    out_dir = workdir / "artifact"
    out_dir.mkdir()
    row["rss_before_compile_mb"] = own_peak_rss_mb()
    found: dict = {}
    wall0, cpu0 = time.perf_counter(), time.process_time()
    with _lowered_graph_probe(found):
        audit = backend.compile(program_path, out_dir) or {}
    row["compile_wall_s"], row["compile_cpu_s"] = time.perf_counter() - wall0, time.process_time() - cpu0
    if "graph_module" in found and backend_name != "portable":
        total, delegated = count_nodes(found.pop("graph_module"))
        row["delegated_share"] = delegated / total if total else 0.0
        row["delegated_subgraphs"] = audit.get("delegated_subgraphs")
    row["compile_info"] = {k: v for k, v in audit.items() if k in ("exporter", "dynamo_error", "onnx_ops")}
    artifact = out_dir / backend.artifact_name
    row["artifact_mb"] = (sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file())
                          if artifact.is_dir() else artifact.stat().st_size) / 2**20
    ok, why = backend.runnable()
    if not ok:  # Core ML on Linux: the conversion is the figure; run columns stay empty
        row.update(run_s=None, rel_vs_unrolled=None, rel_vs_fp64=None, not_run=why, peak_rss_mb=own_peak_rss_mb())
        return row
    outputs = backend.run(artifact, [x, lengths])  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        outputs = backend.run(artifact, [x, lengths])
        times.append(time.perf_counter() - start)
    row["run_s"] = statistics.median(times)
    y = torch.as_tensor(outputs[0])
    row["rel_vs_unrolled"] = rel(y, unrolled)
    row["rel_vs_fp64"] = rel(y, truth)
    row["peak_rss_mb"] = own_peak_rss_mb()
    return row


# ---- parent -----------------------------------------------------------------------------------

@contextlib.contextmanager
def heavy_lock(path: str | None):
    """An exclusive flock on `path` for one child (None: no lock); says when it has to wait."""
    if not path:
        yield 0.0
        return
    with open(path, "a") as f:
        start = time.perf_counter()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"  waiting for {path} ...", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - start
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def run_child(impl: str, backend: str, T: int, runs: int, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", "--impl", impl, "--backend", backend,
           "--T", str(T), "--runs", str(runs)]
    start = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return {"impl": impl, "backend": backend, "T": T, "error": f"timed out after {timeout:.0f} s"}
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith(MARK)), None)
    if r.returncode != 0 or line is None:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        error = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        return {"impl": impl, "backend": backend, "T": T, "error": f"exit {r.returncode}: {error.strip()[:300]}",
                "stderr_tail": "\n".join(lines[-40:])}
    row = json.loads(line[len(MARK):])
    row["process_wall_s"] = time.perf_counter() - start
    return row


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(rows: list[dict]) -> str:
    head = ("| impl | backend | T | exported nodes | delegated | compile wall s | compile CPU s | peak RSS MB "
            "| run s | rel vs unrolled | rel vs fp64 | fp32 floor |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['impl']} | {r['backend']} | {r['T']} | FAILED: {r['error']} |||||||||")
            continue
        share = r.get("delegated_share")
        delegated = "-" if share is None else f"{100 * share:.0f} % ({r.get('delegated_subgraphs')} subgraphs)"
        out.append(
            f"| {r['impl']} | {r['backend']} | {r['T']} | {r['exported_nodes']} | "
            f"{delegated} | "
            f"{r['compile_wall_s']:.1f} | {r['compile_cpu_s']:.1f} | {r['peak_rss_mb']:,.0f} | "
            f"{_fmt(r['run_s'], '.3f')} | {_fmt(r['rel_vs_unrolled'], '.2e')} | {_fmt(r['rel_vs_fp64'], '.2e')} | "
            f"{r['fp32_floor']:.2e} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impl", action="append", choices=("aten", "unrolled", "scan"),
                    help="LengthAwareLSTM implementation(s) (default: scan)")
    ap.add_argument("--backend", action="append", help="harness backend(s), or xnnpack-cf (xnnpack with "
                    "control-flow bodies delegated) (default: xnnpack, portable)")
    ap.add_argument("--T", type=int, action="append", help="time steps (default: 64 256 1024 1536)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs after the warm-up (median)")
    ap.add_argument("--lock", default="/tmp/kokoro-parity-heavy.lock",
                    help="flock held by each child ('' for none)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "history")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # child: one row, JSON on stdout
    args = ap.parse_args(argv)
    impls, backends, Ts = args.impl or ["scan"], args.backend or ["xnnpack", "portable"], args.T or [64, 256, 1024, 1536]
    if args.one:
        with tempfile.TemporaryDirectory(prefix="kp-lstm-scaling-") as tmp:
            row = measure(impls[0], backends[0], Ts[0], Path(tmp), args.runs)
        print(MARK + json.dumps(row, default=str), flush=True)
        return 0

    from harness.plumbing.files import atomic_write_json

    rows = []
    for impl in impls:
        for backend in backends:
            for T in Ts:
                print(f"{impl} / {backend} / T={T} ...", file=sys.stderr, flush=True)
                with heavy_lock(args.lock) as waited:
                    load = os.getloadavg()
                    row = run_child(impl, backend, T, args.runs, args.timeout)
                row["lock_wait_s"], row["load_average_before"], row["load_average_after"] = waited, load, os.getloadavg()
                rows.append(row)
                print(markdown([row]).splitlines()[-1], file=sys.stderr, flush=True)
    print(markdown(rows))
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    path = atomic_write_json(args.out / f"lstm-scaling-{date.replace(':', '')}.json",
                             {"date": date, "command": " ".join(sys.argv), "rows": rows})
    print(f"written: {path}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
