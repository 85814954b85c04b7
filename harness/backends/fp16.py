"""`fp16`: the exported program run by PyTorch in float16 on CPU.

It predicts where Core ML's GPU / Neural Engine float16 will overflow or lose precision without a
Mac: Kokoro's decoder has activations near +-50,000, close to float16's 65,504 limit. The run
audit lists the largest activation per submodule (from a float32 pass of the same program and
inputs) against that limit, and where float16 first turns non-finite.
"""
from __future__ import annotations

import copy
import inspect
import shutil
from pathlib import Path

import torch
import torch.fx

from ..precision.islands import keep_float32_graph, keep_tag, node_module_path, not_in_program, read_keep_list
from . import Backend
from .cost import AUDIO_SECONDS, CostLaw
from .tvm import COMMON_PATCHES

FP16_MAX = 65504.0
TOP = 15  # submodules listed in the audit, by largest activation


def _to_dtype(graph_module, dtype):
    """Cast parameters, buffers and tensor constants, and rewrite the float32 that the graph
    hard-codes (arange(dtype=...), .type(torch.float32)) so that the whole program is `dtype`."""
    graph_module = graph_module.to(dtype)
    for name, value in list(vars(graph_module).items()):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            setattr(graph_module, name, value.to(dtype))
    for node in graph_module.graph.nodes:
        wide = (torch.float32, torch.float64)
        node.args = tuple(dtype if a in wide else a for a in node.args)
        if node.kwargs.get("dtype") in wide:
            node.kwargs = {**node.kwargs, "dtype": dtype}
    graph_module.recompile()
    return graph_module


def activation_ranges(graph_module, inputs) -> tuple[list, dict]:
    """Run `graph_module` node by node; returns (outputs, per submodule: largest finite |x| and
    whether any value was non-finite, plus the first node that produced a non-finite value)."""
    stats: dict[str, dict] = {}
    first_nonfinite: list[str] = []

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if n.op == "call_function" and isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
                x = out.detach()
                finite = torch.isfinite(x)
                peak = float(x.abs().where(finite, 0).max())
                s = stats.setdefault(node_module_path(n), {"max_abs": 0.0, "nonfinite": False})
                s["max_abs"] = max(s["max_abs"], peak)
                if not bool(finite.all()):
                    s["nonfinite"] = True
                    if not first_nonfinite:
                        first_nonfinite.append(f"{n.name} ({n.target}) in {node_module_path(n)}")
            return out

    with torch.no_grad():
        out = Recorder(graph_module).run(*inputs)
    return (list(out) if isinstance(out, (tuple, list)) else [out]), {
        "modules": stats, "first_nonfinite": first_nonfinite[0] if first_nonfinite else None}


REPRO_RUNNER = '''def run_backend(program, inputs):
    """PyTorch in float16 on the CPU: the whole program (weights, constants, hard-coded dtypes)."""
    half = _to_dtype(program.module(), torch.float16)
    with torch.no_grad():
        out = half(*[t.half() if t.is_floating_point() else t for t in inputs])
    return [o.float() for o in (out if isinstance(out, (tuple, list)) else [out])]
'''


class Fp16Backend(Backend):
    name = "fp16"
    requires = ("torch",)
    patches = COMMON_PATCHES
    artifact_name = "program.pt2"
    description = "the exported program in float16 on CPU, with activation ranges vs 65,504"
    precision = "float16"  # judged against float16 eager's own error (harness.precision)
    # PyTorch's float16 CPU kernels run Kokoro's vocoder at about 63x real time, linear in the audio:
    # `benchmarks/run_cost.py --backend fp16` (2026-11-25, decoder buckets of 48, 96, 144 frames,
    # random weights, beside one other shard). en_long's 27 s would take ~28 min (with the decoder
    # keep-list it took 1,091 s beside two jobs: docs/precision.md), ja's 9.6 s static bucket ~10 min.
    run_time = CostLaw(AUDIO_SECONDS, "s", ((1.2, 75.7), (2.4, 140.0), (3.6, 229.1)))

    def version(self) -> str:
        """With $KOKORO_PARITY_KEEP_FP32 (a keep-list of `kokoro-parity precision`), the modules it
        names run in float32: part of the version, so of the artifact key and the record."""
        return super().version() + keep_tag(read_keep_list())

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        shutil.copyfile(program_path, out_dir / self.artifact_name)
        return {}

    def repro_source(self) -> str:
        """The dtype rewrite this backend applies, inlined."""
        return inspect.getsource(_to_dtype) + "\n\n" + REPRO_RUNNER

    def run(self, artifact_path: Path, inputs: list) -> list:
        program = torch.export.load(str(artifact_path))
        _, fp32 = activation_ranges(program.module(), inputs)

        keep = read_keep_list()
        full = copy.deepcopy(program.module()) if keep else None  # _to_dtype casts the shared parameters
        half = _to_dtype(program.module(), torch.float16)
        if keep:  # float32 islands: the keep-list's modules compute in float32, cast at their boundary
            half = keep_float32_graph(half, full, keep)
        # with islands the graph takes float32 inputs (keep_float32_graph casts them for its float16 nodes)
        outputs, fp16 = activation_ranges(half, [t.half() if t.is_floating_point() and not keep else t for t in inputs])
        rows = []
        for path, s in fp32["modules"].items():
            h = fp16["modules"].get(path, {})
            rows.append({"module": path, "max_abs_fp32": s["max_abs"], "of_fp16_max": s["max_abs"] / FP16_MAX,
                         "fp16_nonfinite": bool(h.get("nonfinite", False))})
        rows.sort(key=lambda r: (-r["fp16_nonfinite"], -r["max_abs_fp32"]))
        peak = max((r["max_abs_fp32"] for r in rows), default=0.0)
        self.run_audit = {"fp16_max": FP16_MAX, "largest_activation": peak,
                          "largest_activation_of_fp16_max": peak / FP16_MAX,
                          "modules_over_fp16_max": [r["module"] for r in rows if r["max_abs_fp32"] > FP16_MAX],
                          "fp16_first_nonfinite": fp16["first_nonfinite"],
                          "activations_by_module": rows[:TOP]}
        if keep:
            self.run_audit["keep_fp32"] = keep
            self.run_audit["keep_fp32_not_in_program"] = not_in_program(program.graph, keep)
        return [o.float() for o in outputs]
