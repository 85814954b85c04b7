"""Tensor metrics of a candidate against a float64 reference, with the fp32 noise floor beside them.

Pure numpy. A NaN or Inf in the candidate where the reference is finite is counted, and makes the
error metrics NaN: a non-finite output can never look close (unlike `np.isclose(equal_nan=True)`).
"""
from __future__ import annotations

import math
from typing import TypedDict

import numpy as np


class ErrorMetrics(TypedDict, total=False):
    """What `error_metrics` and `compare_to_floor` return, per output (records keep it as JSON)."""

    nan_rate: float
    inf_rate: float
    new_nonfinite: int  # NaN/Inf in the candidate where the reference is finite
    ref_peak: float
    max_abs: float
    mean_abs: float
    rel_l2: float
    cosine: float
    snr_db: float
    floor_rel_l2: float  # fp32 eager's own rel_l2 against float64: the noise floor
    floor_max_abs: float
    floor_ratio: float  # rel_l2 / floor_rel_l2


def _f64(a) -> np.ndarray:
    if hasattr(a, "detach"):
        a = a.detach().cpu().numpy()
    return np.asarray(a, dtype=np.float64)


def error_metrics(candidate, reference) -> ErrorMetrics:
    """NaN/Inf rates, max-abs, mean-abs, relative L2, cosine similarity and SNR (dB)."""
    c, r = _f64(candidate), _f64(reference)
    if c.shape != r.shape:
        raise ValueError(f"shape mismatch: candidate {c.shape} vs reference {r.shape}")
    n = max(c.size, 1)
    ref_finite = np.isfinite(r)
    out = {
        "nan_rate": float(np.isnan(c).sum() / n),
        "inf_rate": float(np.isinf(c).sum() / n),
        "new_nonfinite": int((~np.isfinite(c) & ref_finite).sum()),
        "ref_peak": float(np.max(np.abs(r[ref_finite]))) if ref_finite.any() else math.nan,
    }
    if out["new_nonfinite"] or not np.isfinite(c).all():
        return out | dict(max_abs=math.nan, mean_abs=math.nan, rel_l2=math.nan, cosine=math.nan, snr_db=math.nan)
    diff = c - r
    err, ref_norm, c_norm = float(np.linalg.norm(diff)), float(np.linalg.norm(r)), float(np.linalg.norm(c))
    out["max_abs"] = float(np.max(np.abs(diff))) if diff.size else 0.0
    out["mean_abs"] = float(np.mean(np.abs(diff))) if diff.size else 0.0
    out["rel_l2"] = err / ref_norm if ref_norm > 0 else (0.0 if err == 0 else math.inf)
    out["cosine"] = float(np.dot(c.ravel(), r.ravel()) / (c_norm * ref_norm)) if c_norm * ref_norm > 0 else (
        1.0 if err == 0 else 0.0)
    out["snr_db"] = 20 * math.log10(ref_norm / err) if err > 0 else math.inf
    return out


def compare_to_floor(candidate, fp32_eager, fp64_reference) -> ErrorMetrics:
    """The candidate's error against fp64, fp32 eager's own error (the floor), and their ratio."""
    m = error_metrics(candidate, fp64_reference)
    floor = error_metrics(fp32_eager, fp64_reference)
    m["floor_rel_l2"] = floor["rel_l2"]
    m["floor_max_abs"] = floor["max_abs"]
    if math.isnan(m["rel_l2"]):
        m["floor_ratio"] = math.nan
    elif floor["rel_l2"] > 0:
        m["floor_ratio"] = m["rel_l2"] / floor["rel_l2"]
    else:
        m["floor_ratio"] = 1.0 if m["rel_l2"] == 0 else math.inf
    return m
