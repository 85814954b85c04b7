"""PyTorch's own float16 on the CPU: what a float16 deployment computes."""
from __future__ import annotations

import torch


def check_float16(program, inputs, expected):
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
