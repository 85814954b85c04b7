"""Where an ExecuTorch port's run time goes: ExecuTorch's own profiler, per operator.

The item's cached .pte (the very artifact the matrix judged: no re-lowering) runs in a child
process under the runtime's event tracer (`_load_for_executorch(..., enable_etdump=True)`, then
`write_etdump_result_to_file`), and devtools' `Inspector` reads the ETDump. Its events are of
three kinds, which give the split: `DELEGATE_CALL` (one call into a delegate, e.g. one XNNPACK
subgraph) with the delegate's own per-op events inside it (`Convolution (NHWC, F32) IGEMM #3`),
`OPERATOR_CALL` (one op on ExecuTorch's kernels: portable) with its kernel's `native_call_<op>`
event inside it, and `Method::execute` around a whole run. Without an ETRecord the Inspector has
no module names, but the event names are ExecuTorch's own op and kernel names.

The first run warms up (allocations, XNNPACK's weight packing) and is left out when there are more.
"""
from __future__ import annotations

import csv
import io
import os
import re
import statistics
from pathlib import Path
from typing import Any

import torch
from tabulate import tabulate

from .backends import get_backend
from .plumbing.files import atomic_write_json, atomic_write_text, save_tensors
from .plumbing.jobs import run_job
from .plumbing.errors import UsageError
from .plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
et_devtools = deferred_import("executorch.devtools")
et_portable_lib = deferred_import("executorch.extension.pybindings.portable_lib")

DELEGATED, PORTABLE = "delegated", "portable kernel"


def is_executorch(backend) -> bool:
    """Whether the backend's artifact is an ExecuTorch program (ETDump profiles only those)."""
    return str(getattr(backend, "artifact_name", "")).endswith(".pte")


def etdump_job(artifact_path: str, inputs_path: str, out_dir: str, repeat: int) -> dict[str, Any]:
    """Child job: run the .pte `repeat` times with ETDump on, write the ETDump, return the table."""
    out = Path(out_dir)
    load_before = os.getloadavg()[0]  # other processes' load inflates every figure: kept beside them
    inputs = [t.contiguous() for t in torch.load(inputs_path, weights_only=True)]
    module = et_portable_lib._load_for_executorch(artifact_path, enable_etdump=True)
    for _ in range(repeat):
        module.forward(inputs)
    if not module.has_etdump():
        raise RuntimeError("this ExecuTorch build records no ETDump (ExecuTorchModule.has_etdump() is False)")
    etdump = out / "etdump.etdp"
    module.write_etdump_result_to_file(str(etdump))
    table = operator_table(str(etdump))
    table["summary"]["load_avg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return table


def _per_run_ms(raw: list[float]) -> float:
    """An event's time per run (ms): the median of the runs after the warm-up one."""
    runs = list(raw[1:] if len(raw) > 1 else raw)
    return float(statistics.median(runs)) if runs else 0.0


def operator_table(etdump_path: str) -> dict[str, Any]:
    """ETDump -> {"summary": totals in ms per run, "rows": one per operator (ms per run, calls)}."""
    inspector = et_devtools.Inspector(etdump_path=etdump_path)
    totals = {"execute_ms": 0.0, "delegated_ms": 0.0, "delegated_ops_ms": 0.0, "portable_ms": 0.0,
              "portable_kernels_ms": 0.0, "delegate_calls": 0, "portable_calls": 0, "load_ms": 0.0}
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    n_runs = 0
    for block in inspector.event_blocks:
        for event in block.events:
            raw = list(event.perf_data.raw) if event.perf_data is not None else []
            ms = _per_run_ms(raw)
            name = event.name
            if block.name != "Execute":  # Method::init, Program::load_method
                totals["load_ms"] += ms if name == "Program::load_method" else 0.0
                continue
            if name == "Method::execute":
                totals["execute_ms"] += ms
                n_runs = max(n_runs, len(raw))
            elif name == "DELEGATE_CALL":
                totals["delegated_ms"] += ms
                totals["delegate_calls"] += 1
            elif name == "OPERATOR_CALL":
                totals["portable_ms"] += ms
                totals["portable_calls"] += 1
            elif event.is_delegated_op:
                totals["delegated_ops_ms"] += ms
                _add(rows, re.sub(r" #\d+$", "", name), DELEGATED, ms)
            elif name.startswith("native_call_"):
                totals["portable_kernels_ms"] += ms
                _add(rows, name[len("native_call_"):], PORTABLE, ms)
            else:
                _add(rows, name, "other", ms)
    execute = totals["execute_ms"]
    totals["other_ms"] = execute - totals["delegated_ms"] - totals["portable_ms"]  # the runtime's own work
    totals["runs"] = n_runs
    out = sorted(rows.values(), key=lambda r: -r["ms"])
    for r in out:
        r["share"] = r["ms"] / execute if execute else None
    return {"summary": totals, "rows": out}


def _add(rows: dict, op: str, where: str, ms: float) -> None:
    row = rows.setdefault((op, where), {"operator": op, "where": where, "calls": 0, "ms": 0.0})
    row["calls"] += 1
    row["ms"] += ms


def summary_lines(summary: dict[str, Any]) -> list[str]:
    s, ex = summary, summary["execute_ms"] or float("nan")
    return [f"one run: {s['execute_ms']:.1f} ms (median of {max(s['runs'] - 1, 1)} runs after a warm-up); "
            f"loading the method {s['load_ms']:.1f} ms",
            f"  delegated: {s['delegated_ms']:.1f} ms ({s['delegated_ms'] / ex:.1%}) in {s['delegate_calls']} delegate "
            f"calls, of which {s['delegated_ops_ms']:.1f} ms inside the delegate's ops",
            f"  not delegated: {s['portable_ms']:.1f} ms ({s['portable_ms'] / ex:.1%}) in {s['portable_calls']} "
            f"operator calls, of which {s['portable_kernels_ms']:.1f} ms inside the kernels",
            f"  the runtime between them: {s['other_ms']:.1f} ms ({s['other_ms'] / ex:.1%})"] + (
                [f"  load average (1 min) before / after: {s['load_avg_1m'][0]} / {s['load_avg_1m'][1]} "
                 f"on {os.cpu_count()} CPUs"] if "load_avg_1m" in s else [])


def markdown(table: dict[str, Any], top: int | None = None) -> str:
    rows = table["rows"][:top] if top else table["rows"]
    body = tabulate([[f"`{r['operator']}`", r["where"], r["calls"], f"{r['ms']:.2f}",
                      f"{r['share']:.1%}" if r["share"] is not None else "-"] for r in rows],
                    headers=["operator", "where", "calls per run", "ms per run", "share of the run"], tablefmt="github")
    return "\n".join(summary_lines(table["summary"])) + "\n\n" + body + "\n"


def to_csv(table: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=["operator", "where", "calls", "ms", "share"], lineterminator="\n")
    w.writeheader()
    w.writerows(table["rows"])
    return buf.getvalue()


def profile_item(session, item, repeat: int = 3) -> tuple[dict[str, Any], Path]:
    """Profile an item's compiled .pte (compiled first if not cached) on the item's inputs; writes
    <report_dir>/profile/<item>/{etdump.etdp, operators.csv, operators.md, profile.json}."""
    backend = get_backend(item.backend)
    if not is_executorch(backend):
        raise UsageError(f"--backend {item.backend}: ETDump profiles ExecuTorch programs (.pte): xnnpack, portable")
    if item.step == "e2e":
        raise UsageError("--step e2e runs two programs: profile its steps (e.g. --step decoder)")
    if repeat < 1:
        raise UsageError(f"--repeat {repeat}: at least one run")
    ok, why = backend.available()
    if not ok:
        raise UsageError(f"--backend {item.backend}: {why}")
    r = session.resolve(item)
    inputs = r.traces.inputs(item.step, item.mode, "float32")
    rec = session.new_record(item, r.patches, backend)
    program_dir, key = session.program(item.step, inputs, r.patches, rec)
    artifact_dir = session.artifact(backend, item.step, program_dir, key, rec) if program_dir else None
    if artifact_dir is None:
        raise RuntimeError(f"{item.id}: {rec.verdict.value}: {rec.reason}")
    out = session.report_dir / "profile" / item.id
    save_tensors(out / "inputs.pt", inputs)
    result = run_job("harness.profile:etdump_job", dict(artifact_path=str(artifact_dir / backend.artifact_name),
                                                        inputs_path=str(out / "inputs.pt"), out_dir=str(out),
                                                        repeat=repeat), out / "job", session.limits.run_s * repeat)
    if not result.ok:
        raise RuntimeError(f"{item.id}: the ETDump run {result.status}: {result.error}\n{result.log_tail}")
    table = {**result.value, "item": item.id, "cache": rec.cache, "timings": rec.timings,
             "versions": rec.versions, "repeat": repeat}
    atomic_write_json(out / "profile.json", table)
    atomic_write_text(out / "operators.csv", to_csv(table))
    atomic_write_text(out / "operators.md", f"# {item.id}: ExecuTorch's per-operator profile (ETDump)\n\n" +
                      markdown(table))
    return table, out
