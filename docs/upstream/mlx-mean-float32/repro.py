"""MLX's float32 mean over a long axis loses precision with the length (numpy and mlx only).

128 channels of 3 + 0.1 x N(0, 1), float32, length 100,000 (a channel of Kokoro's vocoder after its
last upsampling on a long utterance: mlx-audio's InstanceNorm1d takes its mean over it). The mean's
error against the float64 mean of the same float32 numbers, mx.mean beside numpy's float32 mean.

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

LENGTH, CHANNELS = 100_000, 128


def main() -> int:
    x = (np.random.default_rng(0).standard_normal((1, CHANNELS, LENGTH)) * 0.1 + 3.0).astype(np.float32)
    exact = x.astype(np.float64).mean(-1)
    mlx_err = np.abs(np.array(mx.mean(mx.array(x), axis=2)).astype(np.float64) - exact).max() / 3.0
    np_err = np.abs(x.mean(-1).astype(np.float64) - exact).max() / 3.0
    print(f"mlx {mx.__version__}, numpy {np.__version__}, {platform.machine()}: relative error of the float32 mean "
          f"over {LENGTH:,} samples: mx.mean {mlx_err:.1e}, np.mean {np_err:.1e}")
    if mlx_err > max(10 * np_err, 1e-6):
        print("REPRODUCED: mx.mean's float32 error is over 10x numpy's")
        return 1
    print("not reproduced: mx.mean is as precise as numpy's float32 mean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
