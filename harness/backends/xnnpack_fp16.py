"""`xnnpack-fp16`: ExecuTorch's XNNPACK delegate on the program in float16 (the phone CPU's fp16 route).

ExecuTorch 1.5.1 has no float16 `ConfigPrecisionType` (FP32, STATIC_QUANT, DYNAMIC_QUANT): its FP32
partitioner configs admit float16 tensors, so the route is the program cast to float16 (the `fp16`
backend's `_to_dtype`: weights, constants and hard-coded dtypes) and re-exported, then lowered with
the default `XnnpackPartitioner`. Inputs are cast to float16, outputs back to float32. Judged by
the float16 floor (`precision = "float16"`, harness.precision).
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.export import Dim

from .executorch import EXECUTORCH_PATCHES, XnnpackBackend, _delegation
from .fp16 import _to_dtype
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
exir = deferred_import("executorch.exir")


def half_program(program):
    """The exported program in float16: cast by `_to_dtype`, re-exported on float16 example inputs
    with the same dimensions left dynamic (Dim.AUTO where the program's input has a symbolic size)."""
    module = _to_dtype(copy.deepcopy(program.module()), torch.float16)
    user = [n for n in program.graph.nodes if n.op == "placeholder"
            and n.name in program.graph_signature.user_inputs]
    args = []
    shapes = []
    for n in user:
        val = n.meta["val"]
        concrete = [int(s) if isinstance(s, int) else int(s.node.hint) for s in val.shape]
        t = torch.zeros(concrete, dtype=torch.float16 if val.dtype.is_floating_point else val.dtype)
        args.append(t)
        shapes.append({i: Dim.AUTO for i, s in enumerate(val.shape) if not isinstance(s, int)} or None)
    return torch.export.export(module, tuple(args), dynamic_shapes=tuple(shapes), strict=False)


class XnnpackFp16Backend(XnnpackBackend):
    name = "xnnpack-fp16"
    precision = "float16"
    # no scan_lstm (the float16 re-export of a scan is unmeasured), no stft_phase_where nor
    # instance_norm_float64_stats (its float16 programs were measured without them)
    patches = EXECUTORCH_PATCHES
    workarounds = {n: w for n, w in XnnpackBackend.workarounds.items()
                   if n not in ("scan_lstm", "stft_phase_where", "instance_norm_float64_stats")}
    description = "ExecuTorch XNNPACK on the program cast to float16 (judged by the float16 floor)"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        program = half_program(torch.export.load(str(program_path)))
        edge = exir.to_edge_transform_and_lower(program, partitioner=self.partitioners())
        audit = {"program_dtype": "float16", **_delegation(edge)}
        (out_dir / self.artifact_name).write_bytes(edge.to_executorch().buffer)
        return audit

    def run(self, artifact_path: Path, inputs: list) -> list:
        half = [t.half() if t.is_floating_point() else t for t in inputs]
        return [o.float() if torch.is_tensor(o) and o.is_floating_point() else o for o in super().run(artifact_path, half)]

    def repro_source(self) -> str | None:
        return None  # the repro bundle's runner would need the float16 re-export inlined: not yet
