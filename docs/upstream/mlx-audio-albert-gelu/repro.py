#!/usr/bin/env python3
"""Repro: mlx-audio: `bert.encoder.albert_layer_groups.0.albert_layers.0.activation` noise-like (SNR 64.0 dB) (rel_l2 6.32e-04 > 4 x fp32 floor 6.17e-08 and > tolerance 1e-05)

Runs mlx-audio's counterpart of Kokoro's module `bert.encoder.albert_layer_groups.0.albert_layers.0.activation` alone on the inputs the float64
reference fed it (inputs.npz, float32) and compares its output with the float64 reference
(expected.npy). Exit 1 while its relative L2 error is above the tolerance of meta.json or has
NaN/Inf where the reference is finite; 0 once it is within; 2 when it cannot run here (a package
of meta.json's `packages` missing). Needs only numpy, mlx, mlx_audio.
"""
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
META = json.loads((HERE / "meta.json").read_text())
sys.path.insert(0, str(HERE))
try:
    for package in META["packages"]:
        importlib.import_module(package)
    import numpy as np
    run_saved = importlib.import_module(META["runner"]).run_saved
except ImportError as e:
    print(f"cannot run here: {type(e).__name__}: {e}")
    sys.exit(2)


def main():
    data = dict(np.load(HERE / "inputs.npz"))
    args = [data[a["npz"]] if "npz" in a else a["value"] for a in META["args"]]
    kwargs = {k: data[a["npz"]] if "npz" in a else a["value"] for k, a in META["kwargs"].items()}
    noise = dict(np.load(HERE / "noise.npz")) if (HERE / "noise.npz").exists() else {}
    expected = np.load(HERE / "expected.npy")
    try:
        got = np.asarray(run_saved(HERE, META, args, kwargs, noise), dtype=np.float64)
    except Exception as e:  # the rewrite raising on these inputs reproduces the bug too
        print(f"{META['rewrite']}: {META['module']} raised {type(e).__name__}: {e}")
        return 1
    if got.shape != expected.shape:
        print(f"{META['module']}: shape {list(got.shape)} != expected {list(expected.shape)}")
        return 1
    if (~np.isfinite(got) & np.isfinite(expected)).any():
        print(f"{META['module']}: NaN/Inf where the reference is finite")
        return 1
    norm = float(np.linalg.norm(expected))
    rel = float(np.linalg.norm(got - expected)) / (norm or 1.0)
    bad = rel > META["tolerance"]
    print(f"{META['module']}: rel_l2 {rel:.3e} against the float64 reference; tolerance {META['tolerance']:.3e} "
          f"(torch float32's own error {META['floor_rel_l2']:.3e})")
    print(f"REPRODUCED: {META['rewrite']} diverges" if bad else f"not reproduced: {META['rewrite']} is within")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
