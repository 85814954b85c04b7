"""Terminal tables of records: one item's metrics, and the session's step x backend summary."""
from __future__ import annotations

import math

from tabulate import tabulate

from .backends import audit_labels, backend_names
from .metrics import fmt as _fmt
from .port.onnx_stages import stage_lines
from .port.pte_stages import pte_lines
from .port.chain_localize import chain_lines
from .record import (Judged, NoiseBand, OnnxStages, PortChain, PteEtdump, Record, Rewrite, Unlocalized, backend_label,
                     localization)
from .steps import PIPELINE_STEP_NAMES


ITEM_TABLE_COLUMNS = (  # the metric columns of an item's table
    "nan_rate", "max_abs", "rel_l2", "floor_rel_l2", "floor_ratio", "cosine", "snr_db")


def precision_line(rec: Record) -> str | None:
    """A float16 item's two answers (harness.precision): within the float16 floor or not, shippable or not."""
    if rec.precision != "float16" or rec.verdict.value not in ("pass", "fail"):
        return None if rec.shippable is not False else f"not shippable: {rec.shippable_reason}"
    within = "within the float16 floor" if rec.verdict.value == "pass" else "not within the float16 floor"
    ship = {True: "shippable", False: "not shippable", None: "shippable: n/a"}[rec.shippable]
    floors = ", ".join(f"{n}: fp16 floor {_fmt(m.get('fp16_floor_rel_l2'))}, fp32 floor {_fmt(m.get('fp32_floor_rel_l2'))}"
                       for n, m in rec.metrics.items())
    return f"float16: {within}, {ship} ({rec.shippable_reason}); {floors}"


def shippable_cell(r: Record) -> str:
    """" shippable" / " not shippable" for a summary cell: float16 items always, others when not."""
    if r.verdict.value not in ("pass", "fail") or r.shippable is None:
        return ""
    if r.precision == "float16":
        return " shippable" if r.shippable else " not shippable"
    return "" if r.shippable else " not shippable"


def item_table(rec: Record) -> str:
    """The metric table printed for an item (instead of a traceback)."""
    lines = [f"{rec.item_id}: {rec.verdict.value.upper()}  {rec.reason}"]
    if precision_line(rec):
        lines.append(precision_line(rec))
    if rec.metrics:
        rows = [[name, *(_fmt(m.get(k)) for k in ITEM_TABLE_COLUMNS)] for name, m in rec.metrics.items()]
        lines.append(tabulate(rows, headers=["output", *ITEM_TABLE_COLUMNS], tablefmt="simple"))
    if rec.audio_metrics:
        keys = ("pesq", "mcd_db", "logmel_corr", "logmel_mad_db", "rms_ratio_db", "mrstft", "snr_db", "length_ratio")
        rows = [[name, *(_fmt(a.get(k)) for k in keys)] for name, a in rec.audio_metrics.items()]
        lines.append(tabulate(rows, headers=["audio", *keys], tablefmt="simple"))
    if rec.real_time:
        rt = rec.real_time
        lines.append(f"real-time factor {_fmt(rt['rtf'])}: {rt['run_s']:.2f} s of run time for {rt['audio_s']:.2f} s of audio")
    if rec.durations:
        lines.append("durations: " + ", ".join(f"{k} {v}" for k, v in rec.durations.items()))
    lines += port_lines(rec)
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


def port_lines(rec: Record) -> list[str]:
    """A port's stage table (local and chained error per stage output, the kind of difference, one
    word per row: `row_word`), the stages named as defects (as the verdict's reason names them),
    and each audio metric beside its noise band (harness/port)."""
    lines = []
    if rec.stages:
        rows, defects = [], []
        b = rec.bisect
        inside = None
        if isinstance(b, PortChain):  # a chain localized inside its stages (harness/port/chain_localize.py)
            inside = ", ".join(f"{d['stage']}/{d['module']}" for d in b.defects) or None
        elif b is not None and len(rec.stages) == 1:  # a one-stage port: its stage's own localization
            inside = (", ".join(d["stage"] for d in b["defects"]) + " (ranked by audio effect)"
                      if len(b.get("defects") or ()) > 1 else b.get("first_stage"))
        for row in rec.stages:
            bucket = sorted({str(b) for b in (row.bucket or {}).values()})
            stage = row.stage + (f" [{'/'.join(bucket)}]" if bucket else "")  # the bucket(s) it ran
            for tensor, m in row.outputs.items():
                loc, ch = m.local, m.chained
                word = row_word(loc, ch)
                if word == "DEFECT" and row.stage not in defects:
                    defects.append(row.stage)
                kind = loc.kind if word == "DEFECT" else ch.kind or loc.kind
                rows.append([stage, tensor, _fmt(loc.rel_l2), _fmt(loc.floor_rel_l2), _fmt(ch.rel_l2), word, kind])
        lines.append(tabulate(rows, headers=["stage", "tensor", "local rel_l2", "floor", "chained rel_l2", "row",
                                             "kind of difference"], tablefmt="simple"))
        lines.append("row: within (its local error within its floor), DEFECT (its local error leaves it), "
                     "accumulated (within locally, the chain's error from earlier stages), not judged (why)")
        if defects:
            lines.append("defects (local error leaves its floor): " + ", ".join(
                f"{d} (first)" if i == 0 and len(defects) > 1 else d for i, d in enumerate(defects))
                + (f"; localized inside {'it' if len(rec.stages) == 1 else 'them'} to {inside}" if inside else ""))
            ranked = sorted((r for r in rec.stages if r.defect), key=lambda r: r.defect["rank"])
            if ranked:  # two defects or more in a chain (harness.port.chain.rank_chain_defects)
                lines.append("ranked by audio effect: " + ", ".join(r.stage for r in ranked))
    bands = {k: v for k, v in rec.bands.items() if isinstance(v, NoiseBand)}
    if bands:
        rows = [[k, _fmt(v.value), f"[{_fmt(v.band[0])}, {_fmt(v.band[1])}]", v.direction,
                 "in" if v.ok else "OUTSIDE"] for k, v in bands.items()]
        lines.append(f"audio against the noise band (K = {next(iter(bands.values())).k or ''} reference runs "
                     "with other noise seeds):")
        lines.append(tabulate(rows, headers=["metric", "artifact", "noise band", "passes when", ""], tablefmt="simple"))
    z = rec.bands.get("zero_noise")
    if z:
        lines.append(f"against the zero-noise reference, sample by sample: rel_l2 {_fmt(z.rel_l2)}, "
                     f"SNR {_fmt(z.snr_db)} dB, {z.kind}")
    return lines


def row_word(local: Judged, chained: Judged) -> str:
    """One word for a stage output's row, meaning one thing: DEFECT (the local error leaves its
    floor: the stage's own), accumulated (within locally, the chained value leaves it: earlier
    stages' error), not judged (and why: the noise band judges a stage that draws its own noise), or
    within (both within). A NaN is never within: its row is a DEFECT or accumulated."""
    if not local.ok:
        return "DEFECT"
    if not chained.ok:
        return "accumulated"
    if local.why.startswith("draws its own noise"):
        return "not judged: noise band"
    return "within"


def audit_lines(audit: dict) -> list[str]:
    """The backends' audits: what a backend will not take, and why it fell back (each backend
    names its own audit keys: `Backend.audit_labels`)."""
    lines = [f"{label}: " + ", ".join(f"{k} x{v}" for k, v in audit[key].items())
             for key, label in audit_labels().items() if audit.get(key)]
    for key in ("dynamo_error", "audit_error"):
        if audit.get(key):
            lines.append(f"{key.replace('_', ' ')}: {audit[key]}")
    if "largest_activation" in audit:
        lines.append(f"largest activation {_fmt(audit['largest_activation'])} = "
                     f"{_fmt(audit['largest_activation_of_fp16_max'])} of float16's 65,504; over it: "
                     f"{', '.join(audit['modules_over_fp16_max']) or 'none'}; first non-finite in float16: "
                     f"{audit['fp16_first_nonfinite'] or 'none'}")
    return lines


def verdict_cell(r: Record) -> str:
    """An item's verdict and key figures in a few words: its worst output's error against its
    floor (or its NaN rate), PESQ where there is audio, the real-time factor; for an item that did
    not run, the start of its reason. A summary cell, and the line printed when the item ends."""
    worst = max(r.metrics.values(), key=lambda m: m.get("floor_ratio", 0) if isinstance(m.get("floor_ratio"), float) else 0, default=None)
    cell = r.verdict.value.upper()
    nan_rate = max((m.get("nan_rate") or 0 for m in r.metrics.values()), default=0)
    if nan_rate and r.verdict.value == "fail":  # a NaN output has no meaningful error figure
        cell += f" NaN {nan_rate:.0%}"
    elif worst is not None and r.verdict.value in ("pass", "fail"):
        fp16 = " fp16" if r.precision == "float16" else ""  # harness.precision
        ratio = worst.get("floor_ratio")
        # float16 eager non-finite (en_long's SineGen): there is no floor to be a multiple of
        nonfinite = isinstance(ratio, float) and not math.isfinite(ratio)  # a record's NaN is a float
        floor = f"{fp16.strip() or 'fp32'} floor non-finite" if nonfinite else f"{_fmt(ratio)}x{fp16} floor"
        cell += f" rel {_fmt(worst.get('rel_l2'))} ({floor})"
    audio = next((a for n, a in r.audio_metrics.items() if not n.endswith("_unforced")), None)
    if audio is not None and r.verdict.value in ("pass", "fail") and not nan_rate:
        cell += f" PESQ {_fmt(audio.get('pesq'))}"
    cell += shippable_cell(r)
    if r.real_time.get("rtf") and r.verdict.value in ("pass", "fail"):
        cell += f" RTF {_fmt(r.real_time['rtf'])}"
    if r.verdict.value not in ("pass", "fail") and r.reason:
        cell += f" ({r.reason.split(';')[0][:60]})"
    return cell


def summary_table(records: list[Record], tablefmt: str = "simple") -> str:
    """One row per (case, step, mode) in pipeline order, one column per backend in the registry's
    order: verdict and the key metric (or, for an item that did not run, the start of its reason).
    `tablefmt="github"` gives Markdown (the README's matrices)."""
    known = backend_names()
    label = lambda r: backend_label(r.backend, r.target.get("name"))  # noqa: E731 - `xnnpack@mac`: a column per target
    backends = sorted({label(r) for r in records},
                      key=lambda b: (known.index(b.split("@")[0]) if b.split("@")[0] in known else len(known), b))
    step_rank = {name: i for i, name in enumerate(PIPELINE_STEP_NAMES)}
    rows: dict[tuple, dict] = {}
    for r in records:
        key = (r.case, step_rank.get(r.step, len(step_rank)), r.step, r.mode)
        drift = max((d["rel_l2"] for d in r.rewrite_drift.values()), default=None)
        rows.setdefault(key, {})[label(r)] = verdict_cell(r)
        if drift is not None:
            rows[key]["drift"] = _fmt(drift)
    table = [[key[0], key[2], key[3], rows[key].get("drift", "-"), *(rows[key].get(b, "not run") for b in backends)]
             for key in sorted(rows)]  # key: (case, pipeline rank, step, mode)
    return tabulate(table, headers=["case", "step", "mode", "rewrite drift", *backends], tablefmt=tablefmt)


def _cut_status(row: dict) -> str:
    """PASS, FAIL, ...; a value beyond the rule whose error does not start the divergence says so."""
    why = row.get("why") or ""
    note = next((f", {word}" for start, word in (("absorbed", "absorbed"), ("carried", "carried"), ("as ", "in band"))
                 if why.startswith("beyond the rule here, " + start)), "")
    return row["status"].upper() + (note if row["status"] == "pass" else "")


def format_bisect(b) -> str:
    """A localization's lines under an item's metric table (a dict is read as the record reads it)."""
    b = localization(b)
    if isinstance(b, PortChain):
        return "\n".join(chain_lines(b))
    if isinstance(b, PteEtdump):
        return "\n".join(pte_lines(b))
    if isinstance(b, OnnxStages):
        return "\n".join(stage_lines(b))
    if isinstance(b, Unlocalized):
        return f"localization: {b.error}"
    if isinstance(b, Rewrite):  # the first failing module's bundle
        return f"repro of {b.module}: {b.repro or b.get('repro_error')}"
    if b.status == "error":
        return f"bisect: could not run: {b.message}"
    lines = []
    rows = b.modules or []
    if rows:
        lines.append(f"bisect, module stage ({len(rows)} module cuts judged, each with everything before it; "
                     f"{b.get('module_compiles', 0)} compiles):")
        band = b.get("band")
        table = [[r["module"], r["type"], _cut_status(r), r["n_ops"], _fmt(r.get("rel_l2")),
                  _fmt(r.get("floor_rel_l2")), _fmt(r.get("floor_ratio")),
                  *([_fmt(r.get("band_rel_l2"))] if band else [])] for r in rows]
        lines.append(tabulate(table, headers=["module", "type", "cut after it", "float ops to it", "rel_l2", "floor",
                                              "ratio", *([f"from {band['backend']}"] if band else [])],
                              tablefmt="simple"))
        if band:
            lines.append(f"band: the same values on {band['backend']} ({band['status']}); "
                         f"{len(band.get('within_band') or [])} values beyond the rule but within it"
                         + (f": {band.get('why', '')[:160]}" if band["status"] not in ("pass", "fail") else ""))
        lines.append(f"first failing module: {b.first_module or 'none (every module cut passes)'}")
    if b.status != "localized":
        lines.append(f"bisect: not localized: {b.message}")
    else:
        f = b.first_op
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
    lines.append(f"  op search in {b.get('region')}: {b.get('bisect_compiles', 0)} programs tapping {b.get('n_nodes', 0)} "
                 f"float nodes (log2 = {math.log2(max(b.get('n_nodes', 1), 1)):.1f}); total compiles "
                 f"{b.get('compiles', 0)} (+{b.get('compile_hits', 0)} cached), runs {b.get('runs', 0)}, {b.get('seconds')} s")
    for p in b.get("probe_failures") or []:
        lines.append(f"  probe that could not run (not a divergence; a finding of its own): {p['label']} "
                     f"{p['status']}: {p.get('why', '')[:160]}")
    r = b.repro
    if r:
        state = ("reproduces when run alone" if r.get("reproduces") else
                 f"repro.py exit code {r.get('exit_code')}" if "exit_code" in r else "not verified")
        lines.append(f"  repro: {r['path']}/ ({r['bytes'] / 1024:.0f} KiB, {r['n_ops']} ops, {state})")
    return "\n".join(lines)
