"""Where mlx-audio's sine generator (Kokoro's NSF source, `SineGen._f02sine`) leaves torch float32's
error on long utterances: each of its four ops fed the float64 reference's input of that op, cast
to float32, in MLX (mlx-audio's own `interpolate`) and in torch, against the op's float64 output.

The ops: the per-sample phase increments downsampled by 300 (linear interpolation), their
cumulative sum (x 2 pi), the phase upsampled back by 300 (x 300, linear), its sine. An F0 contour
of 180 +- 60 Hz (one swing per 3 s) with Kokoro's nine harmonics, at en_short's, ja's and en_long's
vocoder lengths (docs/ports.md, mlx-audio, the NSF source on en_long).

    .venv/bin/python benchmarks/mlx_sine_phase.py
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from tabulate import tabulate

from harness.plumbing.deferred import deferred_import

mx = deferred_import("mlx.core")
mlx_interpolate = deferred_import("mlx_audio.tts.models.interpolate")
LENGTHS = (87_000, 114_000, 646_800)  # samples: en_short, ja, en_long (frames x 600)
RATE, SCALE, HARMONICS = 24_000, 300, 9


def torch_ops(dtype):
    return [
        ("downsample (linear, 1/300)", lambda r: F.interpolate(r.transpose(1, 2).to(dtype), scale_factor=1 / SCALE,
                                                               mode="linear").transpose(1, 2)),
        ("cumsum x 2 pi", lambda r: torch.cumsum(r.to(dtype), dim=1) * 2 * torch.pi),
        ("upsample (x 300, linear)", lambda p: F.interpolate(p.transpose(1, 2).to(dtype) * SCALE, scale_factor=SCALE,
                                                             mode="linear").transpose(1, 2)),
        ("sin", lambda p: torch.sin(p.to(dtype))),
    ]


def mlx_ops():
    interp = mlx_interpolate.interpolate
    return [
        lambda r: interp(r.transpose(0, 2, 1), scale_factor=1 / SCALE, mode="linear").transpose(0, 2, 1),
        lambda r: mx.cumsum(r, axis=1) * 2 * mx.pi,
        lambda p: interp(p.transpose(0, 2, 1) * SCALE, scale_factor=SCALE, mode="linear").transpose(0, 2, 1),
        lambda p: mx.sin(p),
    ]


def rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def rows_for(length: int, rng: np.random.Generator) -> list[list]:
    t = np.arange(length) / RATE
    f0 = 180 + 60 * np.sin(2 * np.pi * t / 3.0)
    fn = f0[None, :, None] * np.arange(1, HARMONICS + 1)[None, None, :]
    rad = (fn / RATE) % 1
    rad[:, 0, 1:] += rng.uniform(size=HARMONICS - 1)
    x64 = torch.from_numpy(rad)
    rows = []
    for (name, op64), (_, op32), opm in zip(torch_ops(torch.float64), torch_ops(torch.float32), mlx_ops()):
        want = op64(x64)
        x32 = x64.float()
        got_torch = op32(x32).double().numpy()
        got_mlx = np.array(opm(mx.array(x32.numpy())).astype(mx.float32))
        if got_mlx.shape != tuple(want.shape):
            rows.append([length, name, f"shape {list(got_mlx.shape)} != {list(want.shape)}", ""])
        else:
            rows.append([length, name, f"{rel(got_mlx, want.numpy()):.2e}", f"{rel(got_torch, want.numpy()):.2e}"])
        x64 = want
    return rows


def main() -> int:
    rng = np.random.default_rng(0)
    rows = [r for n in LENGTHS for r in rows_for(n, rng)]
    print(f"mlx {mx.__version__}: each op of the sine generator on the float64 reference's input of that op, "
          f"relative L2 against its float64 output")
    print(tabulate(rows, headers=["samples", "op", "mlx-audio (MLX float32)", "torch float32"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
