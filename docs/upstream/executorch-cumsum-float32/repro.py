#!/usr/bin/env python3
"""Repro: ExecuTorch: float cumsum accumulates in float32, several times PyTorch's error (SineGen's phase)

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
SIGNATURE = 'cumsum'  # the text that is this defect


def check(program, inputs, expected):
    """ExecuTorch's portable cumsum (XNNPACK leaves cumsum to it): its error against float64,
    beside PyTorch float32's own (PyTorch accumulates a float cumsum in double on CPU)."""
    buffer = to_edge_transform_and_lower(program, partitioner=[]).to_executorch().buffer
    got = Runtime.get().load_program(buffer).load_method("forward").execute([t.contiguous() for t in inputs])
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ref = expected[0]
    err = float((torch.as_tensor(got[0]).double() - ref).norm() / ref.norm())
    floor = float((ours.double() - ref).norm() / ref.norm())
    if err > 4 * floor:
        return 1, (f"REPRODUCED: ExecuTorch's cumsum is {err / floor:.1f}x PyTorch float32's error against "
                   f"float64 (rel_l2 {err:.3e} vs {floor:.3e}): it accumulates in float32 along the sequence")
    return 0, f"FIXED: ExecuTorch's cumsum within 4x PyTorch float32's error (rel_l2 {err:.3e} vs {floor:.3e})"


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
