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

import yaml


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


@dataclass(frozen=True)
class Tolerance:
    """Pass when rel_l2 <= floor_multiplier * floor_rel_l2, or rel_l2 <= rel_l2 (absolute)."""

    floor_multiplier: float = 4.0
    rel_l2: float = 1e-5
    min_cosine: float | None = None
    min_pesq: float = 4.0  # audio outputs: the porting guides' quality bars
    max_mcd_db: float = 0.5


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
            raise ValueError(f"tolerance profile {path}: cannot read ({e})") from None
        try:
            default = Tolerance(**data.get("default", {}))
            overrides = []
            for i, o in enumerate(data.get("overrides", [])):
                match = {k: o.pop(k) for k in ("step", "backend", "mode") if k in o}
                overrides.append((match, Tolerance(**{**default.__dict__, **o})))
        except TypeError as e:
            raise ValueError(f"tolerance profile {path}: {e}") from None
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
        if math.isnan(rel):
            return False, "error is NaN"
        if tol.min_cosine is not None and m["cosine"] < tol.min_cosine:
            return False, f"cosine {m['cosine']:.6f} < {tol.min_cosine}"
        if rel <= tol.rel_l2:
            return True, f"rel_l2 {rel:.2e} <= tolerance {tol.rel_l2:.0e}"
        if not math.isnan(floor) and rel <= tol.floor_multiplier * floor:
            return True, f"rel_l2 {rel:.2e} <= {tol.floor_multiplier:g} x fp32 floor {floor:.2e}"
        return False, (f"rel_l2 {rel:.2e} > {tol.floor_multiplier:g} x fp32 floor {floor:.2e} "
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


DRIFT_KEYS = ("rel_l2", "max_abs", "snr_db")


def judge_outputs(names: list[str], outputs: list, refs, valid: Callable[[str, Any], Any], tol: Tolerance,
                  audio: Callable[[], dict[str, dict[str, Any]]] | None = None) -> StepJudgement:
    """Judge a step's outputs against `refs` (harness.reference.References) on the valid region
    (`valid(name, tensor)`): shapes first, then the accuracy rule per output and the audio bars
    (`audio()` gives the audio metrics, computed once the shapes are known to agree)."""
    from .metrics.tensor import compare_to_floor, error_metrics

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
        if refs.variant:
            drift = error_metrics(valid(name, refs.fp32[name]), valid(name, refs.plain32[name]))
            j.patch_drift[name] = {k: drift[k] for k in DRIFT_KEYS}
        if refs.dynamic32 is not None:
            drift = error_metrics(valid(name, refs.fp32[name]), refs.dynamic32[name])
            j.rewrite_drift[name] = {**{k: drift[k] for k in DRIFT_KEYS},
                                     "floor_rel_l2": j.metrics[name]["floor_rel_l2"]}
    j.audio_metrics = audio() if audio else {}
    j.verdict, j.reason = judge(j.metrics, tol, j.audio_metrics)
    return j
