"""The ops an ONNX computes between its modules' stages, judged as rows of their own.

A module's nodes are its stage; what lies between two stages (a parent module's own ops, such as
the generator's STFT of the source or its `x + x_source`, and nodes an optimizer or a hand edit
left without any scope, placed in the module around them) belongs to no stage. A defect there
moves the chained values after it and the audio, yet no stage's local error: it went unnamed, or
was named only as the whole parent when the parent's own cut could run at all. Each stage's
input is therefore also a row, `<stage>:input`: the ops that compute it back to the stages (and
graph inputs) that feed them, cut out and fed the reference's values of those stages, against
the reference's input of the stage. Only a cut holding an op that computes (not data movement
alone) is a row; each tensor once, at the first stage that reads it.
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from .matching import best_layout
from .onnx_graph import DATA_MOVEMENT
from .onnx_stages import in_layout, run_cut

INPUT_SUFFIX = ":input"
MAX_NODES = 300  # a cut reaching further back than this is not the ops between two stages


def glue_rows(model, groups: dict, rows: dict, values: dict, ref: dict, source: Path, out: Path, run) -> dict:
    """{"<stage>:input": row} for each mapped stage whose input the file computes outside every
    other stage; `ref` as onnx_stages.stage_row takes it, `rows` the stages' rows (their mapped
    output tensors are where a cut starts)."""
    graph = model.graph
    producer = {o: i for i, n in enumerate(graph.node) for o in n.output}
    owners: dict[int, set[str]] = {}
    for path, g in groups.items():
        for i in g["nodes"]:
            owners.setdefault(i, set()).add(path)
    outputs = {r["tensor"]: p for p, r in rows.items() if r.get("mapped") and r.get("tensor") and p in ref["fp32"]}
    consts = {i.name for i in graph.initializer}
    seen, glue = set(outputs), {}
    for path, row in rows.items():
        tensor = next((t for t, how in (row.get("fed") or {}).items() if how == "reference input 0"), None)
        if tensor is None or tensor in seen or not ref["fp32_in"].get(path):
            continue
        seen.add(tensor)
        around = {a for a in groups if path.startswith(a + ".")}
        nodes, edges = _cut(graph, tensor, producer, owners, around, set(ref["feed"]), consts)
        if nodes is None or all(graph.node[i].op_type in DATA_MOVEMENT for i in nodes):
            continue
        key, want = path + INPUT_SUFFIX, ref["fp32_in"][path][0]
        kinds = Counter(graph.node[i].op_type for i in nodes if graph.node[i].op_type != "Constant")
        ops = ", ".join(f"{op} x{n}" if n > 1 else op for op, n in kinds.items())
        entry = {"what": f"its input: {sum(kinds.values())} ops outside every stage ({ops})", "mapped": True,
                 "tensor": tensor, "nodes": len(nodes), "candidates": 1, "chained": best_layout(values[tensor], want),
                 "chained_raw": np.asarray(values[tensor])}
        feed, why = _feed(edges, outputs, values, ref)
        if why:
            entry["local_error"] = why
        else:
            cut_ref = {**ref, "fp32": {key: want}}
            entry.update(run_cut(source, feed, {}, tensor, cut_ref, key, out / "stages" / key, run))
        glue[key] = entry
    return glue


def _cut(graph, tensor: str, producer: dict, owners: dict, around: set, inputs: set, consts: set):
    """(the nodes that compute `tensor` outside every stage but those `around` it, the tensors
    they read from a stage or the graph's inputs), or (None, None) past MAX_NODES."""
    nodes, edges, stack = set(), set(), [tensor]
    while stack:
        t = stack.pop()
        if t in consts:
            continue
        j = producer.get(t)
        if t in inputs or j is None or owners.get(j, set()) - around:
            edges.add(t)
            continue
        if j in nodes:
            continue
        nodes.add(j)
        if len(nodes) > MAX_NODES:
            return None, None
        stack.extend(x for x in graph.node[j].input if x)
    return nodes, edges


def _feed(edges: set, outputs: dict, values: dict, ref: dict) -> tuple[dict, str | None]:
    """What the cut is fed: a stage's output, the reference's value of that stage (in the file's
    layout); a graph input, the reference's feed; shapes, lengths and what weights alone compute,
    the file's own values. (feed, None), or (partial, why it cannot be fed)."""
    feed = {}
    for t in sorted(edges):
        own = values.get(t)
        if t in ref["feed"]:
            feed[t] = ref["feed"][t]
        elif t in outputs:
            feed[t] = in_layout(ref["fp32"][outputs[t]].float().numpy(), np.asarray(own))
        elif own is not None and (t not in ref["dynamic"] or not np.issubdtype(np.asarray(own).dtype, np.floating)
                                  or np.asarray(own).size <= 16):
            feed[t] = np.asarray(own)
        else:
            return feed, f"input {t!r} is no stage's output the reference has"
    return feed, None


def judge_references(ref: dict, rows: dict, caps: dict) -> None:
    """Each input row's references into `ref`: the stage's captured input in float32 and float64
    (`caps`: reference.module_captures), or its float32 alone where no float64 ran (the tolerance
    alone judges it)."""
    for key in rows:
        if key.endswith(INPUT_SUFFIX):
            path = key[:-len(INPUT_SUFFIX)]
            ref["fp32"][key] = ref["fp32_in"][path][0]
            ref["fp64"][key] = caps.get((f"{path}:in", "float64"), ref["fp32"][key]).double()
