"""What a difference between a port's tensor and the reference's looks like, in words: a value
non-finite where the reference is finite (said first by every judge), a constant gain and its dB,
a sign flip, a shift, or noise; and where an angle sits on the other side of its branch cut (the
same angle, not a difference). Pure torch: the chain's judges and both localizers use it."""
from __future__ import annotations

import math

import torch

MAX_SHIFT = 64  # samples (or positions) tried when naming a difference a shift


def wraps(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Where `out` and `ref`, each within [-pi, pi] there, differ by about 2*pi (the same angle
    within half a radian): one angle written +pi by one and -pi by the other, an atan2 whose
    imaginary part is a rounding-level +0 or -0. Which side it lands on is rounding's choice, as
    PyTorch's own float32 and float64 show (they differ there too)."""
    d, angle = out - ref, math.pi + 1e-3
    return (out.abs() <= angle) & (ref.abs() <= angle) & (d.abs() > math.pi) & ((d.abs() - 2 * math.pi).abs() < 0.5)


def unwrapped(out: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(`out` with every angle on the other side of its branch cut moved to `ref`'s side, how many)."""
    w = wraps(out, ref)
    n = int(w.sum())
    return (torch.where(w, out - 2 * math.pi * torch.sign(out - ref), out) if n else out), n


def nonfinite(value: torch.Tensor, ref: torch.Tensor | None = None) -> str | None:
    """"NaN: n of N values non-finite" (or "Inf: ...") when `value` holds NaN or Inf where `ref`
    (when given, of the same shape) is finite; else None. Every judge puts it first in its reason."""
    if not value.is_floating_point():
        return None
    bad = ~torch.isfinite(value)
    if ref is not None and tuple(ref.shape) == tuple(value.shape):
        bad &= torch.isfinite(ref)
    n = int(bad.sum())
    if not n:
        return None
    word = "NaN" if bool(torch.isnan(value[bad]).any()) else "Inf"
    return f"{word}: {n} of {value.numel()} values non-finite"


def difference_kind(out: torch.Tensor, ref: torch.Tensor) -> str:
    """What a difference looks like: NaN, a constant gain (and its dB), a sign flip, a shift in
    samples along the last axis, or noise-like (with its SNR)."""
    o, r = out.double().reshape(-1, out.shape[-1]) if out.dim() else out.double().reshape(1, 1), \
        ref.double().reshape(-1, ref.shape[-1]) if ref.dim() else ref.double().reshape(1, 1)
    if not torch.isfinite(o).all():
        return f"NaN/Inf ({int((~torch.isfinite(o)).sum())} values)"
    rr = float((r * r).sum())
    err = float(((o - r) ** 2).sum())
    if rr == 0:
        return "reference is zero"
    if err == 0:
        return "identical"
    if err <= 1e-12 * rr:
        return "rounding-level (rel < 1e-6)"
    gain = float((o * r).sum()) / rr
    resid_gain = float(((o - gain * r) ** 2).sum())
    if resid_gain < 0.05 * err and abs(gain - 1) > 1e-3:
        if gain < 0 and abs(abs(gain) - 1) < 0.05:
            return "sign flip"
        db = 20 * math.log10(abs(gain)) if gain else -math.inf
        return f"constant gain x{gain:.4g} ({db:+.2f} dB)" + (" with a sign flip" if gain < 0 else "")
    n = o.shape[-1]
    if not _a_shift_may_match(o, r, 0.05 * err):
        return f"noise-like (SNR {10 * math.log10(rr / err):.1f} dB)"
    best = (err, 0)
    for s in range(-min(MAX_SHIFT, n - 1), min(MAX_SHIFT, n - 1) + 1):
        if s == 0:
            continue
        a, b = (o[:, s:], r[:, :-s]) if s > 0 else (o[:, :s], r[:, -s:])
        e = float(((a - b) ** 2).sum()) * n / max(n - abs(s), 1)
        if e < best[0]:
            best = (e, s)
    if best[1] and best[0] < 0.05 * err:
        return f"shift by {best[1]:+d} samples"
    snr = 10 * math.log10(rr / err)
    return f"noise-like (SNR {snr:.1f} dB)"


def _a_shift_may_match(o: torch.Tensor, r: torch.Tensor, bound: float, chunk: int = 4096) -> bool:
    """False when no shift's error (as `difference_kind` weighs it) can be below `bound`: each
    shift's squared error summed over its first `chunk` positions only (a part of a sum of squares,
    never more than it) is already above it. The shift search then stops at a fraction of its cost:
    most stages a localization judges differ by noise, and the search ran over every shift there."""
    n = o.shape[-1]
    if n <= chunk:
        return True  # the search is as cheap as this test
    for s in range(-min(MAX_SHIFT, n - 1), min(MAX_SHIFT, n - 1) + 1):
        if s == 0:
            continue
        c = min(chunk, n - abs(s))
        a, b = (o[:, s:s + c], r[:, :c]) if s > 0 else (o[:, :c], r[:, -s:c - s])
        if float(((a - b) ** 2).sum()) * n / max(n - abs(s), 1) <= bound * (1 + 1e-9):
            return True
    return False
