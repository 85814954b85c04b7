"""Upstream repro bundles: one directory per runtime defect the matrix found, for a bug report.

Each bundle under docs/upstream/<runtime>-<short-name>/ is built from a minimal program (a few-op
module that reproduces the defect, written after the Kokoro source line where the matrix met it)
and holds `program.pt2` (torch.export), `inputs.pt`, the float64 `expected.pt`, `repro.py`,
`ENV.md` and `REPORT.md` (written as the runtime's issue template asks). `repro.py` imports only
torch, numpy and the runtime's own package, and exits

- 1 while the defect reproduces (the converter's error carries the defect's signature; the op
  stays outside the delegate; float16 turns the output non-finite),
- 0 once it is fixed (converts and, where it can run here, matches the float64 expected output),
- 2 when it cannot run here (the runtime's package is not installed),
- 3 when it fails differently (the signature is gone but something else breaks: read it).

`kokoro-parity upstream` (`make upstream`) regenerates every bundle, runs each repro.py in a fresh
interpreter that cannot import kokoro or this harness, rewrites docs/upstream/README.md with the
status on the installed versions (`--only NAME`: that defect's row, dated; the other rows kept),
and fails when a defect does not reproduce. `check_bundles`
(the nightly re-check) only runs the existing bundles' repro.py.
"""
from __future__ import annotations

import copy
import importlib.metadata as md
import importlib.util
import inspect
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .plumbing.files import atomic_write_text
from .repro import _cpu

REPRODUCED, FIXED, CANNOT_RUN, CHANGED = 1, 0, 2, 3
STATUS = {REPRODUCED: "reproduces", FIXED: "fixed", CANNOT_RUN: "cannot run here", CHANGED: "changed"}
BLOCKED = ("kokoro", "harness", "misaki")  # what a bundle must run without
SEARCHED = "2026-11-23"  # when the trackers were searched for known reports (GitHub issues and pull requests)
# the checks below run inside repro.py, which defines these two for them
SIGNATURE = ""
HERE = Path(".")


def default_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "docs" / "upstream"


# ---- the minimal programs ---------------------------------------------------------------------
# Each stands for one spot of Kokoro (or of the ALBERT it runs) where the matrix met the defect.
# Pasted into repro.py with inspect.getsource: a method imports what it needs (torch's scan) itself.

class AlbertPositions(nn.Module):
    """ALBERT's embeddings: `self.position_ids[:, :seq_length]` with seq_length the whole table."""

    def __init__(self, positions: int = 16, dim: int = 8):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(positions).expand((1, -1)), persistent=False)
        self.word = nn.Embedding(32, dim)
        self.position = nn.Embedding(positions, dim)

    def forward(self, input_ids):
        position_ids = self.position_ids[:, :input_ids.shape[1]]  # the whole table: an identity aten.alias
        return self.word(input_ids) + self.position(position_ids)


class MaskAnd(nn.Module):
    """Two boolean masks joined with `&` (aten.__and__): CustomSTFT's phase correction mask."""

    def forward(self, real, imag):
        correction_mask = (imag == 0) & (real < 0)
        return torch.where(correction_mask, torch.full_like(real, torch.pi), torch.atan2(imag, real))


class NewOnes(nn.Module):
    """`x.new_ones(shape)` (transformers' mask construction for ALBERT)."""

    def forward(self, x):
        return x * x.new_ones(x.shape)


class RsqrtIntConstant(nn.Module):
    """AdainResBlk1d's `(out + shortcut) * torch.rsqrt(torch.tensor(2))`: rsqrt of an int64 constant."""

    def forward(self, out, shortcut):
        return (out + shortcut) * torch.rsqrt(torch.tensor(2))


class BiLSTM(nn.Module):
    """Kokoro's LSTMs: one layer, bidirectional, batch first (here 8 -> 2 x 4 features)."""

    def __init__(self, features: int = 8, hidden: int = 4):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, 1, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.lstm(x)[0]


class ScanLSTMCell(nn.Module):
    """Kokoro's LSTM cell as the body of torch's `scan` over the time steps, as kokoro-parity's
    LengthAwareLSTM(impl="scan") writes it: per step x_t W_ih^T + h W_hh^T, the four gates, and the
    state frozen after the sequence's length (m = 1 at a valid step, keep = 1 - m). 8 -> 4 features,
    time major: x [T, B, 8], valid [T, B, 1]."""

    def __init__(self, features: int = 8, hidden: int = 4):
        super().__init__()
        self.ih = nn.Linear(features, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden)
        self.hidden = hidden

    def forward(self, x, valid):
        from torch._higher_order_ops.scan import scan

        H = self.hidden

        def step(carry, inputs):
            h, c = carry
            x_t, m, keep = inputs
            g = self.ih(x_t) + self.hh(h)
            i, f, gg, o = (g[:, k * H:(k + 1) * H] for k in range(4))
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            return (h_new * m + h * keep, c_new * m + c * keep), h_new * m

        zeros = x.new_zeros(x.shape[1], H)
        (h, c), ys = scan(step, (zeros.clone(), zeros.clone()), (x, valid, 1 - valid))
        return ys


def _steps_and_mask(steps: int = 6, length: int = 5):
    """x [T, 1, 8] and the valid-step mask [T, 1, 1] of one sequence of `length` steps."""
    valid = (torch.arange(steps) < length).float().reshape(steps, 1, 1)
    return torch.randn(steps, 1, 8, generator=_gen()), valid


class LinearDownsample(nn.Module):
    """SineGen's `F.interpolate(rad_values.transpose(1, 2), scale_factor=1/upsample_scale, mode="linear")`;
    torch's decomposition clamps int64 indices with one bound: `(i + 1).clamp(max=n - 1)`."""

    def forward(self, rad_values):
        return F.interpolate(rad_values, scale_factor=1 / 4, mode="linear")


class MaskedPhase(nn.Module):
    """CustomSTFT.transform's phase correction: `phase[mask] = pi`, a boolean-mask index_put."""

    def forward(self, real, imag):
        phase = torch.atan2(imag, real)
        correction_mask = (imag == 0) & (real < 0)
        phase[correction_mask] = torch.pi
        return phase


class ConvInstanceNorm(nn.Module):
    """A convolution then AdaIN1d's `nn.InstanceNorm1d(num_features, affine=True)`."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=1)
        self.norm = nn.InstanceNorm1d(channels, affine=True)

    def forward(self, x):
        return self.norm(self.conv(x))


class SinePhase(nn.Module):
    """SineGen._f02sine (flag_for_pulse False, no initial phase noise) on the 9th harmonic: the
    phase is a running sum over the whole utterance, times 2 pi, times the upsample scale."""

    sampling_rate, upsample_scale = 24000, 300

    def forward(self, f0_values):
        rad_values = (f0_values / self.sampling_rate) % 1
        rad_values = F.interpolate(rad_values.transpose(1, 2), scale_factor=1 / self.upsample_scale,
                                   mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale,
                              mode="linear").transpose(1, 2)
        return torch.sin(phase)


class BroadcastMul(nn.Module):
    """SineGen's harmonics: a [1, N, 1] phase times the [1, 1, 9] harmonic numbers."""

    def forward(self, phase, harmonics):
        return phase * harmonics


class PhaseCumsum(nn.Module):
    """SineGen's phase: the running sum of the per-frame phase increments of 9 harmonics."""

    def forward(self, rad_values):
        return torch.cumsum(rad_values, dim=1)

class InstanceNorm(nn.Module):
    """AdaIN1d's normalization: `nn.InstanceNorm1d(channels, affine=True)` at its initial affine."""

    def __init__(self, channels: int = 1):
        super().__init__()
        self.norm = nn.InstanceNorm1d(channels, affine=True)

    def forward(self, x):
        return self.norm(x)


def _long_channel():
    """One channel of 4,096 samples, mean 100, std 0.01 (its float32 one-pass variance: -0.03)."""
    return (100 + 0.01 * torch.randn(1, 1, 4096, generator=_gen()),)


def _transposed_phase():
    """The [1, N, 1] operand as SineGen's graph hands it over: a transposed view, strides (N, 1, N)."""
    phase = torch.randn(1, 1, 2000, generator=_gen()).transpose(1, 2)
    return phase, torch.arange(1, 10, dtype=torch.float32).reshape(1, 1, 9)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _phase_increments(frames: int = 290):
    """(f0 x harmonic / 24 kHz) % 1 at frame rate, f0 120-250 Hz: en_short's 290 frames x 9 harmonics."""
    f0 = 120 + 130 * torch.rand(1, frames, 1, generator=_gen())
    return (((f0 * torch.arange(1, 10).reshape(1, 1, 9)) / 24000) % 1,)

def _stft_like():
    g = _gen()
    real, imag = torch.randn(1, 5, 12, generator=g), torch.randn(1, 5, 12, generator=g)
    imag[0, :, ::3] = 0  # zero imaginary parts with a negative real part: the corrected bins
    real[0, :, ::3] = -real[0, :, ::3].abs()
    return real, imag


# ---- the checks inlined into repro.py --------------------------------------------------------
# Each `check(program, inputs, expected) -> (exit code, message)` imports only its runtime inside.
# Their imports stay in their bodies: inspect.getsource pastes them into a standalone repro.py, and
# the runtimes are optional.

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


# ---- the defects ------------------------------------------------------------------------------

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


@dataclass(frozen=True)
class Defect:
    name: str  # the bundle's directory: <runtime>-<short-name>
    title: str
    runtime: str  # the distribution whose defect it is (its version goes in ENV.md)
    module: str  # the import name repro.py needs
    kind: str  # convert | delegation | numerics | run | scaling
    signature: str  # the text (error message, op name) that is this defect
    program: Callable[[], tuple[nn.Module, tuple]]
    check: Callable
    source: tuple[str, str]  # (file under site-packages, text on the line) where Kokoro meets it
    op: str  # the op in question
    workaround: str  # the harness's workaround that hides it (harness.backends.Workaround names)
    tracker: str  # where to report
    known: tuple[tuple[str, str], ...] = ()  # (link, what it is) found by searching the tracker
    helpers: tuple[Callable, ...] = field(default=(classify, values_match))
    onnx: bool = False  # the bundle also carries model.onnx
    expected: str = ""  # what a fixed runtime does, where the kind's usual sentence does not say it
    detail: str = ""  # what kokoro-parity measured of it (a paragraph at the end of REPORT.md)
    searched: str = SEARCHED  # when `known` was searched


_CT, _TVM, _ET = "apple/coremltools", "apache/tvm", "pytorch/executorch"
DEFECTS = [
    Defect("coremltools-alias", "coremltools: aten.alias has no MIL lowering", "coremltools", "coremltools", "convert",
           "Unsupported fx node alias", lambda: (AlbertPositions(), (torch.randint(0, 32, (1, 16), generator=_gen()),)),
           check_coreml, ("transformers/models/albert/modeling_albert.py", "position_ids = self.position_ids[:, :seq_length]"),
           "aten.alias.default", "coreml-fp32/coreml-fp16: alias_drop", _CT,
           (("https://github.com/apple/coremltools/issues/2517", "open: 'aten.alias.default operation is not "
             "supported by Coremltools converter' (feature request, 2025-05)"),)),
    Defect("coremltools-and", "coremltools: aten.__and__ has no MIL lowering (bitwise_and has)", "coremltools",
           "coremltools", "convert", "Unsupported fx node", lambda: (MaskAnd(), _stft_like()), check_coreml,
           ("kokoro/custom_stft.py", "correction_mask = (imag_out == 0) & (real_out < 0)"), "aten.__and__.Tensor",
           "coreml-*: and_rename (ALBERT's mask), stft_phase_where (CustomSTFT)", _CT,
           (("https://github.com/apple/coremltools/pull/2816", "related, merged 2026-08: registers the in-place "
             "__iand__/__ior__/__ixor__ as bitwise ops (not __and__)"),
            ("https://github.com/apple/coremltools/pull/2668", "related, merged 2026-04: mask-construction ops "
             "(bitwise_or, new_ones, ...)"))),
    Defect("coremltools-new-ones", "coremltools: aten.new_ones has no MIL lowering", "coremltools", "coremltools",
           "convert", "Unsupported fx node new_ones", lambda: (NewOnes(), (torch.randn(2, 6, generator=_gen()),)),
           check_coreml, ("transformers/masking_utils.py", "new_ones("), "aten.new_ones.default",
           "coreml-*: decompose_unlowered", _CT,
           (("https://github.com/apple/coremltools/pull/2668", "merged 2026-04: adds new_ones among the "
             "attention-mask ops; not in the installed release"),)),
    Defect("coremltools-rsqrt-int", "coremltools: rsqrt of an int constant is not promoted to float", "coremltools",
           "coremltools", "convert", "expects tensor or scalar of dtype from type domain",
           lambda: (RsqrtIntConstant(), (torch.randn(1, 4, 6, generator=_gen()), torch.randn(1, 4, 6, generator=_gen(1)))),
           check_coreml, ("kokoro/istftnet.py", "torch.rsqrt(torch.tensor(2))"), "aten.rsqrt.default",
           "coreml-*: rsqrt_float_const (patch)", _CT,
           (("https://github.com/apple/coremltools/issues/2156", "same class, open: inverse of int32 "
             "'expects ... fp16, fp32 but got tensor[1,int32]'"),
            ("https://github.com/apple/coremltools/pull/2683", "same class, merged 2026-05: casts int input of "
             "reciprocal to fp32 (not rsqrt)"))),
    Defect("coremltools-lstm", "coremltools: aten.lstm.input (torch.export) has no MIL lowering", "coremltools",
           "coremltools", "convert", "Unsupported fx node lstm",
           lambda: (BiLSTM(), (torch.randn(1, 6, 8, generator=_gen()),)), check_coreml,
           ("kokoro/modules.py", "nn.LSTM("), "aten.lstm.input", "coreml-*: lstm_converter", _CT,
           (("https://github.com/pytorch/executorch/issues/4090", "related, closed: 'coreml backend doesn't work "
             "with lstm' (ExecuTorch's Core ML delegate)"),)),
    Defect("tvm-clamp-int", "TVM Relax: int64 clamp with one bound fails to build ('Cannot convert infinity to "
           "BigInt')", "apache-tvm", "tvm", "convert", "Cannot convert infinity to BigInt",
           lambda: (LinearDownsample(), (torch.rand(1, 9, 40, generator=_gen()),)), check_tvm,
           ("kokoro/istftnet.py", "rad_values = F.interpolate("), "aten.clamp.default (int64, max only)",
           "tvm: clamp_int_bound", _TVM),
    Defect("tvm-index-put-bool", "TVM Relax: boolean-mask index_put is rejected", "apache-tvm", "tvm", "convert",
           "IndexPut requires each index tensor to have integer dtype", lambda: (MaskedPhase(), _stft_like()),
           check_tvm, ("kokoro/custom_stft.py", "phase[correction_mask] = torch.pi"), "aten.index_put_.default",
           "tvm: stft_phase_where (patch)", _TVM,
           (("https://github.com/apache/tvm/issues/12292", "related, closed: boolean-mask indexing in the "
             "Relay PyTorch frontend (fixed there by apache/tvm#13306), not Relax's index_put"),)),
    Defect("tvm-instancenorm-variance", "TVM Relax: InstanceNorm returns NaN on a long channel (one-pass float32 "
           "variance)", "apache-tvm", "tvm", "numerics", "NaN",
           lambda: (InstanceNorm(), _long_channel()), check_tvm_instance_norm,
           ("kokoro/istftnet.py", "self.norm = nn.InstanceNorm1d(num_features, affine=True)"),
           "relax.nn.instance_norm (topi.nn.instance_norm)", "tvm: instance_norm_float64_stats (patch)",
           _TVM,
           (("https://github.com/apache/tvm/pull/14410", "the origin, merged 2023: TOPI instance_norm computes mean "
             "and variance in one pass, delegated to layer norm's tuple reduction"),
            ("https://github.com/apache/tvm/issues/19592", "related, closed 2026-05: LayerNormalization NaN on large "
             "float32 inputs; fixed for layer_norm's legalization by apache/tvm#19643 (two-pass), not for "
             "instance_norm in the 0.27.0.post1 wheel"))),
    Defect("tvm-onnx-lstm", "TVM Relax ONNX frontend: no LSTM converter", "apache-tvm", "tvm", "convert",
           "not supported for frontend ONNX: LSTM", lambda: (BiLSTM(), (torch.randn(1, 6, 8, generator=_gen()),)),
           check_tvm_onnx, ("kokoro/modules.py", "nn.LSTM("), "ONNX LSTM", "tvm-onnx: unrolled_lstm (patch)", _TVM,
           (("https://github.com/apache/tvm/issues/20124", "open RFC (2026-08): 'Expanding ONNX operator "
             "coverage in the Relax frontend' lists RNN, GRU, LSTM as missing"),
            ("https://github.com/apache/tvm/issues/3544", "closed (2019): the same for the old Relay frontend")),
           onnx=True),
    Defect("tvm-lstm-written-out", "TVM Relax: from_exported_program writes aten.lstm out one cell per time step "
           "(the IRModule grows with T, the compile's peak memory with its square)", "apache-tvm", "tvm", "scaling",
           "bindings per time step", lambda: (BiLSTM(), (torch.randn(1, 8, 8, generator=_gen()),)),
           check_tvm_lstm_steps, ("kokoro/modules.py", "nn.LSTM("),
           "aten.lstm.input (Relax's `_lstm`, `_lstm_cell_unroll`)",
           "none on tvm (a scaling defect): the `tvm` backend declares its compile-memory law "
           "(`TvmBackend.compile_memory`, harness/backends/tvm.py) and skips en_long's static f0n (1,536 steps, "
           "19.6 GB estimated) before compiling", _TVM,
           (("https://github.com/apache/tvm/pull/18346", "the origin, merged 2025-09: '[Relax][PyTorch] Support "
             "lstm op for ExportedProgram importer', the cell emitted once per time step"),
            ("https://github.com/apache/tvm/issues/18340", "closed: the feature request that PR answered "
             "('Unsupported function types [lstm.input]')"),
            ("https://github.com/apache/tvm/pull/11531", "related, merged 2022: a TOPI LSTM over `te.scan` (a "
             "sequential loop, symbolic length) for Relay, not used by the Relax frontend")),
           helpers=(values_match,),
           expected="the imported `main` stays the same size whatever T (the recurrence as one loop, as the "
                    "exported graph keeps it: one `aten.lstm.input` node at any T), so that compile time and memory "
                    "do not grow with the sequence",
           detail="Measured in kokoro-parity (docs/findings.md, finding 13; docs/performance.md, \"LSTM cost "
                  "against T\"): a bidirectional LSTM of Kokoro's shape (640 -> 2 x 256) imported this way compiles "
                  "(relax.build, llvm) with a peak memory growing with the square of T: 0.75 GB at 64 steps, 1.0 at "
                  "128, 1.6 at 256, 3.5 at 512, and Kokoro's F0/N predictor at 1,078 frames 10.7 GB; at 1,536 frames "
                  "the compile was killed by the OOM killer at 22.2 GB (24 GB machine). With the default 8 MB C "
                  "stack the compile already died with SIGSEGV at 1,078 frames (recursive passes over the written-out "
                  "graph). The same LSTM as one loop (ExecuTorch's `scan`) lowers in 0.6 GB at any T.",
           searched="2026-11-25"),
    Defect("executorch-xnnpack-instancenorm", "ExecuTorch XNNPACK: InstanceNorm stays outside the delegate",
           "executorch", "executorch", "delegation", "_native_batch_norm_legit_no_stats",
           lambda: (ConvInstanceNorm(), (torch.randn(1, 8, 32, generator=_gen()),)), check_xnnpack_outside,
           ("kokoro/istftnet.py", "self.norm = nn.InstanceNorm1d(num_features, affine=True)"),
           "aten._native_batch_norm_legit_no_stats.default", "none (a performance defect: the op runs on portable "
           "kernels)", _ET,
           (("https://github.com/pytorch/executorch/pull/1501", "related, closed (2024): XNNPACK partitions batch "
             "norm only when it fuses with a convolution"),)),
    Defect("executorch-xnnpack-lstm-cut", "ExecuTorch XNNPACK: a decomposed aten.lstm is cut into a delegate "
           "subgraph per time step", "executorch", "executorch", "delegation", "lstm",
           lambda: (BiLSTM(), (torch.randn(1, 6, 8, generator=_gen()),)), check_xnnpack_cut,
           ("kokoro/modules.py", "nn.LSTM("), "aten.lstm.input", "xnnpack: unrolled_lstm (patch; performance)", _ET,
           (("https://github.com/pytorch/executorch/pull/17140", "related, merged 2026-02: a DecomposeLstmPass "
             "with 2 matmuls per step, for the Arm backend only"),)),
    Defect("executorch-xnnpack-scan-body", "ExecuTorch XNNPACK: XnnpackPartitioner leaves the body of a scan (a loop "
           "such as an LSTM cell) to portable kernels", "executorch", "executorch", "delegation", "scan",
           lambda: (ScanLSTMCell(), _steps_and_mask()), check_xnnpack_scan_body, ("kokoro/modules.py", "nn.LSTM("),
           "torch.ops.higher_order.scan (kokoro-parity's LengthAwareLSTM(impl=\"scan\") writes each nn.LSTM's cell as "
           "its body)", "xnnpack: control_flow_partitioner (in compile; performance)", _ET,
           (("https://github.com/pytorch/executorch/pull/15364", "related, merged 2025-10: the Arm backend's "
             "partitioner tags control-flow submodules (applies its partition logic to them); XNNPACK's does not"),
            ("https://github.com/pytorch/executorch/pull/7525", "related, closed unmerged (2025-01): a draft "
             "'Recurse partitioner through submodules'"),
            ("https://github.com/pytorch/executorch/issues/8769", "related, open: 'Support higher-order while_loop "
             "and scan torch ops' (the emitter runs scan; while_loop is rejected)")),
           helpers=(values_match,),
           expected="the scan body's ops that XNNPACK takes at the top level (slice, sigmoid, tanh, mul, add) "
                    "run inside an XNNPACK delegate, one delegate call per step: `to_backend` lowers what a "
                    "partitioner tags inside control-flow submodules, and the emitter runs that delegate inside "
                    "its scan loop",
           detail="Measured in kokoro-parity (docs/performance.md, \"LSTM cost against T\"): on Kokoro's F0/N "
                  "predictor (en_short, 256 frames) the stock partitioner leaves the scan body's 22 nodes (bmm, "
                  "sigmoid, tanh, mul, add, slice) to portable kernels; a partitioner that also tags the bodies with "
                  "XNNPACK's own op configs (kokoro-parity's harness/backends/control_flow.py, "
                  "`XnnpackControlFlowPartitioner`) puts them in one delegate "
                  "call per step, and the loop takes half the time (ETDump: 42.7 against 83.9 ms); a bare "
                  "bidirectional LSTM of 1,536 steps runs in 0.88 s against 1.57 s.",
           searched="2026-11-25"),
    Defect("executorch-dim-order-size1", "ExecuTorch: a program exported from a [1, N, 1] transposed view cannot "
           "run (non-standard dim order of a size-1 axis)", "executorch", "executorch", "run",
           "execute() failed", lambda: (BroadcastMul(), _transposed_phase()), check_executorch_dim_order,
           ("kokoro/istftnet.py", "fn = torch.multiply(f0, torch.FloatTensor([[range(1, self.harmonic_num + 2)]]).to(f0.device))"),
           "aten.mul.Tensor", "the harness exports probes from canonical strides (harness.plumbing.files.canonical)",
           _ET,
           (("https://github.com/pytorch/executorch/pull/22745", "related, open (2026-09): dim_order derived from "
             "strides with size-1 dims, for channels-last tensors (fixes #22520)"),
            ("https://github.com/pytorch/executorch/issues/9930", "related, open: 'different dim orders' at run "
             "time after .contiguous()"))),
    Defect("executorch-cumsum-float32", "ExecuTorch: float cumsum accumulates in float32, several times PyTorch's "
           "error (SineGen's phase)", "executorch", "executorch", "numerics", "cumsum",
           lambda: (PhaseCumsum(), _phase_increments()), check_executorch_cumsum,
           ("kokoro/istftnet.py", "phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi"), "aten.cumsum.default",
           "none (harmless on short inputs; grows with the length: keep the phase in float64 or wrap it)", _ET),
    Defect("executorch-instancenorm-variance", "ExecuTorch: InstanceNorm returns NaN on a long channel (one-pass "
           "float32 variance)", "executorch", "executorch", "numerics", "NaN",
           lambda: (InstanceNorm(), _long_channel()), check_executorch_instance_norm,
           ("kokoro/istftnet.py", "self.norm = nn.InstanceNorm1d(num_features, affine=True)"),
           "aten._native_batch_norm_legit.no_stats", "xnnpack, portable: instance_norm_float64_stats (patch)", _ET,
           (("https://github.com/pytorch/executorch/blob/main/kernels/portable/cpu/op_native_batch_norm.cpp",
             "the kernel (main, 2026-08): per-channel sums of x and x*x in float (vec_ops.h: reduce_add, "
             "vec_powerf), then var = E[x^2] - E[x]^2 and 1/sqrt(var + eps)"),)),
    Defect("torch-fp16-sinegen-phase", "Kokoro's SineGen phase overflows float16 on utterances over ~6 s",
           "torch", "torch", "numerics", "non-finite",
           lambda: (SinePhase(), (torch.full((1, 24000 * 7, 1), 9 * 200.0),)), check_float16,
           ("kokoro/istftnet.py", "phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi"), "aten.cumsum.default",
           "none: float16 deployments must keep SineGen in float32", "hexgrad/kokoro",
           (("https://github.com/hexgrad/kokoro/pull/353", "open PR (2026-07): an opt-in exact integer-phase "
             "harmonic source, 'fp16-safe'"),)),
]
BY_NAME = {d.name: d for d in DEFECTS}


# ---- writing a bundle -------------------------------------------------------------------------

_REPRO = '''#!/usr/bin/env python3
"""Repro: @TITLE@

Minimal program: program.pt2 (torch.export of the module in REPORT.md), inputs.pt, and the float64
result of the same program, expected.pt. Needs only torch, numpy and @RUNTIME@ (versions in ENV.md).

Exit code: 1 while the defect reproduces, 0 once it is fixed, 2 when it cannot run here (the
runtime is not installed), 3 when it fails differently (read the output).
"""
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
SIGNATURE = @SIGNATURE@  # the text that is this defect


@HELPERS@
def main():
    try:
        import @MODULE@  # noqa: F401
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
'''


def repro_source(d: Defect) -> str:
    helpers = "".join(inspect.getsource(f) + "\n\n" for f in d.helpers)
    if d.check in (check_tvm, check_tvm_onnx, check_tvm_instance_norm, check_tvm_lstm_steps):
        helpers += inspect.getsource(_tvm_run) + "\n\n"
    if d.check in (check_xnnpack_outside, check_xnnpack_cut):
        helpers += inspect.getsource(_xnnpack_lower) + "\n\n"
    if d.check in (check_executorch_instance_norm, check_tvm_instance_norm):
        helpers += inspect.getsource(one_pass_variance_verdict) + "\n\n"
    helpers += inspect.getsource(d.check).replace(f"def {d.check.__name__}(", "def check(", 1) + "\n"
    return (_REPRO.replace("@TITLE@", d.title).replace("@RUNTIME@", d.runtime).replace("@MODULE@", d.module)
            .replace("@SIGNATURE@", repr(d.signature)).replace("@HELPERS@", helpers))


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def kokoro_line(d: Defect) -> str:
    """`file:line: code` of the Kokoro (or transformers) line the program stands for, found in
    the installed sources (not imported)."""
    rel, text = d.source
    spec = importlib.util.find_spec(rel.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return f"{rel}: `{text}` (package not installed here)"
    path = Path(next(iter(spec.submodule_search_locations))).parent / rel
    try:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if text in line:
                return f"{rel}:{i}: `{line.strip()}` ({rel.split('/')[0]} {_version(rel.split('/')[0])})"
    except OSError:
        pass
    return f"{rel}: `{text}`"


def build_bundle(d: Defect, out: Path) -> Path:
    """Write program.pt2, inputs.pt, expected.pt (float64), repro.py and ENV.md (and model.onnx)."""
    bundle = out / d.name
    if bundle.exists():
        shutil.rmtree(bundle)
    bundle.mkdir(parents=True)
    torch.manual_seed(0)
    module, inputs = d.program()
    module.eval()
    with torch.no_grad():
        program = torch.export.export(module, tuple(t.clone() for t in inputs))
        expected = copy.deepcopy(module).double()(*[t.double() if t.is_floating_point() else t.clone() for t in inputs])
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    torch.export.save(program, str(bundle / "program.pt2"))
    torch.save(list(inputs), bundle / "inputs.pt")
    torch.save({"float64": [e.detach() for e in expected]}, bundle / "expected.pt")
    if d.onnx:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=True, verbose=False).save(
                str(bundle / "model.onnx"), external_data=False)
    atomic_write_text(bundle / "repro.py", repro_source(d))
    atomic_write_text(bundle / "ENV.md", _env_md(d))
    return bundle


def _env_md(d: Defect) -> str:
    rows = [("Python", platform.python_version()), ("OS", platform.platform()),
            ("CPU", f"{_cpu()} ({os.cpu_count()} logical cores)"), ("torch", _version("torch")),
            ("numpy", _version("numpy"))]
    if d.runtime not in ("torch", "numpy"):
        rows.append((d.runtime, _version(d.runtime)))
    if d.onnx:
        rows += [("onnx", _version("onnx")), ("onnxscript", _version("onnxscript"))]
    return "# Environment\n\n| what | version |\n| --- | --- |\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


# ---- running a bundle alone -------------------------------------------------------------------

_ISOLATED = """
import runpy, sys
BLOCKED = {blocked!r}
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: the repro must run without it")
        return None
sys.meta_path.insert(0, _Block())
sys.argv = ["repro.py"]
code = 0
try:
    runpy.run_path("repro.py", run_name="__main__")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 3)
except BaseException:
    import traceback
    traceback.print_exc()
    code = 3
print("LOADED", sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED)))
sys.exit(code)
"""


def run_isolated(bundle: Path, timeout: float = 900) -> dict:
    """Run `bundle/repro.py` in a fresh interpreter (-I: no PYTHONPATH, no user site) in its own
    directory, with kokoro and this harness made unimportable. Exit codes as repro.py's."""
    start = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-I", "-c", _ISOLATED.format(blocked=BLOCKED)], cwd=bundle,
                           capture_output=True, text=True, timeout=timeout,
                           env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")})
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        code, text = None, f"no result after {timeout:.0f} s"
    site = str(Path(torch.__file__).resolve().parent.parent) + os.sep  # .../site-packages/: not the reader's
    lines = [ln.replace(site, "site-packages/") for ln in text.splitlines() if ln.strip() and not _noise(ln)]
    message = next((ln for ln in reversed(lines) if ln.startswith(("REPRODUCED", "FIXED", "CHANGED",
                                                                  "cannot run here"))), lines[-1] if lines else "")
    return {"exit_code": code, "status": STATUS.get(code, "error"), "seconds": round(time.monotonic() - start, 1),
            "message": message, "output": "\n".join(lines[-40:])}


def _noise(line: str) -> bool:
    """Progress bars and import chatter of the runtimes, left out of reports."""
    return any(s in line for s in ("it/s]", "ops/s]", "passes/s]", "Failed to load _ML", "torchao", "_pytree.py",
                                   "[torch.onnx]", "return cls.__new__", "Warning", "warnings.warn"))


# ---- REPORT.md ----------------------------------------------------------------------------------

def _minimal_code(d: Defect) -> str:
    module, inputs = d.program()
    cls = type(module)
    shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)
    return (f"```python\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
            f"{inspect.getsource(cls).rstrip()}\n\n\n"
            f"# inputs: {shapes} (inputs.pt)\nprogram = torch.export.export({cls.__name__}().eval(), inputs)\n```\n"
            f"then, as `repro.py` does:\n```python\n{textwrap.dedent(inspect.getsource(d.check)).rstrip()}\n```\n")


def report_md(d: Defect, result: dict) -> str:
    source = kokoro_line(d)
    env = _env_md(d).split("\n", 2)[2]
    runtime = f"{d.runtime} {_version(d.runtime)}"
    status = STATUS.get(result["exit_code"], "error")
    expected = {"convert": "the program converts (and, where it can run, matches `expected.pt`, the float64 "
                           "result of the same program, within 4 x PyTorch float32's own error)",
                "delegation": "the op runs inside the XNNPACK delegate, in a few delegate subgraphs",
                "numerics": ("the float16 output stays finite and close to the float64 one" if d.runtime == "torch" else
                             "the output is within 4 x PyTorch float32's own error of `expected.pt` (float64)"),
                "run": "the program runs on the given (standard-strided) inputs and matches `expected.pt` within 4 x "
                       "PyTorch float32's own error",
                "scaling": "the converted program stays the same size whatever the input's length"}[d.kind]
    expected = d.expected or expected
    known = "".join(f"- {link}: {what}\n" for link, what in d.known) or "- none found\n"
    code = _minimal_code(d)
    output = "\n".join(ln for ln in result["output"].splitlines() if not ln.startswith("LOADED "))
    actual = f"```\n{output}\n```"
    how = {"delegation": "The program's values are right: this is a performance defect (what stays outside the "
                         "delegate runs on portable kernels; each delegate cut costs a call).",
           "run": "The lowered program does not run on standard-strided inputs.",
           "numerics": "The program runs, but its values are further from float64 than PyTorch float32's "
                       "(`repro.py` lowers without a partitioner: XNNPACK leaves this op to the portable kernels too)."}.get(d.kind, "")
    common = dict(title=d.title, runtime=runtime, env=env, code=code, actual=actual, source=source, op=d.op, how=how,
                  expected=expected, known=known, status=status, message=result["message"], name=d.name,
                  workaround=d.workaround, searched=d.searched, exit_code=result["exit_code"],
                  detail="\n" + textwrap.fill(d.detail, 110) + "\n" if d.detail else "")
    template = {"coremltools": _COREML_REPORT, "apache-tvm": _TVM_REPORT, "executorch": _ET_REPORT}.get(d.runtime,
                                                                                                       _TORCH_REPORT)
    return template.format(**common) + _FOOTER.format(**common)


_COREML_REPORT = """# {title}

## 🐞Describing the bug
{message}

Converting a torch.export program that contains `{op}` fails on {runtime}. The program is a few ops long; it
stands for {source}, where kokoro-parity met it while converting Kokoro-82M.

## Stack Trace
{actual}

## To Reproduce
{code}
Or: `python repro.py` in this directory (exit code 1 while it reproduces, 0 once fixed).

**Expected:** {expected}.

## System environment (please complete the following information):
{env}
## Additional context
- Status on the versions above: **{status}** (`repro.py` exit code {exit_code}).
"""

_TVM_REPORT = """# {title}

{message}

### Expected behavior
{expected}.

### Actual behavior
{actual}

### Environment
{env}
### Steps to reproduce
{code}
Or: `python repro.py` in this directory (exit code 1 while it reproduces, 0 once fixed). The program stands
for {source}, where kokoro-parity met it converting Kokoro-82M; the op is `{op}`.

### Triage
* needs-triage
* relax:frontend

Status on the versions above: **{status}** (`repro.py` exit code {exit_code}).
"""

_ET_REPORT = """# {title}

### 🐛 Describe the bug
{message}

Lowering with `to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])`; the op is
`{op}`, met at {source} while lowering Kokoro-82M. {how}

**Expected:** {expected}.

**Actual:**
{actual}

Minimal code:
{code}
Or: `python repro.py` in this directory (exit code 1 while it reproduces, 0 once fixed).

### Versions
{env}
Status on the versions above: **{status}** (`repro.py` exit code {exit_code}).
"""

_TORCH_REPORT = """# {title}

**Summary.** {message}

This is a numerics finding about Kokoro's vocoder, not a defect of PyTorch: SineGen's harmonic phase is a
running sum over the whole utterance (`{op}`, {source}); on the 9th harmonic of a 200 Hz voice it passes
float16's 65,504 after about 5.8 s, and `sin` of an infinite phase is NaN. Any float16 deployment (Core ML's
GPU / Neural Engine, `coreml-fp16`) inherits it; the program here runs it in PyTorch float16 on CPU.

**Expected:** {expected}.

**Actual:**
{actual}

## Minimal code
{code}
Or: `python repro.py` in this directory (exit code 1 while it reproduces, 0 once fixed).

## Versions
{env}
Status on the versions above: **{status}** (`repro.py` exit code {exit_code}).
"""

_FOOTER = """
## Known reports
Searched on {searched} (GitHub issues and pull requests):
{known}
## Where this comes from
Written by `kokoro-parity upstream` (harness/upstream.py) from a minimal program that reproduces what
the kokoro-parity matrix met on Kokoro-82M at {source}. In kokoro-parity the defect is hidden by the
workaround {workaround}; `--no-workaround NAME` shows it as an item verdict (docs/workarounds.md).
Files: `repro.py` (torch, numpy and the runtime only), `program.pt2`, `inputs.pt`, `expected.pt` (float64),
`ENV.md`.
{detail}"""


# ---- the list -------------------------------------------------------------------------------------

def readme_md(rows: list[tuple[Defect, dict]]) -> str:
    lines = ["# Upstream repro bundles", "",
             "One directory per runtime defect the kokoro-parity matrix found. Each holds a standalone "
             "`repro.py` (torch, numpy and the runtime's package only; no Kokoro, no kokoro-parity), the "
             "minimal program (`program.pt2`), `inputs.pt`, the float64 `expected.pt`, `ENV.md` and a "
             "`REPORT.md` written as the runtime's issue template asks. `repro.py` exits 1 while the defect "
             "reproduces, 0 once fixed, 2 when it cannot run here, 3 when it fails differently.", "",
             "Regenerate and re-check all (each repro runs in a fresh interpreter that cannot import kokoro or "
             "the harness; a defect that no longer reproduces fails the command): `make upstream` "
             "(`kokoro-parity upstream`). Re-check only: `kokoro-parity upstream --check`; the nightly run does "
             "that too and the dashboard shows each status.", "",
             f"Status below: the repro run on this machine, {time.strftime('%Y-%m-%d')}. Known reports: a "
             f"search of the runtime's tracker on {SEARCHED}.", "",
             "| bundle | defect | runtime | status now | hidden in kokoro-parity by | known report |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [readme_row(d, r) for d, r in rows]
    return "\n".join(lines) + "\n"


def readme_row(d: Defect, r: dict, day: str = "") -> str:
    """The defect's row of docs/upstream/README.md (`day`: the date of a run apart from the others)."""
    known = "; ".join(f"[{link.split('github.com/')[-1].replace('/issues/', '#').replace('/pull/', '#')}]"
                      f"({link}) ({what.split(':')[0].split(',')[0]})" for link, what in d.known) or "none found"
    when = f"; {day}" if day else ""
    return (f"| [{d.name}]({d.name}/) | {d.title} | {d.runtime} {_version(d.runtime)} | "
            f"**{r['status']}** (exit {r['exit_code']}, {r['seconds']:.0f} s{when}) | {d.workaround} | {known} |")


def update_readme_rows(text: str, rows: list[tuple[Defect, dict]]) -> str:
    """docs/upstream/README.md with these defects' rows rewritten (dated: a run of some bundles only),
    a new defect's row placed after the row of the defect before it in DEFECTS; the other rows kept."""
    lines = text.rstrip("\n").split("\n")

    def at(name):
        return next((i for i, ln in enumerate(lines) if ln.startswith(f"| [{name}]({name}/) |")), None)

    for d, r in rows:
        row = readme_row(d, r, time.strftime("%Y-%m-%d"))
        i = at(d.name)
        if i is not None:
            lines[i] = row
            continue
        before = [j for j in (at(e.name) for e in DEFECTS[:DEFECTS.index(d)]) if j is not None]
        table = [j for j, ln in enumerate(lines) if ln.startswith("| ")]
        lines.insert(max(before) + 1 if before else (table[-1] + 1 if table else len(lines)), row)
    return "\n".join(lines) + "\n"


def check_bundles(root: Path | None = None, timeout: float = 900) -> list[dict]:
    """Run every bundle's repro.py alone (the nightly re-check): one row per bundle."""
    root = Path(root or default_dir())
    rows = []
    for bundle in sorted(p.parent for p in root.glob("*/repro.py")):
        d = BY_NAME.get(bundle.name)
        r = run_isolated(bundle, timeout)
        rows.append({"name": bundle.name, "runtime": d.runtime if d else "", "title": d.title if d else bundle.name,
                     "version": _version(d.runtime) if d else "", "exit_code": r["exit_code"],
                     "status": r["status"], "message": r["message"], "seconds": r["seconds"]})
    return rows


def main(out: Path | None = None, only: list[str] | None = None, check_only: bool = False) -> int:
    """Regenerate (or only re-check) the bundles; 1 when any defect does not reproduce."""
    out = Path(out or default_dir())
    unknown = [n for n in only or [] if n not in BY_NAME]
    if unknown:
        raise ValueError(f"unknown defect(s) {unknown}; known: {', '.join(BY_NAME)}")
    chosen = [d for d in DEFECTS if not only or d.name in only]
    rows = []
    for d in chosen:
        if not check_only:
            build_bundle(d, out)
        elif not (out / d.name / "repro.py").exists():
            raise FileNotFoundError(f"{out / d.name / 'repro.py'}: no bundle (run `kokoro-parity upstream`)")
        r = run_isolated(out / d.name)
        rows.append((d, r))
        if not check_only:
            atomic_write_text(out / d.name / "REPORT.md", report_md(d, r))
        size = sum(p.stat().st_size for p in (out / d.name).iterdir())
        print(f"{d.name:34s} exit {r['exit_code']}  {r['status']:15s} {r['seconds']:6.1f} s  {size / 1e6:5.2f} MB  "
              f"{r['message'][:110]}", flush=True)
    if not check_only and not only:
        atomic_write_text(out / "README.md", readme_md(rows))
    elif not check_only and (out / "README.md").exists():  # --only: those rows, the others as they were
        atomic_write_text(out / "README.md", update_readme_rows((out / "README.md").read_text(), rows))
    failed = [d.name for d, r in rows if r["exit_code"] != REPRODUCED]
    if failed:
        print(f"kokoro-parity upstream: the defect does not reproduce in {', '.join(failed)}: read its output, then "
              f"update the bundle or mark the defect fixed (harness/upstream.py DEFECTS)", file=sys.stderr)
        for d, r in rows:
            if d.name in failed:
                print(f"--- {d.name}\n{r['output']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(only=sys.argv[1:] or None))
