#!/usr/bin/env python3
"""Repro: ExecuTorch: InstanceNorm returns NaN on a long channel (one-pass float32 variance)

Minimal program: program.pt2 (torch.export of the module in REPORT.md), inputs.pt, and the float64
result of the same program, expected.pt. Needs only torch, numpy and executorch (versions in ENV.md).

Exit code: 1 while the defect reproduces, 0 once it is fixed, 2 when it cannot run here (the
runtime is not installed), 3 when it fails differently (read the output).
"""
import sys
from pathlib import Path

import numpy as np
import torch

try:  # the runtime under test: without it, this cannot run here (exit 2)
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

HERE = Path(__file__).resolve().parent
SIGNATURE = 'NaN'  # the text that is this defect


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


def check(program, inputs, expected):
    """ExecuTorch's portable InstanceNorm (XNNPACK leaves it there): NaN, or an error far beyond
    PyTorch float32's, where the variance cancels in one pass."""
    buffer = to_edge_transform_and_lower(program, partitioner=[]).to_executorch().buffer
    got = torch.as_tensor(Runtime.get().load_program(buffer).load_method("forward").execute(
        [t.contiguous() for t in inputs])[0])
    return one_pass_variance_verdict(program, inputs, expected, got, "")


def main():
    try:
        import executorch  # noqa: F401
    except ImportError as e:
        print(f"cannot run here: {e}")
        return 2
    program = torch.export.load(str(HERE / "program.pt2"))
    inputs = torch.load(HERE / "inputs.pt", weights_only=True)
    expected = torch.load(HERE / "expected.pt", weights_only=True)["float64"]
    print(f"torch {torch.__version__}, numpy {np.__version__}; inputs " +
          ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs))
    code, message = check(program, inputs, expected)
    print(message)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - not the defect's signature: exit 3, never 1
        import traceback

        traceback.print_exc()
        print(f"CHANGED: repro.py itself failed: {type(e).__name__}: {e}")
        sys.exit(3)
