"""`xnnpack`: torch.export -> to_edge_transform_and_lower(XnnpackPartitioner) -> .pte -> the
ExecuTorch runtime. The audit records what ExecuTorch's own delegation info says stayed outside
the delegate: those ops run on portable kernels and are the usual cause of slow runs."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from . import Backend, Workaround


def _core_aten_violations(program) -> dict[str, int]:
    """Ops of the program outside the Core ATen set (ExecuTorch rejects them without a decomposition)."""
    import torch

    counts: Counter = Counter()
    for node in program.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
            name = node.target.name()
            if (torch.Tag.core not in node.target.tags and node.target.namespace != "prims"
                    and not name.startswith("aten::_assert")):  # runtime assertions, removed by to_edge
                counts[str(node.target)] += 1
    return dict(counts)


REPRO_RUNNER = '''def run_backend(program, inputs):
    """ExecuTorch: to_edge_transform_and_lower ({partitioner_name}) -> .pte -> the runtime."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime
{partitioner_import}
    edge = to_edge_transform_and_lower(program, partitioner={partitioners})
    buffer = edge.to_executorch().buffer
    method = Runtime.get().load_program(buffer).load_method("forward")
    return list(method.execute([t.contiguous() for t in inputs]))
'''


class XnnpackBackend(Backend):
    name = "xnnpack"
    requires = ("executorch",)
    # unrolled_lstm: ExecuTorch's decomposition of aten.lstm cuts the XNNPACK partition at every time
    # step (T + 3 delegate subgraphs); the cell written with ops XNNPACK takes gives 3 per LSTM. The
    # en_short duration encoder: 17 subgraphs instead of 206, 3.1x less compile CPU, 1 GB less peak
    # (README finding 6). The portable backend inherits it, so both run the same program.
    patches = Backend.patches + ("unrolled_lstm",)
    workarounds = {"unrolled_lstm": Workaround(
        "unrolled_lstm", "ExecuTorch's decomposition of aten.lstm cuts the XNNPACK partition at every time step "
        "(T + 2 delegate subgraphs per LSTM): slow lowering, large peak memory", "executorch 1.5.1",
        "docs/upstream/executorch-xnnpack-lstm-cut/", patch="unrolled_lstm", kind="performance")}
    artifact_name = "program.pte"
    description = "ExecuTorch with the XNNPACK delegate"

    def partitioners(self) -> list:
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]

    # repro.py's runner: the same lowering as `compile`, in ExecuTorch's own API only
    repro_partitioner = dict(partitioner_name="XnnpackPartitioner", partitioners="[XnnpackPartitioner()]",
                             partitioner_import="    from executorch.backends.xnnpack.partition.xnnpack_partitioner "
                                                "import XnnpackPartitioner")

    def repro_source(self) -> str:
        return REPRO_RUNNER.format(**self.repro_partitioner)

    def audit(self, program_path: Path) -> dict:
        import torch

        program = torch.export.load(str(program_path))
        return {"non_core_aten_ops": _core_aten_violations(program.run_decompositions())}

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        import torch
        from executorch.exir import to_edge_transform_and_lower

        program = torch.export.load(str(program_path))
        partitioners = self.partitioners()
        edge = to_edge_transform_and_lower(program, partitioner=partitioners)
        audit = _delegation(edge) if partitioners else {"kernels": "portable"}
        et = edge.to_executorch()
        (out_dir / self.artifact_name).write_bytes(et.buffer)
        return audit

    def run(self, artifact_path: Path, inputs: list) -> list:
        from executorch.runtime import Runtime

        method = Runtime.get().load_program(str(artifact_path)).load_method("forward")
        return list(method.execute([t.contiguous() for t in inputs]))


class PortableBackend(XnnpackBackend):
    """No partitioner: every op on ExecuTorch's portable kernels. When xnnpack fails and portable
    passes, the failure belongs to the delegate; when both fail, to ExecuTorch itself."""

    name = "portable"
    description = "ExecuTorch without a delegate (portable kernels)"

    repro_partitioner = dict(partitioner_name="no delegate: portable kernels", partitioners="[]", partitioner_import="")
    workarounds = {}  # unrolled_lstm is kept so that it runs xnnpack's program, not as a workaround

    def partitioners(self) -> list:
        return []


def _delegation(edge) -> dict:
    try:
        from executorch.devtools.backend_debug import get_delegation_info
    except ImportError:
        return {}
    info = get_delegation_info(edge.exported_program().graph_module)
    delegated = info.num_delegated_nodes
    total = delegated + info.num_non_delegated_nodes
    outside = {}
    for op, row in info.delegation_by_operator.items():
        if row.non_delegated > 0:
            outside[op] = row.non_delegated
    return {"delegated_nodes": delegated, "non_delegated_nodes": info.num_non_delegated_nodes,
            "delegate_coverage": delegated / total if total else 0.0,
            "delegated_subgraphs": info.num_delegated_subgraphs, "ops_outside_delegate": outside}
