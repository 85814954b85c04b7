"""TVM Relax's checks: its PyTorch and ONNX frontends, relax.build for llvm, the Relax VM."""
from __future__ import annotations

import numpy as np
import onnx
import torch
import tvm
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.relax.frontend.torch import from_exported_program

from .common import HERE, SIGNATURE, classify, one_pass_variance_verdict, values_match


def _tvm_run(mod, inputs):
    with tvm.transform.PassContext(opt_level=3):
        executable = relax.build(mod, target="llvm")
    out = relax.VirtualMachine(executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(np.ascontiguousarray(t.numpy())) for t in inputs])

    def flatten(v):
        return [v] if hasattr(v, "numpy") else [x for item in v for x in flatten(item)]
    return [torch.from_numpy(np.array(o.numpy())) for o in flatten(out)]


def check_tvm(program, inputs, expected):
    """TVM Relax: from_exported_program, relax.build for llvm, the Relax VM."""
    try:
        got = _tvm_run(from_exported_program(program), inputs)
    except Exception as e:  # noqa: BLE001 - the frontend's or the build's error is the finding
        return classify(e)
    return values_match(program, inputs, expected, got, f"TVM {tvm.__version__}")


def check_tvm_onnx(program, inputs, expected):
    """TVM Relax's ONNX frontend on model.onnx (torch.onnx.export, dynamo, opset 18, of program.pt2)."""
    model = onnx.load(str(HERE / "model.onnx"))
    print("ONNX nodes:", [n.op_type for n in model.graph.node])
    try:
        got = _tvm_run(from_onnx(model, keep_params_in_input=False), inputs)
    except Exception as e:  # noqa: BLE001 - the frontend's error is the finding
        return classify(e)
    return values_match(program, inputs, expected, got, f"TVM {tvm.__version__} (ONNX frontend)")


def check_tvm_lstm_steps(program, inputs, expected):
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


def check_tvm_instance_norm(program, inputs, expected):
    """TVM Relax's InstanceNorm (topi): NaN, or an error far beyond PyTorch float32's, where the
    variance cancels in one pass."""
    got = _tvm_run(from_exported_program(program), inputs)[0]
    return one_pass_variance_verdict(program, inputs, expected, got, f" (TVM {tvm.__version__})")
