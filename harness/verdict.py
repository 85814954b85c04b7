"""The one place that decides verdicts.

Statuses follow coremltools' PASS / FAIL / UNKNOWN idea, with the failure kinds a port meets.
The accuracy rule is torch's minifier rule: the backend's error against float64 may be a small
multiple of fp32 eager's own error against float64 (the noise floor), or under an explicit
tolerance. A NaN or Inf that the reference does not have always fails.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import yaml
from pydantic import ConfigDict, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass

from .metrics.tensor import compare_to_floor, error_metrics
from .plumbing.errors import UsageError


class Verdict(str, enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    EXPORT_ERROR = "export_error"
    COMPILE_ERROR = "compile_error"
    RUN_ERROR = "run_error"
    CRASHED = "crashed"
    TIMEOUT = "timeout"
    SKIPPED = "skipped"

    @property
    def ok(self) -> bool:
        return self in (Verdict.PASS, Verdict.SKIPPED)


@pydantic_dataclass(frozen=True, config=ConfigDict(extra="forbid"))
class Tolerance:
    """Pass when rel_l2 <= floor_multiplier * floor_rel_l2, or rel_l2 <= rel_l2 (absolute).
    A pydantic dataclass: an unknown key or a value of the wrong type in a profile is an error
    that names the field."""

    floor_multiplier: float = 4.0
    rel_l2: float = 1e-5
    min_cosine: float | None = None
    min_pesq: float = 4.0  # audio outputs: the porting guides' quality bars
    max_mcd_db: float = 0.5
    max_level_db: float = 1.0  # shippable: |RMS level difference| against float64 (harness.precision)
    band_margin: float = 0.5  # noise band (harness/port/noise.py): widened by this fraction of its width


DEFAULT_PROFILE = Path(__file__).resolve().parent / "tolerances.yaml"


@dataclass
class Profile:
    """Tolerances with a default and overrides keyed by step and/or backend (Polygraphy-style)."""

    default: Tolerance = field(default_factory=Tolerance)
    overrides: list[tuple[dict[str, str], Tolerance]] = field(default_factory=list)

    @classmethod
    def load(cls, path: str | Path | None = None) -> "Profile":
        path = Path(path or DEFAULT_PROFILE)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise UsageError(f"tolerance profile {path}: cannot read ({e})") from None
        where = "default"
        try:
            default = Tolerance(**data.get("default", {}))
            overrides = []
            for i, o in enumerate(data.get("overrides", [])):
                where = f"overrides[{i}]"
                match = {k: o.pop(k) for k in ("step", "backend", "mode") if k in o}
                overrides.append((match, Tolerance(**{**default.__dict__, **o})))
        except (TypeError, ValidationError) as e:
            fields = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()) \
                if isinstance(e, ValidationError) else str(e)
            raise UsageError(f"tolerance profile {path}, {where}: {fields}") from None
        return cls(default, overrides)

    def for_(self, step: str, backend: str, mode: str) -> Tolerance:
        tol = self.default
        item = dict(step=step, backend=backend, mode=mode)
        for match, t in self.overrides:
            if all(item[k] == v for k, v in match.items()):
                tol = t
        return tol


def comparator(tol: Tolerance) -> Callable[[dict[str, Any]], tuple[bool, str]]:
    """Build the accuracy check for one tolerance: metrics of one output -> (ok, why)."""

    def check(m: dict[str, Any]) -> tuple[bool, str]:
        if m.get("new_nonfinite", 0) or m.get("nan_rate", 0) or m.get("inf_rate", 0):
            return False, f"non-finite output (NaN rate {m['nan_rate']:.2%}, Inf rate {m['inf_rate']:.2%})"
        rel, floor = m["rel_l2"], m.get("floor_rel_l2", math.nan)
        which = "fp32" if m.get("floor_precision", "float32") == "float32" else "float16"
        if math.isnan(rel):
            return False, "error is NaN"
        if tol.min_cosine is not None and m["cosine"] < tol.min_cosine:
            return False, f"cosine {m['cosine']:.6f} < {tol.min_cosine}"
        if rel <= tol.rel_l2:
            return True, f"rel_l2 {rel:.2e} <= tolerance {tol.rel_l2:.0e}"
        if not math.isnan(floor) and rel <= tol.floor_multiplier * floor:
            return True, f"rel_l2 {rel:.2e} <= {tol.floor_multiplier:g} x {which} floor {floor:.2e}"
        if m.get("floor_precision") == "float16" and math.isnan(floor):  # the output itself is finite here
            return True, (f"rel_l2 {rel:.2e}, finite where float16 eager is not (no float16 floor): "
                          "better than float16 allows (see shippable)")
        return False, (f"rel_l2 {rel:.2e} > {tol.floor_multiplier:g} x {which} floor {floor:.2e} "
                       f"and > tolerance {tol.rel_l2:.0e}")

    return check


def audio_comparator(tol: Tolerance) -> Callable[[dict[str, Any]], tuple[bool, str]]:
    """Build the perceptual check for one tolerance: audio metrics -> (ok, why). NaN fails."""

    def check(a: dict[str, Any]) -> tuple[bool, str]:
        pesq, mcd = a.get("pesq", math.nan), a.get("mcd_db", math.nan)
        if a.get("nan_rate", 0) or a.get("inf_rate", 0):
            return False, "non-finite audio"
        if not pesq >= tol.min_pesq:  # also catches NaN
            return False, f"PESQ {pesq:.2f} < {tol.min_pesq}"
        if not mcd <= tol.max_mcd_db:
            return False, f"MCD {mcd:.2f} dB > {tol.max_mcd_db} dB"
        return True, f"PESQ {pesq:.2f} >= {tol.min_pesq}, MCD {mcd:.2f} dB <= {tol.max_mcd_db} dB"

    return check


def band_comparator(tol: Tolerance) -> Callable[[str, float, list[float], str], tuple[bool, str]]:
    """The check of one audio metric against the spread that the vocoder's noise alone gives it
    (harness/port/noise.py): inside [lo, hi] widened by `band_margin` x its width on the side that
    matters (`direction`: higher, lower or both). NaN fails."""

    def check(metric: str, value: float, band: list[float], direction: str) -> tuple[bool, str]:
        lo, hi = band
        if math.isnan(value):
            return False, f"{metric} is NaN"
        if math.isnan(lo) or math.isnan(hi):
            return False, f"{metric}: no noise band (the reference's own metric is NaN)"
        pad = tol.band_margin * (hi - lo)
        low_ok = direction == "lower" or value >= lo - pad
        high_ok = direction == "higher" or value <= hi + pad
        where = f"{metric} {value:.3g} {'in' if low_ok and high_ok else 'outside'} noise band [{lo:.3g}, {hi:.3g}]"
        return low_ok and high_ok, where + ("" if pad == 0 else f" +/- {pad:.2g}")

    return check


def judge(per_output: dict[str, dict[str, Any]], tol: Tolerance, audio: dict[str, dict[str, Any]] | None = None,
          audio_only: bool = False) -> tuple[Verdict, str]:
    """Every output passes the accuracy rule (unless `audio_only`: e2e audio whose length and
    alignment follow the backend's own durations) and every judged audio output the quality bars."""
    checks = [] if audio_only else [(n, comparator(tol)(m)) for n, m in per_output.items()]
    if audio_only:
        checks += [(n, (False, "non-finite output")) for n, m in per_output.items()
                   if m.get("new_nonfinite", 0) or m.get("nan_rate", 0) or m.get("inf_rate", 0)]
    checks += [(f"{n} (audio)", audio_comparator(tol)(a)) for n, a in (audio or {}).items() if not n.endswith("_unforced")]
    failures = [f"{n}: {why}" for n, (ok, why) in checks if not ok]
    if failures:
        return Verdict.FAIL, "; ".join(failures)
    return Verdict.PASS, "; ".join(f"{n}: {why}" for n, (ok, why) in checks)


@dataclass
class StepJudgement:
    """Per-output metrics against float64 (with the floor beside them), the drifts, the verdict."""

    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    patch_drift: dict[str, dict[str, float]] = field(default_factory=dict)
    rewrite_drift: dict[str, dict[str, float]] = field(default_factory=dict)
    audio_metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    verdict: Verdict = Verdict.FAIL
    reason: str = ""
    shippable: bool | None = None  # what a listener gets (`shippable`); None: the step has no such output
    shippable_reason: str = ""


def shippable(tol: Tolerance, audio: dict[str, dict[str, Any]] | None = None,
              durations: dict[str, tuple[Any, Any]] | None = None) -> tuple[bool | None, str]:
    """The *shippable* bar, apart from the accuracy rule: what a listener hears. Audio outputs
    (metrics against float64): PESQ >= min_pesq, MCD <= max_mcd_db and the RMS level within
    +-max_level_db; `duration` outputs (backend, float64 reference): every valid token's rounded
    duration (kokoro's round, clamped at 1) equal to the reference's. (None, reason) when the step has
    neither: its output is not heard, only what it feeds. NaN is never shippable."""
    checks = []
    for n, a in (audio or {}).items():
        if n.endswith("_unforced"):
            continue
        ok, why = audio_comparator(tol)(a)
        level = a.get("rms_ratio_db", math.nan)
        if ok and not abs(level) <= tol.max_level_db:
            ok, why = False, f"level {level:+.2f} dB outside +-{tol.max_level_db} dB"
        elif ok:
            why += f", level {level:+.2f} dB"
        checks.append((n, ok, why))
    for n, (out, ref) in (durations or {}).items():
        out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
        if not np.isfinite(out).all():
            checks.append((n, False, "non-finite durations"))
            continue
        r = lambda x: np.maximum(np.round(x), 1)  # noqa: E731
        differ = int((r(out) != r(ref)).sum())
        checks.append((n, differ == 0, f"{differ} of {out.size} rounded durations differ from float64's"))
    if not checks:
        return None, "no audio or duration output"
    return all(ok for _, ok, _ in checks), "; ".join(f"{n}: {why}" for n, _, why in checks)


def apply_float16_floor(m: dict[str, Any], fp16_metrics: dict[str, Any], precision: str) -> dict[str, Any]:
    """Put the float16 floor (float16 eager's own error against float64) beside the fp32 one; for a
    float16 backend it becomes *the* floor (`floor_rel_l2`, `floor_ratio`, `floor_precision`)."""
    m["fp32_floor_rel_l2"] = m["floor_rel_l2"]
    m["fp16_floor_rel_l2"] = fp16_metrics["rel_l2"]
    m["fp16_floor_nan_rate"] = fp16_metrics["nan_rate"]
    m["floor_precision"] = precision
    if precision == "float16":
        floor = fp16_metrics["rel_l2"]
        m["floor_rel_l2"], m["floor_max_abs"] = floor, fp16_metrics["max_abs"]
        rel = m["rel_l2"]
        m["floor_ratio"] = (math.nan if math.isnan(rel) or math.isnan(floor) else rel / floor if floor > 0
                            else 1.0 if rel == 0 else math.inf)
    return m


DRIFT_KEYS = ("rel_l2", "max_abs", "snr_db")


def judge_outputs(names: list[str], outputs: list, refs, valid: Callable[[str, Any], Any], tol: Tolerance,
                  audio: Callable[[], dict[str, dict[str, Any]]] | None = None,
                  precision: str = "float32") -> StepJudgement:
    """Judge a step's outputs against `refs` (harness.reference.References) on the valid region
    (`valid(name, tensor)`): shapes first, then the accuracy rule per output and the audio bars
    (`audio()` gives the audio metrics, computed once the shapes are known to agree). A float16
    backend (`precision`) is judged against the float16 floor (`refs.fp16`), the fp32 floor beside
    it; every item also gets the `shippable` bar."""
    j = StepJudgement()
    if len(outputs) != len(names):
        j.verdict, j.reason = Verdict.RUN_ERROR, f"{len(outputs)} outputs, expected {len(names)} ({names})"
        return j
    for name, out in zip(names, outputs):
        ref = refs.fp64[name]
        if tuple(out.shape) != tuple(ref.shape):
            j.reason = f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
            return j
        j.metrics[name] = compare_to_floor(valid(name, out), valid(name, refs.fp32[name]), valid(name, ref))
        if getattr(refs, "fp16", None) is not None:
            apply_float16_floor(j.metrics[name], error_metrics(valid(name, refs.fp16[name]), valid(name, ref)), precision)
        if refs.variant:
            drift = error_metrics(valid(name, refs.fp32[name]), valid(name, refs.plain32[name]))
            j.patch_drift[name] = {k: drift[k] for k in DRIFT_KEYS}
        if refs.dynamic32 is not None:
            drift = error_metrics(valid(name, refs.fp32[name]), refs.dynamic32[name])
            j.rewrite_drift[name] = {**{k: drift[k] for k in DRIFT_KEYS},
                                     "floor_rel_l2": j.metrics[name].get("fp32_floor_rel_l2",
                                                                         j.metrics[name]["floor_rel_l2"])}
    j.audio_metrics = audio() if audio else {}
    # a float16 backend's verdict is "within the float16 floor"; what a listener hears is `shippable`
    j.verdict, j.reason = judge(j.metrics, tol, None if precision == "float16" else j.audio_metrics)
    durations = {n: (valid(n, o), valid(n, refs.fp64[n])) for n, o in zip(names, outputs) if n == "duration"}
    j.shippable, j.shippable_reason = shippable(tol, j.audio_metrics, durations)
    return j
