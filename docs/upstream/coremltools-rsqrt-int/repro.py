#!/usr/bin/env python3
"""Repro: coremltools: rsqrt of an int constant is not promoted to float

Minimal program: program.pt2 (torch.export of the module in REPORT.md), inputs.pt, and the float64
result of the same program, expected.pt. Needs only torch, numpy and coremltools (versions in ENV.md).

Exit code: 1 while the defect reproduces, 0 once it is fixed, 2 when it cannot run here (the
runtime is not installed), 3 when it fails differently (read the output).
"""
import sys
from pathlib import Path

import numpy as np
import torch

try:  # the runtime under test: without it, this cannot run here (exit 2)
    import coremltools as ct
    import platform
    import traceback
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

HERE = Path(__file__).resolve().parent
SIGNATURE = 'expects tensor or scalar of dtype from type domain'  # the text that is this defect


def classify(error):
    """The runtime raised: the defect when its message carries SIGNATURE, else a different failure."""
    text = f"{type(error).__name__}: {error}"
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    print("".join(frames[-6:]).rstrip())
    if SIGNATURE in text:
        return 1, f"REPRODUCED: {text.strip().splitlines()[-1][:300]}"
    return 3, f"CHANGED: a different error than {SIGNATURE!r}: {text.strip().splitlines()[-1][:300]}"


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
    """coremltools: the ATen inference IR (run_decompositions({})) to an mlprogram, FLOAT32."""
    try:
        model = ct.convert(program.run_decompositions({}), convert_to="mlprogram",
                           minimum_deployment_target=ct.target.iOS17, compute_precision=ct.precision.FLOAT32,
                           compute_units=ct.ComputeUnit.CPU_ONLY, skip_model_load=platform.system() != "Darwin")
    except Exception as e:  # noqa: BLE001 - the converter's error is the finding
        return classify(e)
    if platform.system() != "Darwin":
        return 0, (f"FIXED: coremltools {ct.__version__} converts the program (prediction needs macOS: "
                   f"values not compared on {platform.system()})")
    spec = model.get_spec()
    out = model.predict({i.name: t.numpy() for i, t in zip(spec.description.input, inputs)})
    got = [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]
    return values_match(program, inputs, expected, got, f"coremltools {ct.__version__}")


def main():
    try:
        import coremltools  # noqa: F401
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
