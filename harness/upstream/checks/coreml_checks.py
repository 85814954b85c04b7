"""coremltools' check (converts off macOS; predicts on macOS only)."""
from __future__ import annotations

import platform

import coremltools as ct
import numpy as np
import torch

from .common import classify, values_match


def check_coreml(program, inputs, expected):
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
