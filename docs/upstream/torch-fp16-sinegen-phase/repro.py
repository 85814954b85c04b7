#!/usr/bin/env python3
"""Repro: Kokoro's SineGen phase overflows float16 on utterances over ~6 s

Minimal program: program.pt2 (torch.export of the module in REPORT.md), inputs.pt, and the float64
result of the same program, expected.pt. Needs only torch, numpy and torch (versions in ENV.md).

Exit code: 1 while the defect reproduces, 0 once it is fixed, 2 when it cannot run here (the
runtime is not installed), 3 when it fails differently (read the output).
"""
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SIGNATURE = 'non-finite'  # the text that is this defect


def check(program, inputs, expected):
    """PyTorch in float16 on CPU (what a float16 deployment computes): does the output stay finite?"""
    module = program.module()
    with torch.no_grad():
        got = module.half()(*[t.half() if t.is_floating_point() else t for t in inputs])
    got = got.double()
    ref = expected[0]
    bad = ~torch.isfinite(got) & torch.isfinite(ref)
    if bad.any():
        first = int(bad.reshape(-1).nonzero()[0]) if bad.any() else -1
        return 1, (f"REPRODUCED: {float(bad.double().mean()):.1%} of the float16 output is non-finite "
                   f"(from sample {first} of {ref.numel()}, {first / 24000:.2f} s at 24 kHz); float64 is finite")
    err = float((got - ref).norm() / ref.norm())
    return 0, f"FIXED: the float16 output is finite (relative L2 {err:.3e} against float64)"


def main():
    try:
        import torch  # noqa: F401
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
