"""The ONNX run child (harness/backends/onnx_child.py) imports no torch — its import cost more than
the run in a port chain (benchmarks/chain_overhead.py) — and gives the torch path's outputs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _model(path: Path) -> Path:
    """y = x * 2 + b (float32, b int64 cast), and the int64 input echoed: two inputs of two dtypes."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", ["b"], ["bf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "two"], ["x2"]),
             helper.make_node("Add", ["x2", "bf"], ["y"]),
             helper.make_node("Identity", ["b"], ["b_out"])]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("b", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("b_out", TensorProto.INT64, [2, 3])],
        initializer=[helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_onnx_child_imports_no_torch_and_matches_the_torch_path(tmp_path):
    pytest.importorskip("onnxruntime")
    from harness.backends.prebuilt import run_artifact
    from harness.plumbing.files import load_arrays, save_arrays

    onnx_path = _model(tmp_path / "m.onnx")
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3).t().contiguous().t()  # non-row-major strides
    b = torch.arange(6, dtype=torch.int32).reshape(2, 3)  # int32 fed, int64 declared: cast by the child
    save_arrays(tmp_path / "in.npz", [x.numpy(), b.numpy()])
    code = ("import json, sys\n"
            "from harness.backends.onnx_child import run_onnx_job\n"
            f"value = run_onnx_job({str(onnx_path)!r}, {str(tmp_path / 'in.npz')!r}, {str(tmp_path / 'out.npz')!r})\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'n': value['n_outputs']}))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen == {"torch": False, "n": 2}

    child = load_arrays(tmp_path / "out.npz")
    via_torch = run_artifact(onnx_path, [x, b])
    assert [a.dtype for a in child] == [np.float32, np.int64]
    for got, want in zip(child, via_torch):
        np.testing.assert_array_equal(got, want.numpy())
    np.testing.assert_array_equal(child[0], x.numpy() * 2 + b.numpy())


def test_arrays_round_trip_in_order(tmp_path):
    from harness.plumbing.files import load_arrays, save_arrays

    arrays = [np.full((2,), i, dtype=d) for i, d in enumerate([np.float16, np.bool_, np.int64] * 4)]  # 12: a10 after a9
    save_arrays(tmp_path / "a.npz", arrays)
    back = load_arrays(tmp_path / "a.npz")
    assert [a.dtype for a in back] == [a.dtype for a in arrays]
    assert all(np.array_equal(a, b) for a, b in zip(back, arrays))


def test_file_digest_is_memoized_by_size_and_mtime(tmp_path):
    import os

    from harness.plumbing.files import sha256_file, sha256_file_cached

    p = tmp_path / "f.bin"
    p.write_bytes(b"one")
    first = sha256_file_cached(p)
    assert first == sha256_file(p)
    p.write_bytes(b"two!")  # another size: re-hashed
    assert sha256_file_cached(p) == sha256_file(p) != first
    st = os.stat(p)
    p.write_bytes(b"six!")  # same size: the new mtime re-hashes it
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert sha256_file_cached(p) == sha256_file(p)
