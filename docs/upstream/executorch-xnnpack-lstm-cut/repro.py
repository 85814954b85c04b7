#!/usr/bin/env python3
"""Repro: ExecuTorch XNNPACK: a decomposed aten.lstm is cut into a delegate subgraph per time step

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
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

HERE = Path(__file__).resolve().parent
SIGNATURE = 'lstm'  # the text that is this defect


def _xnnpack_lower(program):
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    info = get_delegation_info(edge.exported_program().graph_module)
    outside = {op: row.non_delegated for op, row in info.delegation_by_operator.items() if row.non_delegated}
    print(f"delegated nodes {info.num_delegated_nodes}, outside the delegate {info.num_non_delegated_nodes}, "
          f"delegate subgraphs {info.num_delegated_subgraphs}")
    print("ops outside the delegate:", outside)
    return edge, info, outside


def check(program, inputs, expected):
    """ExecuTorch + XnnpackPartitioner: one LSTM over T steps should be a few delegate subgraphs, not ~T."""
    edge, info, outside = _xnnpack_lower(program)
    steps = inputs[0].shape[1]
    n = info.num_delegated_subgraphs
    if n >= steps:
        return 1, (f"REPRODUCED: one LSTM over T={steps} time steps is cut into {n} XNNPACK delegate subgraphs "
                   f"(split/squeeze/getitem between the steps stay outside the delegate)")
    return 0, f"FIXED: {n} delegate subgraph(s) for an LSTM over T={steps} steps"


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
