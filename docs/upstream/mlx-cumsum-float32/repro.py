"""MLX's float32 cumsum accumulates in float32: its error grows with the length (numpy and mlx only).

Kokoro's sine generator (the NSF source of its vocoder) takes the cumulative sum of its
per-sample phase increments, downsampled by 300: 2,156 steps of 9 harmonics on a 27 s utterance.
The float32 result that rounds the exact (float64) cumsum is off by about 6e-8 relative L2; mx.cumsum's
own float32 result is compared with that.

    python repro.py   # exit 1 while it reproduces, 0 once fixed, 2 when it cannot run here
"""
import platform
import sys

import numpy as np

try:
    import mlx.core as mx
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

STEPS, HARMONICS, RATE, SCALE = 2_156, 9, 24_000, 300


def main() -> int:
    t = np.arange(STEPS) * SCALE / 24_000
    f0 = 180 + 60 * np.sin(2 * np.pi * t / 3.0)  # Hz, one swing per 3 s
    rad = ((f0[None, :, None] * np.arange(1, HARMONICS + 1)[None, None, :] / RATE) % 1).astype(np.float32)
    exact = np.cumsum(rad.astype(np.float64), axis=1)

    def rel(x):
        return np.linalg.norm(np.asarray(x, dtype=np.float64) - exact) / np.linalg.norm(exact)

    rounded = rel(exact.astype(np.float32))
    got = rel(np.array(mx.cumsum(mx.array(rad), axis=1)))
    print(f"mlx {mx.__version__}, {platform.machine()}: cumsum over {STEPS:,} float32 steps, relative L2 against "
          f"float64: mx.cumsum {got:.2e}; the float64 cumsum rounded to float32 {rounded:.2e}")
    if got > 5 * rounded:
        print("REPRODUCED: mx.cumsum's float32 error is over 5x the rounding of the exact sum")
        return 1
    print("not reproduced: mx.cumsum is within 5x the rounding of the exact sum")
    return 0


if __name__ == "__main__":
    sys.exit(main())
