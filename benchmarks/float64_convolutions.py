"""The float64 reference's convolutions: torch's own float64 Conv1d against `to_float64`'s taps.

torch has no fast float64 convolution on the CPU (`slow_conv2d` / `slow_conv_dilated2d`), and the
float64 vocoder is most of a reference's time; `harness.patches.float64_convolutions_by_taps`
computes each long Conv1d as one dgemm per kernel tap. This runs the random model's decoder in
float64 both ways on the same inputs and noise, one torch thread, and prints each time and the
relative L2 between the two outputs.

    OMP_NUM_THREADS=1 python benchmarks/float64_convolutions.py --frames 200 1078
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.model import load_random  # noqa: E402
from harness.patches import apply_patches, to_float64  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, nargs="+", default=[200])
    args = ap.parse_args()
    torch.set_num_threads(1)
    km = apply_patches(load_random(0).kmodel, ["dropout_identity", "custom_stft"])
    taps = to_float64(copy.deepcopy(km))
    own = to_float64(copy.deepcopy(km))
    for m in own.modules():
        if isinstance(m, nn.Conv1d):
            m.__dict__.pop("_conv_forward", None)  # back to torch's Conv1d._conv_forward
    for frames in args.frames:
        g = torch.Generator().manual_seed(1)
        inputs = (torch.randn(1, 512, frames, generator=g, dtype=torch.float64),
                  150 + 50 * torch.rand(1, 2 * frames, generator=g, dtype=torch.float64),
                  torch.randn(1, 2 * frames, generator=g, dtype=torch.float64),
                  torch.randn(1, 128, generator=g, dtype=torch.float64))
        outs = []
        for name, model in (("torch's Conv1d", own), ("taps", taps)):
            torch.manual_seed(0)  # the same noise draws
            with torch.no_grad():
                start = time.perf_counter()
                outs.append(model.decoder(*inputs))
                print(f"float64 decoder, {frames} frames, {name}: {time.perf_counter() - start:.1f} s", flush=True)
        print(f"  relative L2 between them: {((outs[0] - outs[1]).norm() / outs[0].norm()).item():.1e}")


if __name__ == "__main__":
    main()
