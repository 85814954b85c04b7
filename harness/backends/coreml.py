"""`coreml-fp32`, `coreml-fp16`: coremltools mlprogram at FLOAT32 / FLOAT16 compute precision.

Conversion (torch.export program -> MIL -> .mlpackage) runs on any OS and its outcome and op
audit are recorded; prediction needs the Core ML framework, i.e. macOS, so elsewhere the item is
SKIPPED after compiling (`runnable`), never passed.
"""
from __future__ import annotations

import inspect
import os
import platform
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch._decomp import decomposition_table

from ..precision.islands import keep_tag, op_selector_for, read_keep_list
from . import Backend, Workaround
from .tvm import COMMON_PATCHES
from ..plumbing.errors import UsageError

# harness.patches.frontends: `&` has no MIL lowering; rsqrt of an int constant is not promoted
# (aten.lstm: `lstm_converter` below, inside the conversion, not a patch)
CORE_ML_PATCHES = ("stft_phase_where", "rsqrt_float_const")

_CT = "coremltools 9.0"
# the runtime defects the Core ML backends work around (docs/workarounds.md, docs/upstream/)
CORE_ML_WORKAROUNDS = {w.name: w for w in (
    Workaround("alias_drop", "aten.alias has no MIL lowering ('Unsupported fx node alias, kind alias'): ALBERT's "
               "position_ids[:, :512] on the 512-token bucket", _CT,
               "docs/upstream/coremltools-alias/ (known: apple/coremltools#2517)"),
    Workaround("and_rename", "aten.__and__ has no MIL lowering ('Unsupported fx node and_1, kind __and__'), "
               "bitwise_and has: ALBERT's attention mask", _CT, "docs/upstream/coremltools-and/"),
    Workaround("decompose_unlowered", "ops without a MIL lowering that torch decomposes (ALBERT's new_ones: "
               "'Unsupported fx node new_ones')", _CT, "docs/upstream/coremltools-new-ones/"),
    Workaround("stft_phase_where", "CustomSTFT's `&` of masks is aten.__and__ (no MIL lowering)", _CT,
               "docs/upstream/coremltools-and/", patch="stft_phase_where"),
    Workaround("rsqrt_float_const", "rsqrt of an int constant is not promoted to float ('expects tensor or "
               "scalar of dtype from type domain [fp16, fp32] but got tensor[int32]')", _CT,
               "docs/upstream/coremltools-rsqrt-int/", patch="rsqrt_float_const"),
    Workaround("lstm_converter", "aten.lstm.input has no MIL lowering in the EXIR frontend ('Unsupported fx "
               "node lstm, kind lstm.input'), while its TorchScript frontend's `lstm` converter takes the same "
               "arguments", _CT, "docs/upstream/coremltools-lstm/ (related: pytorch/executorch#4090)"),
)}


def _inference_ir(program, disabled=()):
    """coremltools takes the ATen inference IR (run_decompositions with an empty table), with
    `__and__` renamed to `bitwise_and`, identity `alias` views dropped, `aten.lstm.input` given
    coremltools' own LSTM converter (`_lstm_converter`), and torch's own decompositions of the ops its frontend cannot
    lower (ALBERT's `new_ones`: 'Unsupported fx node new_ones'), so that a gap a graph rewrite can close
    is not the user's failure. `disabled`: the named workarounds left out (alias_drop, and_rename,
    lstm_converter, decompose_unlowered), so that the defect they hide shows."""
    # the same op under a name coremltools lowers: `a & b` of masks is aten.__and__, which has no MIL
    # lowering while bitwise_and has (ALBERT's attention mask; CustomSTFT's phase mask)
    aliases = {} if "and_rename" in disabled else {torch.ops.aten.__and__.Tensor: torch.ops.aten.bitwise_and.Tensor}
    # identity views with no MIL lowering: a slice over a whole axis exports as aten.alias (ALBERT's
    # position_ids[:, :512] when the token bucket is the whole 512-position table: en_long static)
    identities = () if "alias_drop" in disabled else (torch.ops.aten.alias.default,)
    ir = program.run_decompositions({})
    renamed = [node for node in ir.graph.nodes if node.op == "call_function" and node.target in aliases]
    for node in renamed:
        node.target = aliases[node.target]
    dropped = [node for node in ir.graph.nodes if node.op == "call_function" and node.target in identities]
    for node in dropped:
        node.replace_all_uses_with(node.args[0])
        ir.graph.erase_node(node)
    if renamed or dropped:
        ir.graph_module.recompile()
    _lstm_converter(enabled="lstm_converter" not in disabled)
    gaps = mil_gaps(ir)["ops_without_mil_lowering"]
    if "decompose_unlowered" in disabled:
        return ir
    table = {op: decomposition_table[op] for op in _ops(ir) if op in decomposition_table and _kind(op) in gaps}
    if not table:
        return ir
    decomposed = ir.run_decompositions(table)
    # kept only if it closes gaps without opening others (special_bessel_j0 -> prims::bessel_j0 does not)
    return decomposed if set(mil_gaps(decomposed)["ops_without_mil_lowering"]) < set(gaps) else ir


class _LstmOutputs:
    """An EXIR `lstm.input` node seen as TorchScript's `aten::lstm`, whose three outputs are named:
    the EXIR node has one output, the tuple its `getitem` nodes unpack."""

    def __init__(self, node):
        self.node, self.outputs = node, [f"{node.name}__lstm{i}" for i in range(3)]

    def __getattr__(self, name):
        return getattr(self.node, name)


def _convert_lstm_input(context, node):
    # optional runtime: coreml extra
    from coremltools.converters.mil.frontend.torch import ops

    seen = _LstmOutputs(node)
    ops.lstm(context, seen)
    context.add(tuple(context[name] for name in seen.outputs), torch_name=node.name)


def _lstm_converter(enabled: bool = True) -> None:
    """coremltools' EXIR frontend does not know the kind `lstm.input`, but its TorchScript frontend's
    `lstm` converter takes exactly its arguments (input, [h0, c0], params, has_biases, num_layers,
    dropout, train, bidirectional, batch_first) and emits one MIL `lstm` op per LSTM: registered under
    that kind, Kokoro's LSTMs convert as Core ML ports ship them, in a time flat in T (the cell
    written out per step took about 6 min at 1,536 steps). `enabled=False` takes our registration out
    again, so that `--no-workaround lstm_converter` shows the defect in this process too."""
    # optional runtime: coreml extra
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY as registry

    if enabled and "lstm.input" not in registry:
        registry.set_func_by_name(_convert_lstm_input, "lstm.input")
    elif not enabled and registry.name_to_func_mapping.get("lstm.input") is _convert_lstm_input:
        del registry.name_to_func_mapping["lstm.input"]


def _kind(target) -> str:
    # optional runtime: coreml extra
    from coremltools.converters.mil.frontend.torch.torch_op_registry import sanitize_op_kind

    try:
        kind = target.name()
    except Exception:  # noqa: BLE001 - operator.getitem and friends have no name()
        kind = getattr(target, "__name__", str(target))
    return sanitize_op_kind(kind)


def _ops(program) -> Counter:
    return Counter(node.target for node in program.graph.nodes if node.op == "call_function")


def mil_gaps(program) -> dict:
    """Ops of the program that coremltools' torch frontend has no MIL lowering for (its registry,
    looked up the way its EXIR frontend names nodes)."""
    # optional runtime: coreml extra
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY

    ops: Counter = Counter()
    for target, n in _ops(program).items():
        ops[_kind(target)] += n
    return {"ops_without_mil_lowering": {k: v for k, v in sorted(ops.items()) if k not in _TORCH_OPS_REGISTRY},
            "n_ops": sum(ops.values())}


REPRO_RUNNER = '''def run_backend(program, inputs):
    """coremltools: mlprogram at @PRECISION@ compute precision, predicted with compute units @UNITS@."""
    import platform

    import coremltools as ct

    model = ct.convert(_inference_ir(program, DISABLED), convert_to="mlprogram",
                       minimum_deployment_target=ct.target.iOS17, compute_precision=ct.precision.@PRECISION@,
                       compute_units=ct.ComputeUnit.@UNITS@, skip_model_load=platform.system() != "Darwin")
    if platform.system() != "Darwin":
        print(f"converted; Core ML prediction needs macOS (this is {platform.system()}): not run")
        raise SystemExit(2)
    spec = model.get_spec()
    names = [i.name for i in spec.description.input]
    out = model.predict({n: t.numpy() for n, t in zip(names, inputs)})
    return [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]
'''


COMPUTE_UNITS_ENV = "KOKORO_PARITY_COREML_COMPUTE_UNITS"
COMPUTE_UNITS = ("CPU_ONLY", "CPU_AND_GPU", "CPU_AND_NE", "ALL")  # coremltools.ComputeUnit


class _CoreMLBackend(Backend):
    requires = ("coremltools",)
    patches = COMMON_PATCHES + CORE_ML_PATCHES
    artifact_name = "model.mlpackage"
    audit_labels = {"ops_without_mil_lowering": "ops without a Core ML (MIL) lowering"}
    precision = "FLOAT32"
    compute_units = "CPU_ONLY"  # fp16 runs on ALL: Core ML's CPU computes fp16 models in fp32
    workarounds = CORE_ML_WORKAROUNDS

    def __init__(self) -> None:
        """$KOKORO_PARITY_COREML_COMPUTE_UNITS (CPU_ONLY, CPU_AND_GPU, CPU_AND_NE, ALL) overrides the
        class's compute units at prediction (a load option: the .mlpackage is the same); a remote
        target receives it (harness.plumbing.targets forwards KOKORO_PARITY_* options)."""
        units = os.environ.get(COMPUTE_UNITS_ENV, "").strip().upper()
        if units:
            if units not in COMPUTE_UNITS:
                raise UsageError(f"${COMPUTE_UNITS_ENV}={units!r}: one of {', '.join(COMPUTE_UNITS)}")
            self.compute_units = units

    def runnable(self) -> tuple[bool, str]:
        if platform.system() != "Darwin":
            return False, f"Core ML prediction needs macOS (this is {platform.system()}); conversion ran"
        return True, ""

    def audit(self, program_path: Path) -> dict:
        return mil_gaps(_inference_ir(torch.export.load(str(program_path)), self.disabled_workarounds()))

    def keep_fp32(self) -> list[str]:
        """No keep-list at FLOAT32 (coreml-fp16 overrides); compile asks every Core ML backend."""
        return []

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        # optional runtime: coreml extra
        import coremltools as ct

        program = _inference_ir(torch.export.load(str(program_path)), self.disabled_workarounds())
        precision, kept = getattr(ct.precision, self.precision), None
        keep = self.keep_fp32()
        if keep:  # harness.precision: the keep-list's modules stay float32 (FP16ComputePrecision's op_selector)
            selector, kept = op_selector_for(program, keep)
            precision = ct.transform.FP16ComputePrecision(op_selector=selector)
        model = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17,
                           compute_precision=precision,
                           skip_model_load=platform.system() != "Darwin")
        model.save(str(out_dir / self.artifact_name))
        spec = model.get_spec()
        ops = Counter(op.type for f in spec.mlProgram.functions.values()
                      for block in f.block_specializations.values() for op in block.operations)
        return {"compute_precision": self.precision, "mil_ops": dict(sorted(ops.items())),
                "inputs": [i.name for i in spec.description.input],
                "outputs": [o.name for o in spec.description.output],
                **({"keep_fp32": keep, "keep_fp32_nodes": kept} if keep else {})}

    def repro_source(self) -> str:
        """The graph fixes of `_inference_ir` inlined (the repro converts what the backend converts)."""
        helpers = "from collections import Counter\n\nfrom torch._decomp import decomposition_table\n\n\n" + "".join(
            inspect.getsource(f) + "\n\n" for f in (_LstmOutputs, _convert_lstm_input, _lstm_converter, _kind, _ops,
                                                      mil_gaps, _inference_ir))
        helpers += f"DISABLED = {sorted(self.disabled_workarounds())!r}  # workarounds left out\n\n\n"
        return helpers + REPRO_RUNNER.replace("@PRECISION@", self.precision).replace("@UNITS@", self.compute_units)

    def run(self, artifact_path: Path, inputs: list) -> list:
        # optional runtime: coreml extra
        import coremltools as ct

        model = ct.models.MLModel(str(artifact_path), compute_units=getattr(ct.ComputeUnit, self.compute_units))
        self.run_audit = {"compute_units": self.compute_units}  # into the record's audit
        spec = model.get_spec()
        names = [i.name for i in spec.description.input]
        if len(names) != len(inputs):
            raise UsageError(f"{len(inputs)} inputs given, the Core ML model has {len(names)} ({names})")
        out = model.predict({n: t.detach().cpu().numpy() for n, t in zip(names, inputs)})
        return [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]


class CoreMLFp32Backend(_CoreMLBackend):
    name = "coreml-fp32"
    precision = "FLOAT32"
    description = "coremltools mlprogram, FLOAT32 compute precision (predicts on macOS)"


class CoreMLFp16Backend(_CoreMLBackend):
    name = "coreml-fp16"
    precision = "FLOAT16"
    compute_units = "ALL"
    description = "coremltools mlprogram, FLOAT16 compute precision (predicts on macOS)"

    def keep_fp32(self) -> list[str]:
        """$KOKORO_PARITY_KEEP_FP32 (`--keep-fp32 FILE`): modules whose ops stay float32."""
        return read_keep_list()

    def version(self) -> str:
        return super().version() + keep_tag(self.keep_fp32())
