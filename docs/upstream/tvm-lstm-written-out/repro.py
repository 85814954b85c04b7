#!/usr/bin/env python3
"""Repro: TVM Relax: from_exported_program writes aten.lstm out one cell per time step (the IRModule grows with T, the compile's peak memory with its square)

Minimal program: program.pt2 (torch.export of the module in REPORT.md), inputs.pt, and the float64
result of the same program, expected.pt. Needs only torch, numpy and apache-tvm (versions in ENV.md).

Exit code: 1 while the defect reproduces, 0 once it is fixed, 2 when it cannot run here (the
runtime is not installed), 3 when it fails differently (read the output).
"""
import sys
from pathlib import Path

import numpy as np
import torch

try:  # the runtime under test: without it, this cannot run here (exit 2)
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program
except ImportError as e:
    print(f"cannot run here: {e}")
    sys.exit(2)

HERE = Path(__file__).resolve().parent
SIGNATURE = 'bindings per time step'  # the text that is this defect


def _tvm_run(mod, inputs):
    with tvm.transform.PassContext(opt_level=3):
        executable = relax.build(mod, target="llvm")
    out = relax.VirtualMachine(executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(np.ascontiguousarray(t.numpy())) for t in inputs])

    def flatten(v):
        return [v] if hasattr(v, "numpy") else [x for item in v for x in flatten(item)]
    return [torch.from_numpy(np.array(o.numpy())) for o in flatten(out)]


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
    """TVM Relax's from_exported_program on the same LSTM exported at T and at 4T: does the imported
    `main` grow with the time steps (the recurrence written out) or stay one loop?"""
    x = inputs[0]
    module = program.module(check_guards=False)
    module.validate_inputs = False  # the same graph, re-exported at another length
    sizes = {}
    for steps in (x.shape[1], 4 * x.shape[1]):
        ep = program if steps == x.shape[1] else torch.export.export(module, (x.repeat(1, 4, 1),))
        main = from_exported_program(ep)["main"]
        bindings = [b for block in main.body.blocks for b in block.bindings]
        ops = {}
        for b in bindings:
            if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                ops[b.value.op.name] = ops.get(b.value.op.name, 0) + 1
        sizes[steps] = len(bindings)
        lstm = [str(n.target) for n in ep.graph.nodes if n.op == "call_function" and "lstm" in str(n.target)]
        print(f"T={steps}: exported graph {lstm}; Relax main: {len(bindings)} bindings, {sum(ops.values())} op calls "
              f"({', '.join(f'{k} {v}' for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:5])})")
    (t1, n1), (t2, n2) = sizes.items()
    if n2 > 2 * n1:
        per_step = (n2 - n1) / (t2 - t1)
        return 1, (f"REPRODUCED: Relax main has {n1} bindings at T={t1} and {n2} at T={t2}, {per_step:.0f} "
                   f"{SIGNATURE}: the LSTM is written out one cell per step (a loop would keep main constant)")
    got = _tvm_run(from_exported_program(program), inputs)
    code, message = values_match(program, inputs, expected, got, f"TVM {tvm.__version__}")
    if code:
        return code, message
    return 0, f"FIXED: Relax main has {n1} bindings at T={t1} and {n2} at T={t2}; {message.removeprefix('FIXED: ')}"


def main():
    try:
        import tvm  # noqa: F401
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
