"""What every check shares: the defect's exit code from an error or from values against float64."""
from __future__ import annotations

import traceback
from pathlib import Path

import torch

# repro.py defines these two for the checks
SIGNATURE = ""
HERE = Path(".")


def classify(error):
    """The runtime raised: the defect when its message carries SIGNATURE, else a different failure."""
    text = f"{type(error).__name__}: {error}"
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    print("".join(frames[-6:]).rstrip())
    if SIGNATURE in text:
        return 1, f"REPRODUCED: {text.strip().splitlines()[-1][:300]}"
    return 3, f"CHANGED: a different error than {SIGNATURE!r}: {text.strip().splitlines()[-1][:300]}"


def values_match(program, inputs, expected, got, runtime):
    """Converted and ran: compare with the float64 expected output, beside PyTorch float32's own error."""
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ours = list(ours) if isinstance(ours, (list, tuple)) else [ours]
    worst = []
    for ref, o32, out in zip(expected, ours, got):
        out = torch.as_tensor(out).double().reshape(ref.shape)
        if ref.dtype in (torch.bool, torch.int64, torch.int32):
            worst.append((0.0 if torch.equal(out.to(ref.dtype), ref) else float("inf"), 0.0))
            continue
        norm = float(ref.norm()) or 1.0
        worst.append((float((out - ref).norm()) / norm, float((o32.double() - ref).norm()) / norm))
    bad = [(e, f) for e, f in worst if not (e == e) or e > max(1e-5, 4 * f)]
    table = ", ".join(f"rel_l2 {e:.3e} (PyTorch fp32 {f:.3e})" for e, f in worst)
    if bad:
        return 3, f"CHANGED: {runtime} converts now, but its outputs differ from float64: {table}"
    return 0, f"FIXED: {runtime} converts and matches float64 within 4 x PyTorch float32's error: {table}"


def one_pass_variance_verdict(program, inputs, expected, got, runtime):
    """(exit code, message) for an InstanceNorm's output `got`: NaN, or an error over 4x PyTorch
    float32's own against float64, is the one-pass variance E[x^2] - E[x]^2 cancelling."""
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ref = expected[0]
    floor = float((ours.double() - ref).norm() / ref.norm())
    nan = float(torch.isnan(got).float().mean())
    if nan:
        return 1, (f"REPRODUCED: {nan:.0%} NaN{runtime} where PyTorch float32 is within rel_l2 {floor:.1e} of "
                   f"float64: the variance, E[x^2] - E[x]^2 from float32 sums, is negative")
    err = float((got.double() - ref).norm() / ref.norm())
    if err > 4 * floor:
        return 1, f"REPRODUCED: rel_l2 {err:.3e} against PyTorch float32's {floor:.3e} (one-pass variance)"
    return 0, f"FIXED: rel_l2 {err:.3e}, PyTorch float32 {floor:.3e}"
