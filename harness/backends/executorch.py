"""`xnnpack`: torch.export -> to_edge_transform_and_lower(XnnpackControlFlowPartitioner) -> .pte ->
the ExecuTorch runtime. The audit records what ExecuTorch's own delegation info says stayed outside
the delegate (control-flow bodies included): those ops run on portable kernels and are the usual
cause of slow runs."""
from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import torch

from . import Backend, Workaround
from .cost import AUDIO_SECONDS, CostLaw
from ..plumbing.deferred import deferred_import

# ExecuTorch's import is 3 s: a report's table, which reads this backend's class, must not pay it
xnnpack_partitioner = deferred_import("executorch.backends.xnnpack.partition.xnnpack_partitioner")
exir = deferred_import("executorch.exir")
et_runtime = deferred_import("executorch.runtime")
control_flow = deferred_import("harness.backends.control_flow")  # imports executorch at its top


def _core_aten_violations(program) -> dict[str, int]:
    """Ops of the program outside the Core ATen set (ExecuTorch rejects them without a decomposition)."""
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


UNROLLED_LSTM = Workaround(
    "unrolled_lstm", "ExecuTorch's decomposition of aten.lstm cuts the XNNPACK partition at every time step "
    "(T + 2 delegate subgraphs per LSTM): slow lowering, large peak memory", "executorch 1.5.1",
    "docs/upstream/executorch-xnnpack-lstm-cut/", patch="unrolled_lstm", kind="performance")
SCAN_LSTM = Workaround(
    "scan_lstm", "ExecuTorch has no LSTM that stays one op: to_edge decomposes aten.lstm per time step, as "
    "unrolled_lstm writes it, so the graph, its lowering time and its lowering memory grow with the bucket "
    "(f0n static: 8.6 GB at 384 frames)", "executorch 1.5.1",
    "no bundle yet (docs/performance.md, LSTM cost against T)", patch="scan_lstm", kind="performance")
STFT_PHASE_WHERE = Workaround(
    "stft_phase_where", "CustomSTFT's `phase[mask] = pi` is a boolean index_put that XNNPACK does not take; "
    "the portable index_put.out's time grows as elements x selected elements (54 % of en_short's decoder run; "
    "torch.where computes the same values in milliseconds)", "executorch 1.5.1",
    "no bundle yet (docs/performance.md, benchmarks/etdump_index_put.py)", patch="stft_phase_where",
    kind="performance")
INSTANCE_NORM_FLOAT64_STATS = Workaround(
    "instance_norm_float64_stats", "the portable InstanceNorm (_native_batch_norm_legit.no_stats, left outside "
    "the XNNPACK delegate) takes var = E[x^2] - E[x]^2 from sequential float sums: negative on a long channel with "
    "a large mean, so 1/sqrt(var + eps) is NaN (en_long's static generator: 100 % NaN audio)", "executorch 1.5.1",
    "docs/upstream/executorch-instancenorm-variance/", patch="instance_norm_float64_stats")
CONTROL_FLOW_PARTITIONER = Workaround(
    "control_flow_partitioner", "XnnpackPartitioner tags the top-level graph only: the body of a scan "
    "(scan_lstm's LSTM cell) stays on portable kernels, op by op at every step", "executorch 1.5.1",
    "docs/upstream/executorch-xnnpack-scan-body/", kind="performance")
# What every ExecuTorch backend's program needs. unrolled_lstm: ExecuTorch's decomposition of
# aten.lstm cuts the XNNPACK partition at every time step (T + 3 delegate subgraphs); the cell
# written with ops XNNPACK takes gives 3 per LSTM. The en_short duration encoder: 17 subgraphs
# instead of 206, 3.1x less compile CPU, 1 GB less peak (README finding 6).
EXECUTORCH_PATCHES = Backend.patches + ("unrolled_lstm",)


CONTROL_FLOW_IMPORTS = """from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir.backend.canonical_partitioners.pattern_op_partitioner import (
    generate_grouped_partitions_from_list_of_nodes,
)
from executorch.exir.backend.partitioner import PartitionResult
from executorch.exir.graph_module import get_control_flow_submodules


"""  # repro.py's copy of harness/backends/control_flow.py (torch is imported there already)


class XnnpackBackend(Backend):
    name = "xnnpack"
    requires = ("executorch",)
    # scan_lstm (registered after unrolled_lstm, so it wins): the same cell once, as a scan body, so
    # lowering stays flat in T (en_long's f0n: 1.7 GB instead of ~35 GB); the control-flow
    # partitioner puts that body in the delegate (docs/performance.md, LSTM cost against T). The
    # portable backend inherits both patches, so both run the same program.
    # stft_phase_where: the STFT's phase correction as torch.where, so that it is not a portable
    # index_put whose time grows with the square of the audio's length (docs/performance.md).
    # instance_norm_float64_stats: the InstanceNorms' statistics in float64, since the portable kernel's
    # one-pass variance is NaN on long channels (docs/upstream/executorch-instancenorm-variance/).
    patches = EXECUTORCH_PATCHES + ("scan_lstm", "stft_phase_where", "instance_norm_float64_stats")
    workarounds = {w.name: w for w in (UNROLLED_LSTM, SCAN_LSTM, STFT_PHASE_WHERE, INSTANCE_NORM_FLOAT64_STATS,
                                       CONTROL_FLOW_PARTITIONER)}
    artifact_name = "program.pte"
    run_imports = ("executorch.runtime",)
    description = "ExecuTorch with the XNNPACK delegate"

    def disabled_workarounds(self) -> set[str]:
        """scan_lstm loops over unrolled_lstm's cell: with unrolled_lstm off (aten.lstm, the defect
        it hides), scan_lstm goes too."""
        off = super().disabled_workarounds()
        return off | ({"scan_lstm"} & set(self.workarounds)) if "unrolled_lstm" in off else off

    def _control_flow_partitioner(self) -> bool:
        """Whether this backend lowers with XnnpackControlFlowPartitioner (subclasses with their own
        partitioners do not)."""
        return (type(self).partitioners is XnnpackBackend.partitioners
                and "control_flow_partitioner" not in self.disabled_workarounds())

    def partitioners(self) -> list:
        if self._control_flow_partitioner():
            return [control_flow.XnnpackControlFlowPartitioner()]
        return [xnnpack_partitioner.XnnpackPartitioner()]

    def version(self) -> str:
        """The partitioner is part of the artifact key: an artifact lowered by the stock partitioner
        (a scan body on portable kernels) is not this one."""
        return super().version() + (";partitioner=control_flow" if self._control_flow_partitioner() else "")

    # repro.py's runner: the same lowering as `compile`, in ExecuTorch's own API only
    repro_partitioner = dict(partitioner_name="XnnpackPartitioner", partitioners="[XnnpackPartitioner()]",
                             partitioner_import="    from executorch.backends.xnnpack.partition.xnnpack_partitioner "
                                                "import XnnpackPartitioner")

    def repro_source(self) -> str:
        if not self._control_flow_partitioner():
            return REPRO_RUNNER.format(**self.repro_partitioner)
        helpers = CONTROL_FLOW_IMPORTS + "".join(inspect.getsource(f) + "\n\n" for f in (
            control_flow._BodyView, control_flow.control_flow_bodies, control_flow.XnnpackControlFlowPartitioner))
        return helpers + REPRO_RUNNER.format(
            partitioner_name="XnnpackControlFlowPartitioner, above", partitioner_import="",
            partitioners="[XnnpackControlFlowPartitioner()]")

    def audit(self, program_path: Path) -> dict:
        program = torch.export.load(str(program_path))
        return {"non_core_aten_ops": _core_aten_violations(program.run_decompositions())}

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        program = torch.export.load(str(program_path))
        partitioners = self.partitioners()
        edge = exir.to_edge_transform_and_lower(program, partitioner=partitioners)
        audit = _delegation(edge) if partitioners else {"kernels": "portable"}
        et = edge.to_executorch()
        (out_dir / self.artifact_name).write_bytes(et.buffer)
        return audit

    def run(self, artifact_path: Path, inputs: list) -> list:
        method = et_runtime.Runtime.get().load_program(str(artifact_path)).load_method("forward")
        return list(method.execute([t.contiguous() for t in inputs]))


class PortableBackend(XnnpackBackend):
    """No partitioner: every op on ExecuTorch's portable kernels. When xnnpack fails and portable
    passes, the failure belongs to the delegate; when both fail, to ExecuTorch itself."""

    name = "portable"
    description = "ExecuTorch without a delegate (portable kernels)"

    repro_partitioner = dict(partitioner_name="no delegate: portable kernels", partitioners="[]", partitioner_import="")
    # unrolled_lstm is kept so that it runs xnnpack's program, not as a workaround; scan_lstm is one
    # here too (portable's unrolled lowering grows with T as well: docs/performance.md), and so is
    # stft_phase_where (the slow index_put is a portable kernel either way)
    workarounds = {"scan_lstm": SCAN_LSTM, "stft_phase_where": STFT_PHASE_WHERE,
                   "instance_norm_float64_stats": INSTANCE_NORM_FLOAT64_STATS}
    # Portable kernels run Kokoro's vocoder at about 97x real time, linear in the audio:
    # `benchmarks/run_cost.py --backend portable` (2026-11-25, decoder buckets of 48, 96, 144 frames,
    # random weights: run time depends on shapes). en_short's real decoder took 354 s for 3.6 s.
    run_time = CostLaw(AUDIO_SECONDS, "s", ((1.2, 116.3), (2.4, 235.1), (3.6, 345.6)))

    def partitioners(self) -> list:
        return []


def _delegation(edge) -> dict:
    """ExecuTorch's delegation info of the lowered graph and, once each, of its control-flow bodies
    (`get_delegation_info` reads one graph: a scan body's nodes, delegated or not, would be missing)."""
    try:
        # optional runtime: executorch extra
        from executorch.devtools.backend_debug import get_delegation_info
    except ImportError:
        return {}
    top = edge.exported_program().graph_module
    bodies = list(control_flow.control_flow_bodies(top))
    delegated = non_delegated = subgraphs = in_bodies = 0
    outside: Counter = Counter()
    for i, gm in enumerate([top, *bodies]):
        info = get_delegation_info(gm)
        delegated += info.num_delegated_nodes
        non_delegated += info.num_non_delegated_nodes
        subgraphs += info.num_delegated_subgraphs
        in_bodies += info.num_delegated_subgraphs if i else 0
        for op, row in info.delegation_by_operator.items():
            if row.non_delegated > 0:
                outside[op] += row.non_delegated
    total = delegated + non_delegated
    audit = {"delegated_nodes": delegated, "non_delegated_nodes": non_delegated,
             "delegate_coverage": delegated / total if total else 0.0,
             "delegated_subgraphs": subgraphs, "ops_outside_delegate": dict(outside)}
    if bodies:
        audit.update(control_flow_bodies=len(bodies), delegated_subgraphs_in_bodies=in_bodies)
    return audit
