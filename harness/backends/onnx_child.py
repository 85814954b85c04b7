"""An ONNX artifact's run in a child process that imports numpy and onnxruntime only.

A child that imports torch spends seconds on it (~4 s on a loaded machine) to read inputs.pt and
write outputs.pt; a port chain runs one child per stage and role, so that import dominated a warm
port item. The parent (harness.runner.run_artifact) writes the inputs with
harness.plumbing.files.save_arrays and converts the outputs back to torch. Nothing in this module,
nor in the packages it is imported through, may import torch (tests/unit/test_onnx_child.py)."""
from __future__ import annotations

import os
import time
from collections import OrderedDict

import numpy as np

from ..plumbing.files import load_arrays, save_arrays

_NP = {"tensor(float16)": "float16", "tensor(int32)": "int32", "tensor(float)": "float32",
       "tensor(int64)": "int64", "tensor(bool)": "bool", "tensor(double)": "float64"}


# In the warm worker (harness.plumbing.worker) a chain's local and chained runs of one stage share
# its loaded session: keyed by the file's identity, the last few kept.
_SESSIONS: OrderedDict = OrderedDict()
KEPT_SESSIONS = 4


def session_for(path: str):
    # runtime: the faces load this module (through harness.backends) and import no runtime
    import onnxruntime as ort

    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key in _SESSIONS:
        _SESSIONS.move_to_end(key)
        return _SESSIONS[key]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    _SESSIONS[key] = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    while len(_SESSIONS) > KEPT_SESSIONS:
        _SESSIONS.popitem(last=False)
    return _SESSIONS[key]


def run_onnx(path: str, inputs: list) -> list:
    """Run an ONNX file on numpy arrays in its own input order, each cast to its declared dtype."""
    sess = session_for(str(path))
    feed = {}
    for port, a in zip(sess.get_inputs(), inputs):
        want = _NP.get(port.type)
        feed[port.name] = np.ascontiguousarray(a.astype(want) if want is not None else a)
    return [np.asarray(o) for o in sess.run(None, feed)]


def run_onnx_job(artifact_path: str, inputs_path: str, outputs_path: str) -> dict:
    """Job function (child process): the .npz inputs in, the .npz outputs out; a crash stays here."""
    inputs = load_arrays(inputs_path)
    start = time.perf_counter()
    outputs = run_onnx(artifact_path, inputs)
    seconds = time.perf_counter() - start
    save_arrays(outputs_path, outputs)
    return {"run_s": seconds, "n_outputs": len(outputs), "audit": {}}
