"""Kokoro's InstanceNorm on a long channel, per runtime: NaN rate and error against float64, beside
PyTorch float32's own (findings 11 and 13).

One channel whose one-pass float32 variance cancels (mean 100, std 0.01, 4,096 samples: the
upstream bundles' input), one milder (mean 10, std 0.1), and en_long's real shape (184,321 samples,
mean 2.25, std 0.054). Runs TVM Relax from the ExportedProgram with and without the
`instance_norm_float64_stats` patch, and the ONNX export (dynamo) through onnxruntime and TVM's ONNX
frontend (the latter also with the patch applied before the export); a runtime that is not installed is left out with the reason.

    .venv/bin/python benchmarks/instance_norm_runtimes.py
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

INPUTS = ((100.0, 0.01, 4096), (10.0, 0.1, 4096), (2.25, 0.054, 184_321))


def main() -> int:
    from tabulate import tabulate

    from harness.metrics.tensor import error_metrics
    from harness.patches import PATCHES
    from harness.upstream.checks.tvm_checks import _tvm_run
    from harness.upstream.programs import InstanceNorm

    rows, tmp = [], Path(tempfile.mkdtemp(prefix="kp-in-"))
    for mean, std, n in INPUTS:
        x = (mean + std * torch.randn(1, 1, n, generator=torch.Generator().manual_seed(0))).float()
        ref = torch.nn.functional.instance_norm(x.double(), eps=1e-5)

        def judge(name, got):
            m = error_metrics(torch.as_tensor(got).reshape(ref.shape), ref)
            rows.append([f"mean {mean} std {std} n {n}", name, m["nan_rate"], m["rel_l2"]])

        module = InstanceNorm(1).eval()
        with torch.no_grad():
            judge("pytorch float32", module(x))
        try:
            from tvm.relax.frontend.torch import from_exported_program

            judge("tvm", _tvm_run(from_exported_program(torch.export.export(module, (x,))), (x,))[0])
            patched = InstanceNorm(1).eval()
            PATCHES["instance_norm_float64_stats"].apply(patched)
            judge("tvm + instance_norm_float64_stats",
                  _tvm_run(from_exported_program(torch.export.export(patched, (x,))), (x,))[0])
        except ImportError as e:
            print(f"tvm left out: {e}")
        try:
            import onnx
            import onnxruntime as ort

            path = tmp / f"in-{n}.onnx"
            torch.onnx.export(module, (x,), dynamo=True).save(str(path))
            sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            judge("onnxruntime", sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
            from tvm.relax.frontend.onnx import from_onnx

            judge("tvm-onnx", _tvm_run(from_onnx(onnx.load(str(path)), keep_params_in_input=False), (x,))[0])
            patched = InstanceNorm(1).eval()
            PATCHES["instance_norm_float64_stats"].apply(patched)
            torch.onnx.export(patched, (x,), dynamo=True).save(str(tmp / f"in64-{n}.onnx"))
            judge("tvm-onnx + instance_norm_float64_stats",
                  _tvm_run(from_onnx(onnx.load(str(tmp / f"in64-{n}.onnx")), keep_params_in_input=False), (x,))[0])
        except ImportError as e:
            print(f"onnx runtimes left out: {e}")
    print(tabulate(rows, headers=["input", "runtime", "NaN rate", "rel L2 vs float64"], floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
