#!/usr/bin/env python3
"""Repro: ExecuTorch: a program exported from a [1, N, 1] transposed view cannot run (non-standard dim order of a size-1 axis)

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
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

HERE = Path(__file__).resolve().parent
SIGNATURE = 'execute() failed'  # the text that is this defect


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


def check(program, inputs, expected):
    """ExecuTorch portable kernels and XNNPACK: a program exported from an example whose size-1
    axis has an unusual stride (torch calls it contiguous) gets a non-standard dim order, and its
    own kernels reject it whatever strides the inputs have at run time (here: standard ones)."""
    standard = [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in inputs]
    outcomes = []
    for name, partitioner in (("portable kernels", []), ("XNNPACK", [XnnpackPartitioner()])):
        buffer = to_edge_transform_and_lower(program, partitioner=partitioner).to_executorch().buffer
        method = Runtime.get().load_program(buffer).load_method("forward")
        try:
            got = method.execute(standard)
        except RuntimeError as e:
            outcomes.append(f"{name}: {e}")
            continue
        code, message = values_match(program, inputs, expected, got, f"ExecuTorch ({name})")
        if code:
            return code, message
    if outcomes:
        return 1, "REPRODUCED: " + "; ".join(outcomes) + " (the kernels log 'different dim orders' / " \
                  "'Propagating input shapes failed')"
    return 0, "FIXED: both run the program exported from a transposed [1, N, 1] example"


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
