"""`onnxruntime` and `tvm-onnx`: the exported program as ONNX.

`torch.onnx.export` with the dynamo exporter straight from the saved ExportedProgram, falling
back to the legacy TorchScript exporter; then onnxruntime on CPU, or the same ONNX file through
TVM Relax's ONNX frontend (the route of existing Kokoro TVM ports). The audit lists the ops that
the exporter's registry cannot translate, and, for tvm-onnx, ONNX ops without a TVM converter.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ..plumbing.errors import UsageError
from ..plumbing.jobs import first_error_line
from . import Backend, Workaround
from .cost import AUDIO_SECONDS, EXPORTED_NODES, CostLaw
from .tvm import COMMON_PATCHES, TVM_PATCHES, build_library, run_library, tvm_version
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
onnx = deferred_import("onnx")  # a run target has onnxruntime, not always onnx
relax_onnx = deferred_import("tvm.relax.frontend.onnx")
relax_onnx_frontend = deferred_import("tvm.relax.frontend.onnx.onnx_frontend")

ONNX_NAME = "model.onnx"
IO_NAME = "io.json"  # the program's user input names, in order: runs map inputs by name
OPSET = 18
# CustomSTFT's boolean `phase[mask] = pi` exports as NonZero + ScatterND, which TVM's ONNX frontend
# rejects ("ScatterND op requires the updates tensor to have the shape ..."): both ONNX backends
# take stft_phase_where (exact), so that they share one program and one ONNX file.
ONNX_PATCHES = COMMON_PATCHES + TVM_PATCHES


def exporter_gaps(program) -> dict:
    """Ops that the dynamo exporter's ONNX registry has no translation for, after its own
    decomposition (torch's internal API: absent in other torch versions, then not audited)."""
    try:
        # optional runtime: the torch ONNX exporter needs onnxscript
        from torch.onnx._internal.exporter import _fx_passes, _registration
    except ImportError as e:
        return {"exporter_audit": f"unavailable: {e}"}
    registry = _registration.ONNXRegistry.from_torchlib()
    decomposed = _fx_passes.decompose_with_registry(program, registry)
    ops = Counter(n.target for n in decomposed.graph.nodes if n.op == "call_function")
    missing = {str(t): c for t, c in ops.items()
               if hasattr(t, "_schema") and not registry.is_registered(t)
               and not t.__name__.startswith("_assert")}  # the exporter drops assertions
    return {"ops_without_onnx_translation": dict(sorted(missing.items())), "n_ops": sum(ops.values())}


def export_onnx(program_path: Path, out_path: Path) -> dict:
    """Dynamo exporter first; on failure the TorchScript exporter on the program's module.
    Writes `out_path` (weights inside) and io.json beside it; returns what happened."""
    program = torch.export.load(str(program_path))
    names = [s.arg.name for s in program.graph_signature.input_specs
             if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    (out_path.parent / IO_NAME).write_text(json.dumps({"inputs": names}))
    info: dict = {}
    try:
        onnx_program = torch.onnx.export(program, (), dynamo=True, opset_version=OPSET, optimize=True)
        onnx_program.save(str(out_path), external_data=False)
        info["exporter"] = "dynamo"
    except Exception as e:  # noqa: BLE001 - a rejection of the dynamo exporter is recorded, then the fallback
        info["dynamo_error"] = first_error_line(e)
        if not program.example_inputs:
            raise
        args = tuple(program.example_inputs[0])
        torch.onnx.export(program.module(), args, str(out_path), dynamo=False, opset_version=17,
                          input_names=names)
        info["exporter"] = "torchscript"

    model = onnx.load(str(out_path), load_external_data=False)
    info["onnx_ops"] = dict(sorted(Counter(n.op_type for n in model.graph.node).items()))
    return info


def input_feed(artifact_path: Path, graph_inputs: list[str], inputs: list) -> dict:
    """Map the step's inputs (in the program's order) to the model's inputs by name."""
    names = json.loads((artifact_path.parent / IO_NAME).read_text())["inputs"]
    if len(names) != len(inputs):
        raise UsageError(f"{len(inputs)} inputs given, the program has {len(names)} ({names})")
    by_name = dict(zip(names, inputs))
    # the exporter calls an input that the program mutates in place `<name>_orig` (a bisection probe
    # carved around SineGen's `rand_ini[:, 0] = 0`)
    own = {n: n if n in by_name else n[:-len("_orig")] for n in graph_inputs}
    missing = [n for n, m in own.items() if m not in by_name]
    if missing:
        raise UsageError(f"ONNX inputs {missing} are not inputs of the program ({names})")
    return {n: by_name[own[n]] for n in graph_inputs}


ORT_REPRO_RUNNER = '''def run_backend(program, inputs):
    """torch.onnx.export (dynamo exporter, opset 18) -> onnxruntime, CPU execution provider."""
    import tempfile

    import onnxruntime as ort
    from torch.export.graph_signature import InputKind

    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.onnx")
        torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=True).save(path, external_data=False)
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = dict(zip(names, inputs))
    out = session.run(None, {i.name: np.ascontiguousarray(feed[i.name].numpy()) for i in session.get_inputs()})
    return [torch.from_numpy(np.asarray(o)) for o in out]
'''
TVM_ONNX_REPRO_RUNNER = '''def run_backend(program, inputs):
    """torch.onnx.export (dynamo, opset 18) -> TVM Relax ONNX frontend -> relax.build(llvm) -> Relax VM."""
    import tempfile

    import onnx
    import tvm
    from torch.export.graph_signature import InputKind
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    names = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "model.onnx")
        torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=True).save(path, external_data=False)
        model = onnx.load(path)
    dtypes = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name for i in model.graph.input}
    mod = from_onnx(model, dtype_dict=dtypes, keep_params_in_input=False)
    with tvm.transform.PassContext(opt_level=3):
        vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    feed = dict(zip(names, inputs))
    out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(feed[i.name].numpy())) for i in model.graph.input])
    out = out if isinstance(out, (list, tuple)) or not hasattr(out, "numpy") else [out]
    return [torch.from_numpy(np.array(o.numpy())) for o in out]
'''


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    requires = ("onnxruntime", "onnx", "onnxscript")
    run_requires = ("onnxruntime",)  # onnx and onnxscript export on the host; a target runs the .onnx
    patches = ONNX_PATCHES
    artifact_name = ONNX_NAME
    run_imports = ("onnxruntime",)
    audit_labels = {"ops_without_onnx_translation": "ops the ONNX exporter cannot translate"}
    audit_requires = ("onnxscript",)  # the exporter's registry; tvm-onnx shares this audit of a program
    description = "torch.onnx.export (dynamo, TorchScript fallback) -> onnxruntime CPU"

    def audit(self, program_path: Path) -> dict:
        return exporter_gaps(torch.export.load(str(program_path)))

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        return export_onnx(program_path, out_dir / ONNX_NAME)

    def repro_source(self) -> str:
        return ORT_REPRO_RUNNER

    def run(self, artifact_path: Path, inputs: list) -> list:
        import onnxruntime as ort  # runtime: the faces load this module and import no runtime

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        sess = ort.InferenceSession(str(artifact_path), opts, providers=["CPUExecutionProvider"])
        feed = input_feed(artifact_path, [i.name for i in sess.get_inputs()], inputs)
        out = sess.run(None, {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in feed.items()})
        return [torch.from_numpy(np.asarray(o)) for o in out]


def tvm_onnx_gaps(model) -> dict:
    convert_map = relax_onnx_frontend._get_convert_map()
    ops = Counter(n.op_type for n in model.graph.node)
    return {"onnx_ops_without_tvm_converter": {k: v for k, v in sorted(ops.items()) if k not in convert_map}}


class TvmOnnxBackend(Backend):
    name = "tvm-onnx"
    # Relax's ONNX frontend has no LSTM (nor Scan): the cell is written out per time step, and the
    # compile grows faster than the graph. `benchmarks/lstm_scaling.py --impl unrolled --backend
    # tvm-onnx --T 64 --T 128` (2026-11-24, idle): 42.6 s at 1,897 nodes, 119.3 s at 3,753; and the
    # f0n items of the matrix (2026-11-26, shard f0n-refresh2 beside one other shard, as the matrix
    # runs): en_short dynamic 215.8 s at 4,613, ja dynamic 321.2 s at 5,918, en_short static 552.4 s
    # at 7,832. The two bare points alone (power 1.51) put ja's static f0n (11,544 nodes) at 650 s;
    # it was killed at 900 s. Fit to all five: power 1.82, 1,082 s there.
    compile_time = CostLaw(EXPORTED_NODES, "s", ((1897, 42.6), (3753, 119.3), (4613, 215.8), (5918, 321.2),
                                                 (7832, 552.4)))
    # The vocoder through Relax's ONNX frontend (untuned llvm) runs at about 28x real time on short
    # buckets: `benchmarks/run_cost.py --backend tvm-onnx` (2026-11-25, decoder buckets of 48, 96,
    # 144 frames, random weights, beside one other shard) and 33x on en_long's 27 s (its decoder
    # record, the same day, beside another shard: 896 s, PASS): a power of 1.06.
    run_time = CostLaw(AUDIO_SECONDS, "s", ((1.2, 33.1), (2.4, 66.4), (3.6, 98.8), (26.95, 896.0)))
    requires = ("tvm", "onnx", "onnxscript")
    # TVM 0.27's Relax ONNX frontend has no LSTM converter ("OpNotImplemented: ... LSTM"): the LSTM
    # steps get the cell written out (unrolled_lstm), the InstanceNorms their statistics in float64;
    # the other steps share onnxruntime's ONNX file
    patches = ONNX_PATCHES + ("unrolled_lstm", "instance_norm_float64_stats")
    audit_labels = {"ops_without_onnx_translation": "ops the ONNX exporter cannot translate",
                    "onnx_ops_without_tvm_converter": "ONNX ops without a TVM converter"}
    workarounds = {w.name: w for w in (
        Workaround("unrolled_lstm", "the Relax ONNX frontend has no LSTM converter ('OpNotImplemented: The following "
                   "operators are not supported for frontend ONNX: LSTM')", "apache-tvm 0.27.0.post1",
                   "docs/upstream/tvm-onnx-lstm/ (tracked: apache/tvm#20124)", patch="unrolled_lstm"),
        Workaround("stft_phase_where", "CustomSTFT's boolean phase[mask] = pi exports as NonZero + ScatterND, which "
                   "the Relax ONNX frontend rejects ('ScatterND op requires the updates tensor to have the shape')",
                   "apache-tvm 0.27.0.post1", "no bundle yet", patch="stft_phase_where"),
        Workaround("instance_norm_float64_stats", "the Relax ONNX frontend converts InstanceNormalization as mean and "
                   "relax variance in float32: finite, but 40-160x PyTorch float32's error on a long channel (en_long's "
                   "shape: 3.3e-4 against 2.1e-6; benchmarks/instance_norm_runtimes.py)", "apache-tvm 0.27.0.post1",
                   "no bundle yet (topi's twin: docs/upstream/tvm-instancenorm-variance/)",
                   patch="instance_norm_float64_stats"),
    )}
    artifact_name = "model.so"
    run_imports = ("tvm", "tvm.relax")
    description = "the ONNX file of `onnxruntime` through TVM Relax's ONNX frontend (llvm, Relax VM)"

    def version(self) -> str:
        return f"{tvm_version()},{super().version()}"

    audit = OnnxRuntimeBackend.audit  # the same exporter gaps: one audit per program for both (audit_key)
    audit_requires = OnnxRuntimeBackend.audit_requires

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        self.compile_audit = export_onnx(program_path, out_dir / ONNX_NAME)
        model = onnx.load(str(out_dir / ONNX_NAME))
        self.compile_audit.update(tvm_onnx_gaps(model))
        dtypes = {i.name: onnx.helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type).name
                  for i in model.graph.input}
        mod = relax_onnx.from_onnx(model, dtype_dict=dtypes, keep_params_in_input=False)
        build_library(mod, out_dir / self.artifact_name)
        (out_dir / "onnx_inputs.json").write_text(json.dumps([i.name for i in model.graph.input]))
        return self.compile_audit

    def repro_source(self) -> str:
        return TVM_ONNX_REPRO_RUNNER

    def run(self, artifact_path: Path, inputs: list) -> list:
        graph_inputs = json.loads((artifact_path.parent / "onnx_inputs.json").read_text())
        feed = input_feed(artifact_path, graph_inputs, inputs)
        return run_library(artifact_path, list(feed.values()))
