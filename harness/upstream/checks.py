"""The runtime checks of the upstream bundles, pasted into each standalone repro.py.

Each `check(program, inputs, expected) -> (exit code, message)` imports only its runtime inside:
inspect.getsource pastes it (with the helpers it names in `CHECKS`) into a repro.py that must run
without kokoro or this harness, and the runtimes are optional.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# repro.py defines these two for the checks
SIGNATURE = ""
HERE = Path(".")


def classify(error):
    """The runtime raised: the defect when its message carries SIGNATURE, else a different failure."""
    import traceback

    text = f"{type(error).__name__}: {error}"
    frames = traceback.format_exception(type(error), error, error.__traceback__)
    print("".join(frames[-6:]).rstrip())
    if SIGNATURE in text:
        return 1, f"REPRODUCED: {text.strip().splitlines()[-1][:300]}"
    return 3, f"CHANGED: a different error than {SIGNATURE!r}: {text.strip().splitlines()[-1][:300]}"


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


def check_coreml(program, inputs, expected):
    """coremltools: the ATen inference IR (run_decompositions({})) to an mlprogram, FLOAT32."""
    import platform

    import coremltools as ct

    try:
        model = ct.convert(program.run_decompositions({}), convert_to="mlprogram",
                           minimum_deployment_target=ct.target.iOS17, compute_precision=ct.precision.FLOAT32,
                           compute_units=ct.ComputeUnit.CPU_ONLY, skip_model_load=platform.system() != "Darwin")
    except Exception as e:  # noqa: BLE001 - the converter's error is the finding
        return classify(e)
    if platform.system() != "Darwin":
        return 0, (f"FIXED: coremltools {ct.__version__} converts the program (prediction needs macOS: "
                   f"values not compared on {platform.system()})")
    spec = model.get_spec()
    out = model.predict({i.name: t.numpy() for i, t in zip(spec.description.input, inputs)})
    got = [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]
    return values_match(program, inputs, expected, got, f"coremltools {ct.__version__}")


def _tvm_run(mod, inputs):
    import tvm
    from tvm import relax

    with tvm.transform.PassContext(opt_level=3):
        executable = relax.build(mod, target="llvm")
    out = relax.VirtualMachine(executable, tvm.cpu())["main"](
        *[tvm.runtime.tensor(np.ascontiguousarray(t.numpy())) for t in inputs])

    def flatten(v):
        return [v] if hasattr(v, "numpy") else [x for item in v for x in flatten(item)]
    return [torch.from_numpy(np.array(o.numpy())) for o in flatten(out)]


def check_tvm(program, inputs, expected):
    """TVM Relax: from_exported_program, relax.build for llvm, the Relax VM."""
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    try:
        got = _tvm_run(from_exported_program(program), inputs)
    except Exception as e:  # noqa: BLE001 - the frontend's or the build's error is the finding
        return classify(e)
    return values_match(program, inputs, expected, got, f"TVM {tvm.__version__}")


def check_tvm_onnx(program, inputs, expected):
    """TVM Relax's ONNX frontend on model.onnx (torch.onnx.export, dynamo, opset 18, of program.pt2)."""
    import onnx
    import tvm
    from tvm.relax.frontend.onnx import from_onnx

    model = onnx.load(str(HERE / "model.onnx"))
    print("ONNX nodes:", [n.op_type for n in model.graph.node])
    try:
        got = _tvm_run(from_onnx(model, keep_params_in_input=False), inputs)
    except Exception as e:  # noqa: BLE001 - the frontend's error is the finding
        return classify(e)
    return values_match(program, inputs, expected, got, f"TVM {tvm.__version__} (ONNX frontend)")


def _xnnpack_lower(program):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower

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
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.graph_module import get_control_flow_submodules

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
    from executorch.runtime import Runtime

    got = Runtime.get().load_program(edge.to_executorch().buffer).load_method("forward").execute(
        [t.contiguous() for t in inputs])
    code, message = values_match(program, inputs, expected, got, "ExecuTorch (XNNPACK)")
    if code:
        return code, message
    return 0, (f"FIXED: {delegated} XNNPACK delegate call(s) inside the {SIGNATURE} body ({sum(outside.values())} "
               f"op(s) still outside); {message.removeprefix('FIXED: ')}")


def check_tvm_lstm_steps(program, inputs, expected):
    """TVM Relax's from_exported_program on the same LSTM exported at T and at 4T: does the imported
    `main` grow with the time steps (the recurrence written out) or stay one loop?"""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

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


def check_executorch_dim_order(program, inputs, expected):
    """ExecuTorch portable kernels and XNNPACK: a program exported from an example whose size-1
    axis has an unusual stride (torch calls it contiguous) gets a non-standard dim order, and its
    own kernels reject it whatever strides the inputs have at run time (here: standard ones)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

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
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

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

def check_float16(program, inputs, expected):
    """PyTorch in float16 on CPU (what a float16 deployment computes): does the output stay finite?"""
    module = program.module()
    with torch.no_grad():
        got = module.half()(*[t.half() if t.is_floating_point() else t for t in inputs])
    got = got.double()
    ref = expected[0]
    bad = ~torch.isfinite(got) & torch.isfinite(ref)
    if bad.any():
        first = int(bad.reshape(-1).nonzero()[0]) if bad.any() else -1
        return 1, (f"REPRODUCED: {float(bad.double().mean()):.1%} of the float16 output is non-finite "
                   f"(from sample {first} of {ref.numel()}, {first / 24000:.2f} s at 24 kHz); float64 is finite")
    err = float((got - ref).norm() / ref.norm())
    return 0, f"FIXED: the float16 output is finite (relative L2 {err:.3e} against float64)"


def check_executorch_instance_norm(program, inputs, expected):
    """ExecuTorch's portable InstanceNorm (XNNPACK leaves it there): NaN, or an error far beyond
    PyTorch float32's, where the variance cancels in one pass."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    buffer = to_edge_transform_and_lower(program, partitioner=[]).to_executorch().buffer
    got = torch.as_tensor(Runtime.get().load_program(buffer).load_method("forward").execute(
        [t.contiguous() for t in inputs])[0])
    return one_pass_variance_verdict(program, inputs, expected, got, "")


def one_pass_variance_verdict(program, inputs, expected, got, runtime):
    """(exit code, message) for an InstanceNorm's output `got`: NaN, or an error over 4x PyTorch
    float32's own against float64, is the one-pass variance E[x^2] - E[x]^2 cancelling."""
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ref = expected[0]
    floor = float((ours.double() - ref).norm() / ref.norm())
    nan = float(torch.isnan(got).float().mean())
    if nan:
        return 1, (f"REPRODUCED: {nan:.0%} NaN{runtime} where PyTorch float32 is within rel_l2 {floor:.1e} of "
                   f"float64: the variance, E[x^2] - E[x]^2 from float32 sums, is negative")
    err = float((got.double() - ref).norm() / ref.norm())
    if err > 4 * floor:
        return 1, f"REPRODUCED: rel_l2 {err:.3e} against PyTorch float32's {floor:.3e} (one-pass variance)"
    return 0, f"FIXED: rel_l2 {err:.3e}, PyTorch float32 {floor:.3e}"


def check_tvm_instance_norm(program, inputs, expected):
    """TVM Relax's InstanceNorm (topi): NaN, or an error far beyond PyTorch float32's, where the
    variance cancels in one pass."""
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    got = _tvm_run(from_exported_program(program), inputs)[0]
    return one_pass_variance_verdict(program, inputs, expected, got, f" (TVM {tvm.__version__})")


# check name -> (the check, the helpers repro.py needs beside the defect's own `helpers`)
CHECKS = {
    "check_coreml": (check_coreml, ()),
    "check_tvm": (check_tvm, (_tvm_run,)),
    "check_tvm_onnx": (check_tvm_onnx, (_tvm_run,)),
    "check_tvm_instance_norm": (check_tvm_instance_norm, (_tvm_run, one_pass_variance_verdict)),
    "check_tvm_lstm_steps": (check_tvm_lstm_steps, (_tvm_run,)),
    "check_xnnpack_outside": (check_xnnpack_outside, (_xnnpack_lower,)),
    "check_xnnpack_cut": (check_xnnpack_cut, (_xnnpack_lower,)),
    "check_xnnpack_scan_body": (check_xnnpack_scan_body, ()),
    "check_executorch_dim_order": (check_executorch_dim_order, ()),
    "check_executorch_cumsum": (check_executorch_cumsum, ()),
    "check_executorch_instance_norm": (check_executorch_instance_norm, (one_pass_variance_verdict,)),
    "check_float16": (check_float16, ()),
}
HELPERS = {"classify": classify, "values_match": values_match}
