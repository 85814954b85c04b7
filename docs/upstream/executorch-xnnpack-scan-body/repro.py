#!/usr/bin/env python3
"""Repro: ExecuTorch XNNPACK: XnnpackPartitioner leaves the body of a scan (a loop such as an LSTM cell) to portable kernels

Minimal program: program.pt2 (torch.export of the module in REPORT.md), inputs.pt, and the float64
result of the same program, expected.pt. Needs only torch, numpy and executorch (versions in ENV.md).

Exit code: 1 while the defect reproduces, 0 once it is fixed, 2 when it cannot run here (the
runtime is not installed), 3 when it fails differently (read the output).
"""
import sys
from pathlib import Path

import numpy as np
import torch

try:  # the runtime under test: without it, this cannot run here (exit 2)
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.graph_module import get_control_flow_submodules
    from executorch.runtime import Runtime
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

HERE = Path(__file__).resolve().parent
SIGNATURE = 'scan'  # the text that is this defect


def values_match(program, inputs, expected, got, runtime):
    """Converted and ran: compare with the float64 expected output, beside PyTorch float32's own error."""
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ours = list(ours) if isinstance(ours, (list, tuple)) else [ours]
    worst = []
    for ref, o32, out in zip(expected, ours, got):
        out = torch.as_tensor(out).double().reshape(ref.shape)
        if ref.dtype in (torch.bool, torch.int64, torch.int32):
            worst.append((0.0 if torch.equal(out.to(ref.dtype), ref) else float("inf"), 0.0))
            continue
        norm = float(ref.norm()) or 1.0
        worst.append((float((out - ref).norm()) / norm, float((o32.double() - ref).norm()) / norm))
    bad = [(e, f) for e, f in worst if not (e == e) or e > max(1e-5, 4 * f)]
    table = ", ".join(f"rel_l2 {e:.3e} (PyTorch fp32 {f:.3e})" for e, f in worst)
    if bad:
        return 3, f"CHANGED: {runtime} converts now, but its outputs differ from float64: {table}"
    return 0, f"FIXED: {runtime} converts and matches float64 within 4 x PyTorch float32's error: {table}"


def check(program, inputs, expected):
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


def main():
    try:
        import executorch  # noqa: F401
    except ImportError as e:
        print(f"cannot run here: {e}")
        return 2
    program = torch.export.load(str(HERE / "program.pt2"))
    inputs = torch.load(HERE / "inputs.pt", weights_only=True)
    expected = torch.load(HERE / "expected.pt", weights_only=True)["float64"]
    print(f"torch {torch.__version__}, numpy {np.__version__}; inputs " +
          ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in inputs))
    code, message = check(program, inputs, expected)
    print(message)
    return code


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - not the defect's signature: exit 3, never 1
        import traceback

        traceback.print_exc()
        print(f"CHANGED: repro.py itself failed: {type(e).__name__}: {e}")
        sys.exit(3)
