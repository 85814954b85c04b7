"""An XNNPACK partitioner that also delegates the bodies of control-flow ops (scan, cond, map).

ExecuTorch 1.5.1's `XnnpackPartitioner` tags the nodes of the top-level graph only. ExecuTorch's
own lowering (`to_backend`) does recurse into control-flow submodules and lowers what a partitioner
tagged there, and its emitter runs such a delegate inside the loop it emits for `scan`. So with the
stock partitioner the LSTM cell of LengthAwareLSTM(impl="scan") runs on portable kernels, one
bmm/sigmoid/tanh/mul/add after another at every step; this partitioner tags the cell's nodes with
XNNPACK's own op configs, and each step is one delegate call. On a graph without control flow it
tags exactly what XnnpackPartitioner tags. The `xnnpack` backend lowers with it (workaround
`control_flow_partitioner`; `--no-workaround control_flow_partitioner` for the stock one).
"""
from __future__ import annotations

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
    generate_grouped_partitions_from_list_of_nodes,
)
from executorch.exir.backend.partitioner import PartitionResult
from executorch.exir.graph_module import get_control_flow_submodules


class _BodyView:
    """The exported program as XNNPACK's op configs see it, with a control-flow body as its graph.
    The configs read the graph and ask the program whether a node is a parameter or constant; a
    body's placeholders are none of those (the loop passes them in), so they are activations."""

    def __init__(self, program, body: torch.fx.GraphModule):
        self._program = program
        self.graph_module = body
        self.graph = body.graph

    def __getattr__(self, name):
        return getattr(self._program, name)


def control_flow_bodies(gm: torch.fx.GraphModule):
    """Every body of a scan, cond or map in `gm`, nested ones included (a generator of GraphModules;
    no typing import: repro.py inlines this source, harness.backends.executorch)."""
    for _, body, _ in get_control_flow_submodules(gm):
        yield body
        yield from control_flow_bodies(body)


class XnnpackControlFlowPartitioner(XnnpackPartitioner):
    """XnnpackPartitioner, plus the nodes of control-flow bodies that XNNPACK's configs take."""

    def partition(self, exported_program) -> PartitionResult:
        result = super().partition(exported_program)
        tags = dict(result.partition_tags)
        spec = next(iter(tags.values()), self.delegation_spec)
        for body in control_flow_bodies(exported_program.graph_module):
            groups = self.get_matched_nodes_from_configs(_BodyView(exported_program, body))
            for partition in generate_grouped_partitions_from_list_of_nodes(body, groups):
                tag = f"control_flow_tag{len(tags)}"
                for node in partition.nodes:
                    node.meta["delegation_tag"] = tag
                tags[tag] = spec
        return PartitionResult(tagged_exported_program=result.tagged_exported_program, partition_tags=tags)
