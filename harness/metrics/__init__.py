"""Metrics: pure functions on numpy arrays (tensor metrics in `tensor`, audio in `audio`), and how
a metric value prints in the terminal tables, the bisection's table and the repro's report."""
from __future__ import annotations

import math


def fmt(v) -> str:
    """3 significant digits; small values in scientific notation; None as '-'."""
    if isinstance(v, str):
        return v
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.3g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.2e}"
    return str(v)
