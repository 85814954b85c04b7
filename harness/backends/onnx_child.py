"""An ONNX artifact's run in a child process that imports numpy and onnxruntime only.

A child that imports torch spends seconds on it (~4 s on a loaded machine) to read inputs.pt and
write outputs.pt; a port chain runs one child per stage and role, so that import dominated a warm
port item. The parent (harness.runner.run_artifact) writes the inputs with
harness.plumbing.files.save_arrays and converts the outputs back to torch. Nothing in this module,
nor in the packages it is imported through, may import torch (tests/unit/test_onnx_child.py)."""
from __future__ import annotations

import time

_NP = {"tensor(float16)": "float16", "tensor(int32)": "int32", "tensor(float)": "float32",
       "tensor(int64)": "int64", "tensor(bool)": "bool", "tensor(double)": "float64"}


def run_onnx(path: str, inputs: list) -> list:
    """Run an ONNX file on numpy arrays in its own input order, each cast to its declared dtype."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    feed = {}
    for port, a in zip(sess.get_inputs(), inputs):
        want = _NP.get(port.type)
        feed[port.name] = np.ascontiguousarray(a.astype(want) if want is not None else a)
    return [np.asarray(o) for o in sess.run(None, feed)]


def run_onnx_job(artifact_path: str, inputs_path: str, outputs_path: str) -> dict:
    """Job function (child process): the .npz inputs in, the .npz outputs out; a crash stays here."""
    from ..plumbing.files import load_arrays, save_arrays

    inputs = load_arrays(inputs_path)
    start = time.perf_counter()
    outputs = run_onnx(artifact_path, inputs)
    seconds = time.perf_counter() - start
    save_arrays(outputs_path, outputs)
    return {"run_s": seconds, "n_outputs": len(outputs), "audit": {}}
