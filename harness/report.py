"""Terminal tables of records: one item's metrics, and the session's step x backend summary."""
from __future__ import annotations

import math
from pathlib import Path

from tabulate import tabulate

from .metrics import fmt as _fmt
from .record import Record

KEY_METRICS = ("nan_rate", "max_abs", "rel_l2", "floor_rel_l2", "floor_ratio", "cosine", "snr_db")


def item_table(rec: Record) -> str:
    """The metric table printed for an item (instead of a traceback)."""
    lines = [f"{rec.item_id}: {rec.verdict.value.upper()}  {rec.reason}"]
    if rec.metrics:
        rows = [[name, *(_fmt(m.get(k)) for k in KEY_METRICS)] for name, m in rec.metrics.items()]
        lines.append(tabulate(rows, headers=["output", *KEY_METRICS], tablefmt="simple"))
    if rec.audio_metrics:
        keys = ("pesq", "mcd_db", "logmel_corr", "logmel_mad_db", "rms_ratio_db", "mrstft", "snr_db", "length_ratio")
        rows = [[name, *(_fmt(a.get(k)) for k in keys)] for name, a in rec.audio_metrics.items()]
        lines.append(tabulate(rows, headers=["audio", *keys], tablefmt="simple"))
    if rec.durations:
        lines.append("durations: " + ", ".join(f"{k} {v}" for k, v in rec.durations.items()))
    if rec.rewrite_drift:
        rows = [[name, _fmt(d["rel_l2"]), _fmt(d["max_abs"])] for name, d in rec.rewrite_drift.items()]
        lines.append("rewrite drift (static fp32 vs dynamic fp32, valid region):")
        lines.append(tabulate(rows, headers=["output", "rel_l2", "max_abs"], tablefmt="simple"))
    if rec.patch_drift:
        rows = [[name, _fmt(d["rel_l2"]), _fmt(d["max_abs"])] for name, d in rec.patch_drift.items()]
        lines.append(f"patch drift ({', '.join(rec.semantic_patches)} vs the unpatched reference, fp32):")
        lines.append(tabulate(rows, headers=["output", "rel_l2", "max_abs"], tablefmt="simple"))
    if rec.semantic_patches:
        lines.append(f"patches that change semantics: {', '.join(rec.semantic_patches)}")
    outside = rec.audit.get("ops_outside_delegate")
    if outside:
        lines.append("ops left outside the delegate: " + ", ".join(f"{k} x{v}" for k, v in sorted(outside.items())))
    if rec.audit.get("non_core_aten_ops"):
        lines.append("ops outside Core ATen: " + ", ".join(f"{k} x{v}" for k, v in rec.audit["non_core_aten_ops"].items()))
    lines += audit_lines(rec.audit)
    if rec.log and not rec.verdict.ok and rec.verdict.value != "fail":
        lines.append("log (tail):\n" + "\n".join(rec.log.splitlines()[-12:]))
    if rec.bisect:
        lines.append(format_bisect(rec.bisect))
    return "\n".join(lines)


AUDIT_LABELS = {"ops_without_converter": "ops without a TVM converter",
                "ops_without_onnx_translation": "ops the ONNX exporter cannot translate",
                "onnx_ops_without_tvm_converter": "ONNX ops without a TVM converter",
                "ops_without_mil_lowering": "ops without a Core ML (MIL) lowering"}


def audit_lines(audit: dict) -> list[str]:
    """The issue-7 audits (harness/backends): what a backend will not take, and why it fell back."""
    lines = [f"{label}: " + ", ".join(f"{k} x{v}" for k, v in audit[key].items())
             for key, label in AUDIT_LABELS.items() if audit.get(key)]
    for key in ("dynamo_error", "audit_error"):
        if audit.get(key):
            lines.append(f"{key.replace('_', ' ')}: {audit[key]}")
    if "largest_activation" in audit:
        lines.append(f"largest activation {_fmt(audit['largest_activation'])} = "
                     f"{_fmt(audit['largest_activation_of_fp16_max'])} of float16's 65,504; over it: "
                     f"{', '.join(audit['modules_over_fp16_max']) or 'none'}; first non-finite in float16: "
                     f"{audit['fp16_first_nonfinite'] or 'none'}")
    return lines


def summary_table(records: list[Record], tablefmt: str = "simple") -> str:
    """One row per (case, step, mode) in pipeline order, one column per backend in the registry's
    order: verdict and the key metric (or, for an item that did not run, the start of its reason).
    `tablefmt="github"` gives Markdown (the README's matrices)."""
    from .backends import backend_names
    from .steps import PIPELINE_STEP_NAMES

    known = backend_names()
    backends = sorted({r.backend for r in records},
                      key=lambda b: (known.index(b) if b in known else len(known), b))
    step_rank = {name: i for i, name in enumerate(PIPELINE_STEP_NAMES)}
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r.case, step_rank.get(r.step, len(step_rank)), r.step, r.mode)
        worst = max(r.metrics.values(), key=lambda m: m.get("floor_ratio", 0) if isinstance(m.get("floor_ratio"), float) else 0, default=None)
        cell = r.verdict.value.upper()
        nan_rate = max((m.get("nan_rate") or 0 for m in r.metrics.values()), default=0)
        if nan_rate and r.verdict.value == "fail":  # a NaN output has no meaningful error figure
            cell += f" NaN {nan_rate:.0%}"
        elif worst is not None and r.verdict.value in ("pass", "fail"):
            cell += f" rel {_fmt(worst.get('rel_l2'))} ({_fmt(worst.get('floor_ratio'))}x floor)"
        audio = next((a for n, a in r.audio_metrics.items() if not n.endswith("_unforced")), None)
        if audio is not None and r.verdict.value in ("pass", "fail") and not nan_rate:
            cell += f" PESQ {_fmt(audio.get('pesq'))}"
        drift = max((d["rel_l2"] for d in r.rewrite_drift.values()), default=None)
        if r.verdict.value not in ("pass", "fail") and r.reason:
            cell += f" ({r.reason.split(';')[0][:60]})"
        rows.setdefault(key, {})[r.backend] = cell
        if drift is not None:
            rows[key]["drift"] = _fmt(drift)
    table = [[key[0], key[2], key[3], rows[key].get("drift", "-"), *(rows[key].get(b, "not run") for b in backends)]
             for key in sorted(rows)]  # key: (case, pipeline rank, step, mode)
    return tabulate(table, headers=["case", "step", "mode", "rewrite drift", *backends], tablefmt=tablefmt)


def write_audio(report_dir: Path, item_id: str, outputs: dict, valid) -> dict[str, str]:
    """Reference and backend WAVs (valid region) of audio outputs, `{name: (reference, backend)}`,
    so that a person can hear what the metrics summarize: <report_dir>/audio/<item_id>/{reference,
    backend}.wav (a name prefix when there are several). Returns role -> path relative to report_dir."""
    from .metrics.audio import write_wav

    paths = {}
    for name, pair in outputs.items():
        prefix = "" if len(outputs) == 1 else f"{name}-"
        for role, tensor in zip(("reference", "backend"), pair):
            rel = Path("audio") / item_id / f"{prefix}{role}.wav"
            write_wav(Path(report_dir) / rel, valid(name, tensor).detach().cpu().numpy())
            paths[prefix + role] = rel.as_posix()
    return paths


def format_bisect(b: dict) -> str:
    """The bisection's lines under an item's metric table."""
    if b.get("status") == "error":
        return f"bisect: could not run: {b.get('message')}"
    lines = []
    rows = b.get("modules") or []
    if rows:
        lines.append(f"bisect, module stage ({len(rows)} module cuts probed, each with everything before it; "
                     f"{b.get('module_compiles', 0)} compiles):")
        table = [[r["module"], r["type"], r["status"].upper(), r["n_ops"], _fmt(r.get("rel_l2")),
                  _fmt(r.get("floor_rel_l2")), _fmt(r.get("floor_ratio"))] for r in rows]
        lines.append(tabulate(table, headers=["module", "type", "cut after it", "ops", "rel_l2", "floor", "ratio"],
                              tablefmt="simple"))
        lines.append(f"first failing module: {b.get('first_module') or 'none (every module cut passes)'}")
    if b.get("status") != "localized":
        lines.append(f"bisect: not localized: {b.get('message')}")
    else:
        f = b["first_op"]
        lines.append(f"bisect: first diverging op `{f['node']}` ({f['op']}, {f['kind'].upper()}) "
                     f"in {f['module'] or '?'}")
        lines.append(f"  source: {f['source'] or '?'}")
        before = "; ".join(f"{n}: {v if isinstance(v, str) else 'rel_l2 ' + _fmt(v.get('rel_l2')) + ' (' + _fmt(v.get('floor_ratio')) + 'x floor)'}"
                           for n, v in f["before"].items()) or "-"
        a = f["after"]
        lines.append(f"  before (its inputs): {before}")
        lines.append(f"  after: rel_l2 {_fmt(a.get('rel_l2'))} ({_fmt(a.get('floor_ratio'))}x floor "
                     f"{_fmt(a.get('floor_rel_l2'))}), NaN rate {_fmt(a.get('nan_rate'))}: {f['why']}")
        lines.append(f"  alone on exact inputs: {f['local']['status']} -> {f['kind']}")
        if f.get("uncertain_from"):
            lines.append(f"  or from {f['uncertain_from']} on: the probes between could not run")
    lines.append(f"  op bisection in {b.get('region')}: {b.get('bisect_compiles', 0)} probes for {b.get('n_nodes', 0)} "
                 f"float nodes (log2 = {math.log2(max(b.get('n_nodes', 1), 1)):.1f}); total compiles "
                 f"{b.get('compiles', 0)} (+{b.get('compile_hits', 0)} cached), runs {b.get('runs', 0)}, {b.get('seconds')} s")
    for p in b.get("probe_failures") or []:
        lines.append(f"  probe that could not run (not a divergence; a finding of its own): {p['label']} "
                     f"{p['status']}: {p.get('why', '')[:160]}")
    r = b.get("repro")
    if r:
        state = ("reproduces when run alone" if r.get("reproduces") else
                 f"repro.py exit code {r.get('exit_code')}" if "exit_code" in r else "not verified")
        lines.append(f"  repro: {r['path']}/ ({r['bytes'] / 1024:.0f} KiB, {r['n_ops']} ops, {state})")
    return "\n".join(lines)
