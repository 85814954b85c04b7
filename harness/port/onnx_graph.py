"""An ONNX graph read and rewritten without running the harness: whether it draws noise, where
its durations are, copies with tensors marked as outputs or forced as inputs, and a plain
onnxruntime run. A leaf of harness.port: the chain, the
noise rules, the durations and the localization all use it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from ..plumbing.errors import UsageError

RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial", "Bernoulli"}


def draws_noise(model) -> bool:
    return any(n.op_type in RANDOM_OPS for n in model.graph.node)


def durations_tensor(model) -> str | None:
    """The rounded, clamped durations (Round then Clip/Max under /encoder): found by position."""
    graph = model.graph
    rounds = {n.output[0] for n in graph.node if n.op_type == "Round"}
    for n in graph.node:
        if n.op_type in ("Clip", "Max") and n.input and n.input[0] in rounds:
            return n.output[0]
    return None


def marked_copy(src: Path, dest: Path, tensors: list[str]) -> Path:
    """The ONNX with `tensors` added as graph outputs (types left to onnxruntime)."""
    model = onnx.load(str(src))
    have = {o.name for o in model.graph.output}
    for t in tensors:
        if t not in have:
            model.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
            have.add(t)
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dest))
    return dest


def run_onnx(path: Path, feed: dict, outputs: list[str] | None = None) -> dict:
    import onnxruntime as ort  # runtime: the faces load this module and import no runtime

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in sess.get_inputs()}
    np_types = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32,
                "tensor(float16)": np.float16, "tensor(uint8)": np.uint8, "tensor(int8)": np.int8}
    feed = {k: np.ascontiguousarray(np.asarray(v).astype(np_types.get(types[k], None) or np.asarray(v).dtype))
            for k, v in feed.items() if k in types}
    names = outputs or [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feed)))


def depends_on_inputs(model) -> set[str]:
    """The tensors that depend on a graph input (the others are computed from weights alone)."""
    seen = {i.name for i in model.graph.input}
    for n in model.graph.node:  # ONNX nodes are topologically sorted
        if any(x in seen for x in n.input):
            seen.update(n.output)
    return seen


# Ops that move or pick values without computing any: what they make from the reference's inputs is
# exactly the reference's value.
DATA_MOVEMENT = {"Slice", "Gather", "Reshape", "Transpose", "Squeeze", "Unsqueeze", "Concat", "Identity", "Shape",
                 "Split", "Expand", "Flatten", "Constant", "ConstantOfShape"}


def moved_inputs(model) -> set[str]:
    """The tensors made from the graph's inputs and constants by data movement alone (the style
    sliced into its two halves, a transposed F0): on the reference's inputs, the reference's own
    values, whichever module an export placed the ops in."""
    made = {i.name for i in model.graph.input} | {i.name for i in model.graph.initializer}
    for n in model.graph.node:  # ONNX nodes are topologically sorted
        if n.op_type in DATA_MOVEMENT and all(not x or x in made for x in n.input):
            made.update(n.output)
    return made


def force_input(src: Path, dest: Path, tensor: str, dtype) -> Path:
    """A copy of the ONNX where `tensor` is a graph input: its producing node is removed."""
    model = onnx.load(str(src))
    nodes = [n for n in model.graph.node if tensor not in n.output]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model.graph.input.append(onnx.helper.make_tensor_value_info(tensor, elem, None))
    onnx.save(model, str(dest))
    return dest


def given_copy(src: Path, dest: Path, tensor: str, dtype) -> tuple[Path, str]:
    """A copy of the ONNX where every consumer of `tensor` reads a new graph input instead (its
    name returned): a value fed in place of one the graph computes. Unlike `force_input`, the
    producer stays, so a node with several outputs (an LSTM's Y, Y_h, Y_c) keeps the others."""
    model = onnx.load(str(src))
    given = f"{tensor}:given"
    for n in model.graph.node:
        for i, x in enumerate(n.input):
            if x == tensor:
                n.input[i] = given
    for o in model.graph.output:
        if o.name == tensor:
            raise UsageError(f"{tensor!r} is a graph output: feed its value in its place, not into the graph")
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    model.graph.input.append(onnx.helper.make_tensor_value_info(given, elem, None))
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dest))
    return dest, given


def seeded_copy(src: Path, dest: Path, seed: float = 1.0) -> Path:
    """A copy whose random ops draw from fixed seeds (each its own), so that two runs of it, or of
    copies made from it, draw the same numbers."""
    model = onnx.load(str(src))
    for i, n in enumerate(x for x in model.graph.node if x.op_type in RANDOM_OPS):
        kept = [a for a in n.attribute if a.name != "seed"]
        del n.attribute[:]
        n.attribute.extend(kept + [onnx.helper.make_attribute("seed", float(seed + i))])
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(dest))
    return dest
