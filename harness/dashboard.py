"""The static HTML dashboard of the run history: the matrix, trends, one page per item, run versions.

Why these libraries:
- Jinja2 templates (harness/templates/) with autoescaping: reasons and logs are text from
  runtimes and must never become markup.
- Plotly for the charts: interactive (hover shows the exact value, the run and the regression
  message; a dropdown switches the metric), well kept, and it ships its JavaScript inside the
  PyPI package, so the site embeds `plotly.min.js` once under assets/ and opens from file:// with no
  network. Figures are written by Plotly's own `to_html` (no hand-written JS).
- matplotlib (Agg) for the spectrogram images: a raster is the right thing for a time-frequency
  picture, and it keeps item pages small.

The site is built in a temporary sibling directory and moved into place, so a reader never sees a
half-built dashboard. Nothing is fetched; everything the pages use is copied into the site.
"""
from __future__ import annotations

import html
import json
import math
import os
import shutil
import tempfile
import time
import wave
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .backends import backend_names
from .history import DEFAULT_FACTOR, History, Regression, Run, as_float, item_id, load_history, profile_from
from .steps import PIPELINE_STEP_NAMES
from .verdict import Profile
from .plumbing.errors import UsageError

TEMPLATES = Path(__file__).resolve().parent / "templates"
# Cell colours by verdict (the tests read this table): light fills with dark text for the common
# verdicts, a dark fill for a crash. Failures are warm, pipeline errors distinct, a skip is grey.
VERDICT_COLORS = {
    "pass": "#bfe6c8",
    "fail": "#f5b3b1",
    "run_error": "#f7c58f",
    "timeout": "#f3e08a",
    "crashed": "#6d1f1f",
    "compile_error": "#d9c2f0",
    "export_error": "#b9c8f2",
    "skipped": "#e4e7eb",
}
VERDICT_INK = {"pass": "#1a7f37", "fail": "#b42318", "run_error": "#b54708", "timeout": "#8a6d00",
               "crashed": "#6d1f1f", "compile_error": "#6e3bb5", "export_error": "#2f55c6", "skipped": "#6b7280"}
NOT_RUN_COLOR = "#ffffff"
TREND_METRICS = (  # key, label, how to combine outputs, axis type
    ("floor_ratio", "error / fp32 noise floor", max, "log"),
    ("rel_l2", "relative L2 error vs float64", max, "log"),
    ("max_abs", "max abs error vs float64", max, "log"),
    ("snr_db", "SNR vs float64 (dB)", min, "linear"),
    ("run_s", "run time (s)", None, "linear"),
)
METRIC_ROWS = ("rel_l2", "floor_rel_l2", "floor_ratio", "max_abs", "floor_max_abs", "mean_abs", "cosine", "snr_db",
               "nan_rate", "inf_rate", "new_nonfinite", "ref_peak")
KNOWN_FIELDS = {"case", "step", "backend", "mode", "verdict", "reason", "metrics", "rewrite_drift", "patch_drift",
                "patches", "semantic_patches", "audit", "timings", "cache", "peak_rss_mb", "artifact_bytes", "model",
                "versions", "log", "audio", "schema", "bisect", "repro_dir", "audio_metrics", "durations", "real_time",
                "stages"}
AUDIO_ROWS = (("pesq", "PESQ (1–4.64)"), ("mcd_db", "MCD (dB)"), ("logmel_corr", "log-mel correlation"),
              ("logmel_mad_db", "log-mel MAD (dB)"), ("mrstft", "multi-resolution STFT distance"),
              ("rms_ratio_db", "RMS ratio (dB)"), ("snr_db", "SNR (dB)"), ("length_ratio", "length ratio"),
              ("duration_s", "duration (s)"))
SERIES_COLORS = ("#2563eb", "#ea580c", "#059669", "#9333ea", "#db2777", "#0891b2", "#65a30d", "#b45309")


# ----------------------------------------------------------------------------- formatting

def fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, str):
        f = as_float(v)
        return v if math.isnan(f) and v.lower() != "nan" else fmt(f)
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "∞" if v > 0 else "−∞"
        if v == 0:
            return "0"
        return f"{v:.3g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.2e}"
    return str(v)


def fmt_ratio(r: float) -> str:
    """A floor ratio as people say it: 1.00×, 12.3×, 4.1e+03×."""
    if not math.isfinite(r):
        return fmt(r) + "×"
    return (f"{r:.2f}" if r < 10 else f"{r:.1f}" if r < 1000 else f"{r:.1e}") + "×"


def fmt_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _finite(v: Any) -> float | None:
    f = as_float(v)
    return f if math.isfinite(f) else None


def worst_output(rec: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The output with the largest floor ratio (NaN counts as worst): the cell's key metric."""
    metrics = rec.get("metrics") or {}
    if not metrics:
        return None

    def badness(kv):
        r = as_float(kv[1].get("floor_ratio"))
        return math.inf if math.isnan(r) else r

    return max(metrics.items(), key=badness)


def combine(rec: dict[str, Any], key: str, how) -> float | None:
    if key == "run_s":
        return _finite((rec.get("timings") or {}).get("run_s"))
    values = [as_float(m.get(key)) for m in (rec.get("metrics") or {}).values() if key in m]
    values = [v for v in values if math.isfinite(v)]
    return how(values) if values else None


def stage_table(rec: dict[str, Any]) -> dict[str, Any] | None:
    """A port item's stages (harness/port/chain.py writes `stages`) as the item page's table: one
    row per stage output, local error against its floor, chained error, the kind of difference,
    and the first stage whose local error leaves its floor (a defect of its own; the stages after
    it carry accumulated error). Read defensively: a row or field the chain did not write is shown
    as missing, never an error of the page."""
    stages = rec.get("stages")
    if not isinstance(stages, list) or not stages:
        return None
    rows, first = [], None
    for i, stage in enumerate(s for s in stages if isinstance(s, dict)):
        outputs = stage.get("outputs") if isinstance(stage.get("outputs"), dict) else {}
        local_ok = stage.get("local_ok")
        if local_ok is None:  # older rows: derive it from the outputs
            local_ok = all((o.get("local") or {}).get("ok", True) for o in outputs.values() if isinstance(o, dict))
        if not local_ok and first is None:
            first = i
        bucket = stage.get("bucket")
        if isinstance(bucket, dict):
            sizes = {str(v) for v in bucket.values()}
            bucket = next(iter(sizes)) if len(sizes) == 1 else ", ".join(f"{k} {v}" for k, v in bucket.items())
        tensors = []
        for tensor, o in outputs.items():
            o = o if isinstance(o, dict) else {}
            local, chained = (o.get(k) if isinstance(o.get(k), dict) else {} for k in ("local", "chained"))
            tensors.append({"tensor": tensor, "local": local, "chained": chained,
                            "local_ok": local.get("ok", True) if local else None,
                            "chained_ok": chained.get("ok", True) if chained else None,
                            "kind": _kind(local) or _kind(chained),
                            "chained_kind": _kind(chained) if _kind(chained) != _kind(local) else ""})
        made_by = stage.get("artifact") or (f"step:{stage['step']}" if stage.get("step") else "")  # e2e: harness steps
        rows.append({"index": i, "stage": str(stage.get("stage", f"#{i}")), "artifact": made_by,
                     "precision": stage.get("precision") or "", "bucket": bucket, "local_ok": bool(local_ok),
                     "chained_ok": stage.get("chained_ok", all(t["chained_ok"] is not False for t in tensors)),
                     "tensors": tensors or [{"tensor": "–", "local": {}, "chained": {}, "local_ok": None,
                                             "chained_ok": None, "kind": "no outputs recorded", "chained_kind": ""}]})
    for r in rows:
        r["first_leaving"] = r["index"] == first
    return {"rows": rows, "first": rows[first]["stage"] if first is not None else None,
            "buckets": any(r["bucket"] is not None for r in rows)}


def _kind(m: dict[str, Any]) -> str:
    """The kind of difference of one judged tensor; for durations, how many differ."""
    kind = str(m.get("kind") or "")
    return str(m.get("why") or kind) if kind == "durations" else kind


# ----------------------------------------------------------------------------- the model of the site

@dataclass
class Cell:
    id: str
    case: str
    step: str
    backend: str
    mode: str
    rec: dict[str, Any] | None
    regressions: list[Regression]

    @property
    def verdict(self) -> str:
        return self.rec["verdict"] if self.rec else "not_run"

    @property
    def label(self) -> str:
        return {"not_run": "not run", "export_error": "export error", "compile_error": "compile error",
                "run_error": "run error"}.get(self.verdict, self.verdict)

    @property
    def metric(self) -> str:
        """The key metric for pass/fail; the reason for everything else."""
        if not self.rec:
            return ""
        w = worst_output(self.rec)
        if self.verdict in ("pass", "fail") and w:
            return f"{fmt_ratio(as_float(w[1].get('floor_ratio')))} floor"
        return self.rec.get("reason", "")

    @property
    def sub(self) -> str:
        w = worst_output(self.rec) if self.rec else None
        if self.verdict in ("pass", "fail") and w:
            return f"rel {fmt(as_float(w[1].get('rel_l2')))}"
        return ""


def _order(values, preferred) -> list[str]:
    values = set(values)
    return [v for v in preferred if v in values] + sorted(values - set(preferred))


def _dims(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    return {"cases": _order({r["case"] for r in records}, ()),
            "steps": _order({r["step"] for r in records}, PIPELINE_STEP_NAMES),
            "backends": _order({r["backend"] for r in records}, backend_names()),
            "modes": _order({r["mode"] for r in records}, ("dynamic", "static"))}


def matrix(run: Run, regressions: list[Regression]) -> dict[str, Any]:
    """Rows: step, then case; columns: backend, then mode. Every combination gets a cell."""
    dims = _dims(run.records)
    recs = run.by_item()
    regs: dict[str, list[Regression]] = defaultdict(list)
    for r in regressions:
        regs[r.item].append(r)
    rows = []
    for step in dims["steps"]:
        for i, case in enumerate(dims["cases"]):
            cells = []
            for b in dims["backends"]:
                for m in dims["modes"]:
                    iid = f"{case}-{step}-{b}-{m}"
                    cells.append(Cell(iid, case, step, b, m, recs.get(iid), regs.get(iid, [])))
            rows.append({"step": step, "case": case, "first": i == 0, "span": len(dims["cases"]), "cells": cells})
    return {**dims, "rows": rows}


def _run_label(run: Run, commit: bool = True) -> str:
    label = f"{run.date[5:10]} {run.date[11:16]}"
    return f"{label} · {str(run.git.get('commit', ''))[:7]}" if commit else label


def _labels(runs: list[Run], commit: bool = True) -> list[str]:
    """Unique x labels for the runs: the date (and commit), numbered when they repeat."""
    labels, seen = [], defaultdict(int)
    for run in runs:
        label = _run_label(run, commit)
        seen[label] += 1
        labels.append(label if seen[label] == 1 else f"{label} ({seen[label]})")
    return labels


# ----------------------------------------------------------------------------- plots

def _layout(**kw) -> dict[str, Any]:
    base = dict(template="simple_white", margin=dict(l=60, r=20, t=40, b=50), font=dict(family="system-ui, sans-serif",
                size=12), legend=dict(orientation="h", y=-0.25), hovermode="closest")
    base.update(kw)
    return base


def _html(fig, div_id: str, height: int = 320) -> str:
    return fig.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, default_height=f"{height}px",
                       config={"displaylogo": False, "responsive": True})


def trend_figure(runs: list[Run], step: str, backend: str, regs_by_run: dict[str, list[Regression]],
                 div_id: str, only_item: str | None = None, height: int = 340) -> str:
    """One line per (case, mode) across the runs; a dropdown picks the metric; red rings mark
    regressions (hover: before and after)."""
    # optional runtime: dashboard extra
    import plotly.graph_objects as go

    labels = _labels(runs)
    series: dict[str, list[dict | None]] = {}
    for run in runs:
        for rec in run.records:
            if rec["step"] == step and rec["backend"] == backend and (only_item is None or item_id(rec) == only_item):
                series.setdefault(f"{rec['case']} · {rec['mode']}", [None] * len(runs))
    for i, run in enumerate(runs):
        for rec in run.records:
            key = f"{rec['case']} · {rec['mode']}"
            if key in series and rec["step"] == step and rec["backend"] == backend:
                series[key][i] = rec
    fig = go.Figure()
    ys_per_metric: list[list[list[float | None]]] = [[] for _ in TREND_METRICS]
    for n, (name, recs) in enumerate(sorted(series.items())):
        for k, (key, _, how, _) in enumerate(TREND_METRICS):
            ys_per_metric[k].append([combine(r, key, how) if r else None for r in recs])
        hover = [f"{labels[i]}<br>{r['verdict']}: {html.escape(r.get('reason', '')[:120])}" if r else "not run"
                 for i, r in enumerate(recs)]
        symbols = ["x" if r and r["verdict"] == "fail" else "circle" for r in recs]
        fig.add_trace(go.Scatter(x=labels, y=ys_per_metric[0][-1], name=name, mode="lines+markers",
                                 line=dict(color=SERIES_COLORS[n % len(SERIES_COLORS)], width=2),
                                 marker=dict(size=9, symbol=symbols), text=hover,
                                 hovertemplate="%{y:.4g}<br>%{text}<extra>" + name + "</extra>"))
    # regressions of this (step, backend), as rings on the regressed points
    reg_x, reg_text, reg_rows = [], [], []
    for i, run in enumerate(runs):
        for reg in regs_by_run.get(run.id, []):
            rec = run.by_item().get(reg.item)
            if rec and rec["step"] == step and rec["backend"] == backend and (only_item is None or reg.item == only_item):
                reg_x.append(labels[i])
                reg_text.append(html.escape(str(reg)))
                reg_rows.append(rec)
    for k, (key, _, how, _) in enumerate(TREND_METRICS):
        ys_per_metric[k].append([combine(r, key, how) for r in reg_rows])
    fig.add_trace(go.Scatter(x=reg_x, y=ys_per_metric[0][-1], name="regression", mode="markers",
                             marker=dict(size=18, symbol="circle-open", color="#d1242f", line=dict(width=3)),
                             text=reg_text, hovertemplate="%{text}<extra>regression</extra>"))
    ranges = [_y_range([y for ys in ys_per_metric[k] for y in ys], axis) for k, (*_, axis) in enumerate(TREND_METRICS)]
    buttons = [dict(label=label, method="update",
                    args=[{"y": ys_per_metric[k]}, {"yaxis.type": axis, "yaxis.title.text": label,
                                                    "yaxis.range": ranges[k], "yaxis.autorange": ranges[k] is None}])
               for k, (_, label, _, axis) in enumerate(TREND_METRICS)]
    fig.update_layout(**_layout(updatemenus=[dict(buttons=buttons, x=0, xanchor="left", y=1.02, yanchor="bottom",
                                                  showactive=True, bgcolor="#ffffff")],
                                margin=dict(l=60, r=20, t=44, b=40)))
    fig.update_yaxes(type=TREND_METRICS[0][3], title_text=TREND_METRICS[0][1],
                     range=ranges[0], autorange=ranges[0] is None)
    fig.update_xaxes(type="category")
    return _html(fig, div_id, height)


def _y_range(values: list[float | None], axis: str) -> list[float] | None:
    """A y range that does not zoom into float noise: a flat line stays a flat line (log axes span
    at least a decade, linear ones at least 10 % of the value)."""
    v = [x for x in values if x is not None and (axis != "log" or x > 0)]
    if not v:
        return None
    lo, hi = min(v), max(v)
    if axis == "log":
        lo, hi = math.log10(lo), math.log10(hi)
        pad = max(0.5 - (hi - lo) / 2, 0.1)
        return [lo - pad, hi + pad]
    pad = max((hi - lo) * 0.1, abs(hi) * 0.05, 1e-12)
    return [lo - pad, hi + pad]


def overview_figure(runs: list[Run], div_id: str) -> str:
    """Verdict counts per run, stacked: the health of the whole matrix over time."""
    # optional runtime: dashboard extra
    import plotly.graph_objects as go

    labels = _labels(runs, commit=False)
    fig = go.Figure()
    for verdict in VERDICT_COLORS:
        counts = [run.verdict_counts.get(verdict, 0) for run in runs]
        if any(counts):
            fig.add_trace(go.Bar(x=labels, y=counts, name=verdict.replace("_", " "),
                                 marker=dict(color=VERDICT_INK[verdict] if verdict != "skipped" else "#9ca3af")))
    fig.update_layout(**_layout(barmode="stack", margin=dict(l=40, r=10, t=30, b=40), legend=dict(
        orientation="h", x=0, y=1.02, yanchor="bottom"), bargap=0.35))
    fig.update_xaxes(type="category")
    fig.update_yaxes(title_text="items")
    return _html(fig, div_id, 230)


def budget_figure(rec: dict[str, Any], threshold: dict[str, float], div_id: str) -> str | None:
    """Per output: the fp32 noise floor, the backend's error, the pass threshold, and the drift
    that the port's rewrites (static shapes) and semantic patches cost, on one log axis."""
    # optional runtime: dashboard extra
    import plotly.graph_objects as go

    metrics = rec.get("metrics") or {}
    if not metrics:
        return None
    outputs = list(metrics)
    bars = [("fp32 noise floor", [metrics[o].get("floor_rel_l2") for o in outputs], "#9ca3af"),
            ("backend error", [metrics[o].get("rel_l2") for o in outputs], VERDICT_INK.get(rec["verdict"], "#333")),
            ("pass threshold", [threshold.get(o) for o in outputs], "#d1d5db")]
    if rec.get("rewrite_drift"):
        bars.append(("rewrite drift (static vs dynamic fp32)",
                     [rec["rewrite_drift"].get(o, {}).get("rel_l2") for o in outputs], "#f59e0b"))
    if rec.get("patch_drift"):
        bars.append(("patch drift (patched vs unpatched fp32)",
                     [rec["patch_drift"].get(o, {}).get("rel_l2") for o in outputs], "#8b5cf6"))
    fig = go.Figure()
    positive = []
    for name, values, color in reversed(bars):
        xs = [_finite(v) for v in values]
        positive += [x for x in xs if x and x > 0]
        fig.add_trace(go.Bar(y=outputs, x=[x if x and x > 0 else None for x in xs], name=name, orientation="h",
                             marker=dict(color=color), text=[fmt(x) if x is not None else "NaN" for x in xs],
                             textposition="outside", cliponaxis=False,
                             hovertemplate="%{x:.3e}<extra>" + name + "</extra>"))
    if positive:  # room for the labels right of the longest bar
        fig.update_xaxes(range=[math.log10(min(positive)) - 0.3, math.log10(max(positive)) + 0.6])
    fig.update_layout(**_layout(barmode="group", bargap=0.25, margin=dict(l=80, r=70, t=10, b=40), legend=dict(
        orientation="h", x=0, y=-0.3, yanchor="top", traceorder="reversed")))
    fig.update_xaxes(type="log", title_text="relative L2 error against float64 (log)", exponentformat="power")
    return _html(fig, div_id, 250 + 110 * len(outputs))


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        if w.getsampwidth() != 2:
            raise UsageError(f"{path}: expected 16-bit PCM")
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64) / 32767.0
        return data.reshape(-1, w.getnchannels())[:, 0], w.getframerate()


def spectrogram_png(reference: Path, backend: Path, out: Path) -> dict[str, float]:
    """Reference, backend and their difference as log spectrograms on one dB scale (0 dB = the
    reference's peak), so that the error's level and where it sits in time and frequency show."""
    # optional runtime: dashboard extra
    import matplotlib

    matplotlib.use("Agg")
    # optional runtime: dashboard extra
    import matplotlib.pyplot as plt

    ref, sr = read_wav(reference)
    cand, _ = read_wav(backend)
    n = min(len(ref), len(cand))
    ref, cand = ref[:n], cand[:n]
    n_fft, hop = 1024, 256
    window = np.hanning(n_fft)

    def db(x):
        if len(x) < n_fft:
            x = np.pad(x, (0, n_fft - len(x)))
        frames = np.lib.stride_tricks.sliding_window_view(x, n_fft)[::hop] * window
        return np.abs(np.fft.rfft(frames, axis=1)).T

    s_ref, s_cand, s_diff = db(ref), db(cand), db(cand - ref)
    peak = max(float(s_ref.max()), 1e-12)
    to_db = lambda s: 20 * np.log10(np.maximum(s, 1e-10) / peak)  # noqa: E731
    err = float(np.linalg.norm(cand - ref))
    snr = 20 * math.log10(float(np.linalg.norm(ref)) / err) if err > 0 else math.inf
    extent = (0, n / sr, 0, sr / 2000)
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 3.3), dpi=100, sharey=True, constrained_layout=True)
    titles = ("reference (float64)", "backend", f"difference (backend − reference), SNR {fmt(snr)} dB")
    im = None
    for ax, s, title in zip(axes, (s_ref, s_cand, s_diff), titles):
        im = ax.imshow(to_db(s), origin="lower", aspect="auto", extent=extent, cmap="magma", vmin=-100, vmax=0,
                       interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("time (s)")
    axes[0].set_ylabel("kHz")
    fig.colorbar(im, ax=axes, label="dB re reference peak", shrink=0.9)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return {"seconds": n / sr, "sample_rate": sr, "snr_db": snr}


# ----------------------------------------------------------------------------- pages

def _env():
    # optional runtime: dashboard extra
    from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape

    env = Environment(loader=FileSystemLoader(str(TEMPLATES)), autoescape=select_autoescape(["html"]),
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["num"] = fmt
    env.filters["bytes"] = fmt_bytes
    env.filters["json"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)
    env.globals.update(VERDICT_COLORS=VERDICT_COLORS, VERDICT_INK=VERDICT_INK, NOT_RUN_COLOR=NOT_RUN_COLOR,
                       METRIC_ROWS=METRIC_ROWS, AUDIO_ROWS=AUDIO_ROWS)
    return env


def _thresholds(rec: dict[str, Any], run: Run) -> dict[str, float]:
    """Per output, the largest error that passed under the profile the run was judged with."""
    tol = profile_from(run.selection.get("tolerances")).for_(rec["step"], rec["backend"], rec["mode"])
    out = {}
    for name, m in (rec.get("metrics") or {}).items():
        floor = as_float(m.get("floor_rel_l2"))
        out[name] = max(tol.floor_multiplier * floor if math.isfinite(floor) else 0.0, tol.rel_l2)
    return out


def _audio(rec: dict[str, Any], report_dir: Path, item_dir: Path, site_dir: Path) -> dict[str, Any] | None:
    """Copy the item's WAVs into the site and draw the spectrograms; say which files are missing."""
    audio = rec.get("audio") or {}
    if not audio:
        return None
    players, missing = [], []
    for role, rel in sorted(audio.items(), key=lambda kv: (kv[0] != "reference", kv[0])):
        src = (report_dir / rel)
        if src.is_file():
            dst = item_dir / f"{role}.wav"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            players.append({"role": role, "src": dst.relative_to(site_dir / "items").as_posix()})
        else:
            missing.append(f"{role}: {src}")
    out: dict[str, Any] = {"players": players, "missing": missing, "spectrogram": None}
    roles = {p["role"] for p in players}
    if {"reference", "backend"} <= roles:
        try:
            out["info"] = spectrogram_png(item_dir / "reference.wav", item_dir / "backend.wav",
                                          item_dir / "spectrogram.png")
            out["spectrogram"] = (item_dir / "spectrogram.png").relative_to(site_dir / "items").as_posix()
        except (ValueError, OSError, wave.Error) as e:
            out["missing"].append(f"spectrogram: {e}")
    return out


def _link(path: str, report_dir: Path, page_dir: Path) -> str:
    """A record's path (absolute, relative to the report dir, or to where the run was started) as a
    link from a page."""
    p = Path(path)
    candidates = [p] if p.is_absolute() else [report_dir / p, Path.cwd() / p]
    target = next((c for c in candidates if c.exists()), candidates[0])
    return os.path.relpath(target.resolve(), page_dir.resolve())


def repro_path(rec: dict[str, Any]) -> str | None:
    """The repro bundle of a record: `repro_dir`, or the one harness.bisect wrote."""
    bisect = rec.get("bisect") or {}
    repro = bisect.get("repro") if isinstance(bisect, dict) else None  # a dict (harness.bisect) or a path (onnx-stages)
    return rec.get("repro_dir") or (repro if isinstance(repro, str) else (repro or {}).get("path"))


def build_dashboard(history_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                    report_dir: str | os.PathLike | None = None, factor: float = DEFAULT_FACTOR) -> Path:
    """Build the site for the history in `history_dir` into `out_dir`; returns `out_dir`.

    `report_dir` is where records' relative paths (audio, repro bundles) point (default: the
    history directory's parent)."""
    history_dir, out_dir = Path(history_dir), Path(out_dir)
    report_dir = Path(report_dir) if report_dir is not None else history_dir.parent
    history = load_history(history_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        _build(history, tmp, report_dir, factor)
        os.chmod(tmp, 0o755)
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, old / "site")
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def band_figure(rec: dict[str, Any], margin: float, div_id: str) -> str | None:
    """An artifact that draws its own noise (harness/port/noise.py): per audio metric, the spread of
    the K reference runs (the band, dark), the margin the verdict allows around it (light) and the
    artifact's value (a marker in its verdict's colour); one row per metric, each on its own scale."""
    # optional runtime: dashboard extra
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots  # optional runtime: the dashboard extra

    bands = {k: v for k, v in (rec.get("bands") or {}).items() if isinstance(v.get("band"), (list, tuple))}
    if not bands:
        return None
    fig = make_subplots(rows=len(bands), cols=1, vertical_spacing=0.5 / len(bands))
    for row, (metric, b) in enumerate(bands.items(), 1):
        lo, hi = (_finite(x) for x in b["band"])
        value = _finite(b.get("value"))
        if lo is None or hi is None:
            continue
        pad = margin * (hi - lo)
        # as verdict.band_comparator: only the side where the metric gets worse has a limit
        allowed = [lo - pad if b.get("direction") != "lower" else -math.inf,
                   hi + pad if b.get("direction") != "higher" else math.inf]
        span = [min(lo - pad, value if value is not None else lo), max(hi + pad, value if value is not None else hi)]
        width = (span[1] - span[0]) or abs(hi) or 1.0
        show = [max(allowed[0], span[0] - 0.3 * width), min(allowed[1], span[1] + 0.3 * width)]
        fig.add_trace(go.Bar(y=[metric], x=[show[1] - show[0]], base=[show[0]], orientation="h", marker_color="#e5e7eb",
                             name="allowed (band + margin)", showlegend=row == 1, hoverinfo="skip"), row=row, col=1)
        fig.add_trace(go.Bar(y=[metric], x=[hi - lo or width * 1e-3], base=[lo], orientation="h",
                             marker_color="#9ca3af", name=f"noise band ({b.get('k', '?')} runs)", showlegend=row == 1,
                             hovertemplate=f"{lo:.4g} .. {hi:.4g}<extra>band</extra>"), row=row, col=1)
        if value is not None:
            fig.add_trace(go.Scatter(y=[metric], x=[value], mode="markers+text", text=[f"{value:.4g}"],
                                     textposition="top center", name="artifact", showlegend=row == 1,
                                     marker=dict(size=12, symbol="diamond", color=VERDICT_INK["pass" if b.get("ok")
                                                                                              else "fail"])),
                          row=row, col=1)
        fig.update_xaxes(range=[span[0] - 0.35 * width, span[1] + 0.35 * width], row=row, col=1)
    fig.update_layout(**_layout(barmode="overlay", margin=dict(l=110, r=20, t=10, b=30),
                                legend=dict(orientation="h", x=0, y=-0.12, yanchor="top")))
    return _html(fig, div_id, 90 + 75 * len(bands))


def _build(history: History, site: Path, report_dir: Path, factor: float) -> None:
    # optional runtime: dashboard extra
    import plotly

    env = _env()
    assets = site / "assets"
    assets.mkdir(parents=True)
    shutil.copyfile(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", assets / "plotly.min.js")
    shutil.copyfile(TEMPLATES / "style.css", assets / "style.css")
    regs_by_run = history.regressions(factor)
    runs = history.runs
    latest = history.latest
    common = dict(history=history, latest=latest, runs=runs, factor=factor, run_labels=dict(zip(
        (r.id for r in runs), _labels(runs))), built=time.strftime(
        "%Y-%m-%d %H:%M UTC", time.gmtime()), problems=[str(p) for p in history.problems], plotly_version=plotly.__version__)

    def render(name: str, path: Path, root: str, **kw) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(env.get_template(name).render(root=root, **common, **kw), encoding="utf-8")

    latest_regs = regs_by_run.get(latest.id, []) if latest else []
    render("index.html", site / "index.html", "", page="matrix", upstream=upstream_rows(runs),
           matrix=matrix(latest, latest_regs) if latest else None, regressions=latest_regs,
           overview=overview_figure(runs, "overview") if len(runs) > 0 else None)

    all_recs = [r for run in runs for r in run.records]
    dims = _dims(all_recs)
    pairs = sorted({(r["step"], r["backend"]) for r in all_recs},
                   key=lambda sb: (dims["steps"].index(sb[0]), dims["backends"].index(sb[1])))
    trends = [{"step": s, "backend": b, "id": f"trend-{s}-{b}",
               "n_regressions": sum(1 for run in runs for g in regs_by_run.get(run.id, [])
                                    if _split(g.item, run)[1:3] == (s, b)),
               "html": trend_figure(runs, s, b, regs_by_run, f"trend-{s}-{b}")} for s, b in pairs]
    render("trends.html", site / "trends.html", "", page="trends", trends=trends)

    run_rows = []
    for i, run in enumerate(runs):
        run_rows.append({"run": run, "label": _labels(runs)[i], "regressions": regs_by_run.get(run.id, [])})
    render("runs.html", site / "runs.html", "", page="runs", run_rows=list(reversed(run_rows)))

    if latest:
        items_dir = site / "items"
        for rec in latest.records:
            iid = item_id(rec)
            item_dir = items_dir / iid
            extra = {k: v for k, v in rec.items() if k not in KNOWN_FIELDS}
            render("item.html", items_dir / f"{iid}.html", "../", page="item", rec=rec, iid=iid,
                   regressions=[g for g in latest_regs if g.item == iid],
                   budget=budget_figure(rec, _thresholds(rec, latest), "budget"),
                   band=band_figure(rec, _band_margin(rec), "band"), stages=stage_table(rec),
                   thresholds=_thresholds(rec, latest),
                   trend=trend_figure(runs, rec["step"], rec["backend"], regs_by_run, "item-trend-plot", only_item=iid,
                                      height=300) if len(runs) > 1 else None,
                   audio=_audio(rec, report_dir, item_dir, site),
                   repro=repro_path(rec), repro_link=_link(repro_path(rec), report_dir, items_dir)
                   if repro_path(rec) else None,
                   extra=extra, history_rows=[(lbl, run.by_item().get(iid)) for lbl, run in
                                              zip(_labels(runs), runs) if iid in run.by_item()][::-1])


def _band_margin(rec: dict[str, Any]) -> float:
    """The tolerance profile's `band_margin` for the item (the default profile's; a run's own
    profile is not in its records)."""
    return Profile.load().for_(rec["step"], rec["backend"], rec.get("mode", "dynamic")).band_margin


def upstream_rows(runs: list[Run]) -> list[dict]:
    """The latest run's upstream bundle statuses (harness.upstream), each with the status it had
    in the run before that checked it (`was`), so a defect that became fixed stands out."""
    checked = [r for r in runs if r.upstream]
    if not checked:
        return []
    before = {u["name"]: u["status"] for r in checked[:-1] for u in r.upstream}
    return [{**u, "was": before.get(u["name"])} for u in checked[-1].upstream]


def _split(iid: str, run: Run) -> tuple[str, str, str, str]:
    rec = run.by_item().get(iid)
    return (rec["case"], rec["step"], rec["backend"], rec["mode"]) if rec else ("", "", "", "")
