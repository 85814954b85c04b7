"""Durations found inside a chain stage: a stage that rounds its own durations and builds its
frames from them (a front cut at the aligned features), as the whole-model localization does.

Its rounded durations are found by position (`onnx_graph.durations_tensor`: Round, then Clip or
Max) and read from a copy that outputs them too (`onnx_graph.marked_copy`). When they differ
from the reference's, the stage is run again on a copy where they are an input
(`onnx_graph.force_input`) fed the reference's: its outputs, and every later stage, are then on
the reference's frames and judged there, as the whole-model path judges a file whose durations
round differently; the difference itself is reported (`row["durations"]`), not a shape mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
import torch

from ..plumbing.files import content_key
from .onnx_graph import durations_tensor, force_input, marked_copy
from .portfile import Port, StageSpec, TensorRef


@dataclass(frozen=True)
class FoundDurations:
    """A stage with durations inside: its copy that also outputs them, its copy fed them."""

    tensor: str  # the durations tensor's name in the graph
    marked: StageSpec
    forced: StageSpec


def found_durations(port: Port, stage: StageSpec, work: Path) -> FoundDurations | None:
    """The stage's durations tensor and its two copies (written under `work` once per artifact
    content), or None: not a one-file ONNX stage, it outputs its durations itself, or it has none."""
    if stage.step is not None or stage.buckets or not (stage.artifact or "").lower().endswith(".onnx"):
        return None
    if any(r.tensor in ("pred_dur", "duration") for r in stage.outputs.values()):
        return None  # the durations are the stage's output: judged, and the host glue rounds them
    path = stage.file_for(port.root)
    model = onnx.load(str(path), load_external_data=False)
    tensor = durations_tensor(model)
    if tensor is None or tensor in stage.outputs:
        return None
    dtype, rank = _type(model, tensor)
    where = work / content_key("durations-inside", str(path.resolve()), path.stat().st_mtime_ns, path.stat().st_size)
    marked, forced = where / f"{path.stem}.marked.onnx", where / f"{path.stem}.forced.onnx"
    if not marked.exists():
        marked_copy(path, marked, [tensor])
    if not forced.exists():
        force_input(path, forced, tensor, onnx.helper.tensor_dtype_to_np_dtype(dtype))
        _set_rank(forced, tensor, rank)
    return FoundDurations(
        tensor,
        stage.model_copy(update={"artifact": str(marked), "outputs": {**stage.outputs,
                                                                       tensor: TensorRef(tensor="pred_dur")}}),
        stage.model_copy(update={"artifact": str(forced), "inputs": {**stage.inputs,
                                                                      tensor: TensorRef(tensor="pred_dur")}}))


def _type(model, tensor: str) -> tuple[int, int | None]:
    """The durations tensor's element type (float when shape inference does not say: Round's) and
    rank (None when unknown)."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    for v in (*inferred.value_info, *inferred.output):
        if v.name == tensor:
            t = v.type.tensor_type
            return t.elem_type or onnx.TensorProto.FLOAT, len(t.shape.dim) if t.HasField("shape") else None
    return onnx.TensorProto.FLOAT, None


def _set_rank(path: Path, tensor: str, rank: int | None) -> None:
    """The forced input declares the durations' rank (symbolic sizes), so they are fed in it."""
    if rank is None:
        return
    model = onnx.load(str(path))
    for i in model.graph.input:
        if i.name == tensor:
            i.type.tensor_type.shape.Clear()
            for k in range(rank):
                i.type.tensor_type.shape.dim.add().dim_param = f"{tensor}_{k}"
    onnx.save(model, str(path))


def run_with_durations(run, found: FoundDurations | None, values: dict, traces):
    """`run(stage, values)` (chain.run_stage with the rest bound) on the stage, or for a stage with
    durations inside on its marked copy, and again on its forced copy when they differ from the
    reference's: (outputs or None, what the durations were: {} when none were found)."""
    if found is None:
        return run(None, values), {}
    out = run(found.marked, values)
    if out is None:
        return None, {}
    own = out.pop("pred_dur").reshape(-1)
    ref = reference_durations(traces)
    info = {**compare_durations(own, ref), "tensor": found.tensor, "forced": False}
    if not info["tokens_differ"]:
        return out, info
    forced = run(found.forced, {**values, "pred_dur": ref})
    return forced, {**info, "forced": True}


def reference_durations(traces) -> torch.Tensor:
    return torch.tensor(traces.pred_dur, dtype=torch.long).reshape(-1)


def compare_durations(own: torch.Tensor, ref: torch.Tensor) -> dict:
    """How a port's rounded durations differ from the reference's (what the record and the reason say)."""
    own = own.reshape(-1).long()
    n = min(len(own), len(ref))
    diff = (own[:n] - ref[:n]).abs()
    return {"tokens": len(ref), "tokens_differ": int((diff > 0).sum()) + abs(len(own) - len(ref)),
            "max_frames_diff": int(diff.max()) if n else 0, "frames": int(own.sum()),
            "frames_reference": int(ref.sum())}


def forced_output(chained: dict, traces) -> dict:
    """A stage whose output is the durations (`pred_dur`), when they differ from the reference's:
    the later stages take the reference's from `chained` (as after durations found inside a stage),
    so they run and are judged on the reference's frames; what differed is returned (else {})."""
    if "pred_dur" not in chained:
        return {}
    ref = reference_durations(traces)
    info = compare_durations(chained["pred_dur"], ref)
    if not info["tokens_differ"]:
        return {}
    chained["pred_dur"] = ref
    return {**info, "tensor": "pred_dur", "forced": True, "output": True}
