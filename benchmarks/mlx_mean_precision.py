"""MLX's float32 mean over a long axis, and the instance norm mlx-audio's AdaIN builds on it, against
float64, beside torch's and numpy's float32 (docs/ports.md, mlx-audio, item 4).

128 channels of 3 + 0.1 x N(0, 1) (a mean large against the spread, as a channel of the generator's
AdaIN inputs can be) at lengths 1,000, 11,401 (ja's generator after `ups.1`) and 100,000.

    .venv/bin/python benchmarks/mlx_mean_precision.py
"""
from __future__ import annotations

import numpy as np
import torch
from tabulate import tabulate

from harness.plumbing.deferred import deferred_import

mx = deferred_import("mlx.core")
LENGTHS = (1_000, 11_401, 100_000)
EPS = 1e-5


def row(length: int, rng: np.random.Generator) -> list:
    x = (rng.standard_normal((1, 128, length)) * 0.1 + 3.0).astype(np.float32)
    x64 = x.astype(np.float64)
    mean64 = x64.mean(-1, keepdims=True)
    ref = (x64 - mean64) / np.sqrt(x64.var(-1, keepdims=True) + EPS)
    a = mx.array(x)
    mlx_mean = np.array(mx.mean(a, axis=2, keepdims=True))
    mlx_norm = np.array((a - mx.mean(a, axis=2, keepdims=True)) / mx.sqrt(mx.var(a, axis=2, keepdims=True) + EPS))
    torch_norm = torch.nn.functional.instance_norm(torch.from_numpy(x), eps=EPS).numpy()

    def mean_err(m):
        return f"{np.abs(m.astype(np.float64) - mean64).max() / 3.0:.1e}"

    def norm_err(o):
        return f"{np.linalg.norm(o - ref) / np.linalg.norm(ref):.1e}"

    return [length, mean_err(mlx_mean), mean_err(torch.from_numpy(x).mean(-1, keepdim=True).numpy()),
            mean_err(x.mean(-1, keepdims=True)), norm_err(mlx_norm), norm_err(torch_norm)]


def main() -> int:
    rng = np.random.default_rng(0)
    rows = [row(n, rng) for n in LENGTHS]
    print(f"mlx {mx.__version__}: relative error against float64")
    print(tabulate(rows, headers=["length", "mx.mean", "torch.mean", "np.mean", "mlx instance norm",
                                  "torch instance_norm"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
