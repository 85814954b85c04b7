"""Matching an artifact's values and declarations to Kokoro's tensors, shared by localization
(`onnx_stages`, `pte_stages`) and `port init`: relative L2 in any axis order, the layout nearest
the reference, a declared input or output placed by its rank and dtype, an int8 artifact told.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import onnx
import torch


def layouts(value, shape) -> list:
    """`value` in the reference's layout: reshaped as it is, and each axis permutation of its
    squeezed shape that gives the reference's (an LSTM's [T, B, C] against torch's [B, T, C])."""
    a = np.asarray(value)
    out = [a.reshape(shape)]
    sq, want = [d for d in a.shape if d != 1], [d for d in shape if d != 1]
    if sorted(sq) == sorted(want) and len(sq) <= 4:
        b = a.reshape(sq)
        for perm in itertools.permutations(range(len(sq))):
            if perm != tuple(range(len(sq))) and [sq[i] for i in perm] == want:
                out.append(np.transpose(b, perm).reshape(shape))
    return out


def rel_l2(value, want: torch.Tensor) -> float:
    """The smallest relative L2 of `value` from `want` (float64) over its layouts; inf when no
    layout is finite."""
    b = want.double().numpy().reshape(-1)
    best = math.inf
    for a in layouts(value, tuple(want.shape)):
        a = a.astype(np.float64).reshape(-1)
        if np.isfinite(a).all():
            best = min(best, float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0)))
    return best


def best_layout(value, want: torch.Tensor) -> np.ndarray:
    """`value` in the layout nearest `want`, as float32."""
    return min(layouts(value, tuple(want.shape)), key=lambda a: rel_l2(a, want)).astype(np.float32)


def family(dtype: str | None) -> str | None:
    """float, int or bool (None when undeclared)."""
    if dtype is None:
        return None
    return "float" if "float" in dtype else "bool" if dtype == "bool" else "int"


def by_shape(p, side: str, candidates, taken: set[str]) -> str | None:
    """A whole model's declared input or output (`p`: its dtype, rank and shape) placed by rank and
    dtype alone, among the names not `taken`: tokens, style, speed in; audio, durations out."""
    fam = family(p.dtype)
    shape = p.shape or ()
    if side == "inputs":
        if fam == "int" and p.rank in (1, 2) and "input_ids" not in taken:
            return "input_ids"
        if fam == "float" and shape and shape[-1] == 256 and "ref_s" not in taken:
            return "ref_s"
        if fam == "float" and p.rank in (0, 1) and "speed" not in taken:
            return "speed"
        return None
    if fam == "float" and p.rank in (1, 2, 3) and "audio" not in taken:
        return "audio"
    if fam == "int" and p.rank in (1, 2) and "pred_dur" not in taken:
        return "pred_dur"
    return None


def is_int8(artifact: Path) -> bool:
    """An ONNX with integer matmuls/convolutions (dynamic quantization) is an int8 artifact."""
    if artifact.suffix.lower() != ".onnx":
        return False

    ops = {n.op_type for n in onnx.load(str(artifact), load_external_data=False).graph.node}
    return bool(ops & {"MatMulInteger", "ConvInteger", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul",
                       "DynamicQuantizeLSTM"})
