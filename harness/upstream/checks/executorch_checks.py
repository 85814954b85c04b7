"""ExecuTorch's checks: the XNNPACK partitioner's delegation and the portable kernels' numerics."""
from __future__ import annotations

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.devtools.backend_debug import get_delegation_info
from executorch.exir import to_edge_transform_and_lower
from executorch.exir.graph_module import get_control_flow_submodules
from executorch.runtime import Runtime

from .common import SIGNATURE, one_pass_variance_verdict, values_match


def _xnnpack_lower(program):
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    info = get_delegation_info(edge.exported_program().graph_module)
    outside = {op: row.non_delegated for op, row in info.delegation_by_operator.items() if row.non_delegated}
    print(f"delegated nodes {info.num_delegated_nodes}, outside the delegate {info.num_non_delegated_nodes}, "
          f"delegate subgraphs {info.num_delegated_subgraphs}")
    print("ops outside the delegate:", outside)
    return edge, info, outside


def check_xnnpack_outside(program, inputs, expected):
    """ExecuTorch + XnnpackPartitioner: is the op (SIGNATURE) left outside the delegate?"""
    edge, info, outside = _xnnpack_lower(program)
    left = {op: n for op, n in outside.items() if SIGNATURE in op}
    if left:
        return 1, f"REPRODUCED: {left} stay outside the XNNPACK delegate (run on portable kernels)"
    return 0, f"FIXED: no {SIGNATURE} outside the XNNPACK delegate"


def check_xnnpack_cut(program, inputs, expected):
    """ExecuTorch + XnnpackPartitioner: one LSTM over T steps should be a few delegate subgraphs, not ~T."""
    edge, info, outside = _xnnpack_lower(program)
    steps = inputs[0].shape[1]
    n = info.num_delegated_subgraphs
    if n >= steps:
        return 1, (f"REPRODUCED: one LSTM over T={steps} time steps is cut into {n} XNNPACK delegate subgraphs "
                   f"(split/squeeze/getitem between the steps stay outside the delegate)")
    return 0, f"FIXED: {n} delegate subgraph(s) for an LSTM over T={steps} steps"


def check_xnnpack_scan_body(program, inputs, expected):
    """ExecuTorch + XnnpackPartitioner on a program whose loop is torch's `scan` (SIGNATURE): are the
    ops of its body (the LSTM cell, run at every time step) delegated? to_backend lowers what a
    partitioner tags inside control-flow submodules; the stock partitioner tags the top-level graph."""
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    top = edge.exported_program().graph_module

    def name(node):
        return getattr(node.target, "__name__", str(node.target))

    def bodies(gm):
        for _, body, node in get_control_flow_submodules(gm):
            yield name(node), body
            yield from bodies(body)

    found = list(bodies(top))
    top_calls = sum(n.op == "call_function" and name(n) == "executorch_call_delegate" for n in top.graph.nodes)
    print(f"top-level graph: {top_calls} XNNPACK delegate call(s); control-flow bodies: {[k for k, _ in found]}")
    if not any(SIGNATURE in k for k, _ in found):
        return 3, f"CHANGED: no {SIGNATURE} body left after lowering (the loop was unrolled or removed): read the graph"
    delegated, outside = 0, {}
    for _, body in found:
        for n in body.graph.nodes:
            if n.op != "call_function" or name(n) == "getitem":
                continue
            if name(n) == "executorch_call_delegate":
                delegated += 1
            else:
                outside[name(n)] = outside.get(name(n), 0) + 1
    print(f"in the {SIGNATURE} body: {delegated} delegate call(s); ops outside the delegate: {outside}")
    steps = inputs[0].shape[0]
    if not delegated:
        return 1, (f"REPRODUCED: none of the {sum(outside.values())} ops of the {SIGNATURE} body is delegated: they "
                   f"run on portable kernels, one after another at each of the T={steps} steps")

    buffer = edge.to_executorch().buffer  # held while the method runs: from a temporary, some runs differed
    got = Runtime.get().load_program(buffer).load_method("forward").execute([t.contiguous() for t in inputs])
    code, message = values_match(program, inputs, expected, got, "ExecuTorch (XNNPACK)")
    if code:
        return code, message
    return 0, (f"FIXED: {delegated} XNNPACK delegate call(s) inside the {SIGNATURE} body ({sum(outside.values())} "
               f"op(s) still outside); {message.removeprefix('FIXED: ')}")


def check_executorch_dim_order(program, inputs, expected):
    """ExecuTorch portable kernels and XNNPACK: a program exported from an example whose size-1
    axis has an unusual stride (torch calls it contiguous) gets a non-standard dim order, and its
    own kernels reject it whatever strides the inputs have at run time (here: standard ones)."""
    standard = [torch.empty(t.shape, dtype=t.dtype).copy_(t) for t in inputs]
    outcomes = []
    for name, partitioner in (("portable kernels", []), ("XNNPACK", [XnnpackPartitioner()])):
        buffer = to_edge_transform_and_lower(program, partitioner=partitioner).to_executorch().buffer
        method = Runtime.get().load_program(buffer).load_method("forward")
        try:
            got = method.execute(standard)
        except RuntimeError as e:
            outcomes.append(f"{name}: {e}")
            continue
        code, message = values_match(program, inputs, expected, got, f"ExecuTorch ({name})")
        if code:
            return code, message
    if outcomes:
        return 1, "REPRODUCED: " + "; ".join(outcomes) + " (the kernels log 'different dim orders' / " \
                  "'Propagating input shapes failed')"
    return 0, "FIXED: both run the program exported from a transposed [1, N, 1] example"


def check_executorch_cumsum(program, inputs, expected):
    """ExecuTorch's portable cumsum (XNNPACK leaves cumsum to it): its error against float64,
    beside PyTorch float32's own (PyTorch accumulates a float cumsum in double on CPU)."""
    buffer = to_edge_transform_and_lower(program, partitioner=[]).to_executorch().buffer
    got = Runtime.get().load_program(buffer).load_method("forward").execute([t.contiguous() for t in inputs])
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ref = expected[0]
    err = float((torch.as_tensor(got[0]).double() - ref).norm() / ref.norm())
    floor = float((ours.double() - ref).norm() / ref.norm())
    if err > 4 * floor:
        return 1, (f"REPRODUCED: ExecuTorch's cumsum is {err / floor:.1f}x PyTorch float32's error against "
                   f"float64 (rel_l2 {err:.3e} vs {floor:.3e}): it accumulates in float32 along the sequence")
    return 0, f"FIXED: ExecuTorch's cumsum within 4x PyTorch float32's error (rel_l2 {err:.3e} vs {floor:.3e})"


def check_executorch_instance_norm(program, inputs, expected):
    """ExecuTorch's portable InstanceNorm (XNNPACK leaves it there): NaN, or an error far beyond
    PyTorch float32's, where the variance cancels in one pass."""
    buffer = to_edge_transform_and_lower(program, partitioner=[]).to_executorch().buffer
    got = torch.as_tensor(Runtime.get().load_program(buffer).load_method("forward").execute(
        [t.contiguous() for t in inputs])[0])
    return one_pass_variance_verdict(program, inputs, expected, got, "")
