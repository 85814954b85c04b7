"""`tvm`: Apache TVM Relax. torch.export program -> `from_exported_program` -> `relax.build` for
`llvm` -> a shared library run on the Relax VM. The audit lists the program's ops that the
frontend has no converter for (its own `convert_map`), which is what fails first."""
from __future__ import annotations

import importlib.metadata as md
import inspect
import time
from collections import Counter
from pathlib import Path

import torch

from . import COMMON_PATCHES, Backend, Workaround  # noqa: F401 - COMMON_PATCHES: onnx, coreml, fp16 import it here
from .cost import AUDIO_SECONDS, LSTM_STEPS, CostLaw
from .tvm_library import TARGET, build_library, run_library  # noqa: F401 - build_library: onnx imports it here
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
relax = deferred_import("tvm.relax")
relax_torch = deferred_import("tvm.relax.frontend.torch")
relax_ep_translator = deferred_import("tvm.relax.frontend.torch.exported_program_translator")

# harness.patches.frontends: rewrites of spots the Relax frontend mistranslates
TVM_PATCHES = ("stft_phase_where",)


def _clamp_int_safe(node, importer):
    """`clamp.default` converter that gives an integer clamp with one missing bound its dtype's
    limit. TVM 0.27 uses +-inf, and legalizing clip on int64 then fails with "Cannot convert
    infinity to BigInt" (torch's linear-interpolation decomposition in SineGen does
    `(x + 1).clamp(max=n - 1)` on int64 indices). Exact: the bound it adds cannot bind."""
    # pasted into repro.py (repro_source): what it uses, it imports itself; the tvm extra
    import numpy as np
    from tvm import relax  # optional runtime: the tvm extra

    x = importer.env[node.args[0]]
    dtype = str(x.ty.dtype)
    lo = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    hi = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    if not dtype.startswith(("int", "uint")) or not all(b is None or isinstance(b, int) for b in (lo, hi)):
        return importer._clamp(node)
    info = np.iinfo(dtype)
    return importer.block_builder.emit(relax.op.clip(x, info.min if lo is None else lo, info.max if hi is None else hi))


# converters that replace the frontend's own for ops it mistranslates (recorded in the audit)
CONVERTER_FIXES = {"clamp.default": _clamp_int_safe}
FIX_WORKAROUND = {"clamp.default": "clamp_int_bound"}  # converter fix -> its workaround's name

_TVM = "apache-tvm 0.27.0.post1"
TVM_WORKAROUNDS = {w.name: w for w in (
    Workaround("clamp_int_bound", "from_exported_program gives an int64 clamp with one bound +-inf, and building "
               "it fails: 'Cannot convert infinity to BigInt' (SineGen's linear interpolation)", _TVM,
               "docs/upstream/tvm-clamp-int/"),
    Workaround("stft_phase_where", "a boolean-mask index_put is rejected: 'IndexPut requires each index tensor "
               "to have integer dtype' (CustomSTFT's phase[mask] = pi)", _TVM,
               "docs/upstream/tvm-index-put-bool/", patch="stft_phase_where"),
)}
# the `tvm` backend's own (tvm-onnx shares the two above): its InstanceNorm statistics in float64
INSTANCE_NORM_FLOAT64_STATS = Workaround(
    "instance_norm_float64_stats", "topi's instance_norm takes var = E[x^2] - E[x]^2 in one float32 pass: "
    "negative on a long channel with a large mean, so 1/sqrt(var + eps) is NaN (en_long's f0n: F0 at 9.2x its "
    "floor)", _TVM, "docs/upstream/tvm-instancenorm-variance/", patch="instance_norm_float64_stats")


def converter_fixes(disabled=()) -> dict:
    """CONVERTER_FIXES without those whose workaround is switched off."""
    return {op: fn for op, fn in CONVERTER_FIXES.items() if FIX_WORKAROUND[op] not in disabled}


def frontend_gaps(program) -> dict:
    """Ops of `program` (after the Core ATen decomposition the frontend runs) without a converter."""
    convert_map = relax_ep_translator.ExportedProgramImporter().create_convert_map()
    ops = Counter(n.target.__name__ for n in program.run_decompositions().graph.nodes
                  if n.op == "call_function")
    return {"ops_without_converter": {k: v for k, v in sorted(ops.items()) if k not in convert_map},
            "n_ops": sum(ops.values())}


def tvm_version() -> str:
    """The distribution is `apache-tvm`, the import `tvm`: the base class cannot find it by name."""
    try:
        return f"apache-tvm=={md.version('apache-tvm')}"
    except md.PackageNotFoundError:
        return "tvm"


REPRO_RUNNER = '''def run_backend(program, inputs):
    """torch.export program -> TVM Relax from_exported_program -> relax.build(llvm) -> Relax VM."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    mod = from_exported_program(program, custom_convert_map=CONVERTER_FIXES)
    with tvm.transform.PassContext(opt_level=3):
        vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(t.numpy())) for t in inputs])

    def flatten(v):
        return [v] if hasattr(v, "numpy") else [x for item in v for x in flatten(item)]
    return [torch.from_numpy(np.array(o.numpy())) for o in flatten(out)]
'''


class TvmBackend(Backend):
    name = "tvm"
    requires = ("tvm",)
    patches = COMMON_PATCHES + TVM_PATCHES + ("instance_norm_float64_stats",)
    artifact_name = "model.so"
    run_imports = ("tvm", "tvm.relax")
    workarounds = {**TVM_WORKAROUNDS, INSTANCE_NORM_FLOAT64_STATS.name: INSTANCE_NORM_FLOAT64_STATS}
    audit_labels = {"ops_without_converter": "ops without a TVM converter"}
    description = f"Apache TVM Relax (from_exported_program, target {TARGET}, Relax VM)"
    # Relax's `_lstm` writes one cell per time step, and the compile's peak memory grows with the
    # square of the steps (findings 13): a bare Kokoro LSTM by `benchmarks/lstm_scaling.py --impl
    # aten --backend tvm` at T = 64-512 (2026-11-25), en_long's f0n at 1,078 frames (its record);
    # at 1,536 frames it was OOM-killed at 22.2 GB, where this law says 19.6.
    compile_memory = CostLaw(LSTM_STEPS, "GB", ((64, 0.75), (128, 0.99), (256, 1.63), (512, 3.51), (1078, 10.73)),
                             form="quadratic")
    # The vocoder (untuned llvm, with the float64 InstanceNorm statistics) runs at 20x real time on
    # short buckets (`benchmarks/run_cost.py --backend tvm`, 48-144 frames) and 29x on en_long's
    # 27 s (its decoder record, 2026-11-25): a power of 1.13, so en_long's 38.4 s bucket is ~19 min.
    run_time = CostLaw(AUDIO_SECONDS, "s", ((1.2, 24.1), (2.4, 49.1), (3.6, 71.8), (26.95, 783.5)))

    def version(self) -> str:
        return tvm_version() + self.workaround_tag()

    def audit(self, program_path: Path) -> dict:
        return frontend_gaps(torch.export.load(str(program_path)))

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        start = time.perf_counter()
        fixes = converter_fixes(self.disabled_workarounds())
        mod = relax_torch.from_exported_program(torch.export.load(str(program_path)), custom_convert_map=fixes)
        import_s = time.perf_counter() - start
        build_library(mod, out_dir / self.artifact_name)
        return {"import_s": import_s, "build_s": time.perf_counter() - start - import_s, "target": TARGET,
                "converter_fixes": sorted(fixes)}

    def repro_source(self) -> str:
        """The converter fix this backend applies, inlined: the repro imports no harness code."""
        fixes = converter_fixes(self.disabled_workarounds())
        table = "CONVERTER_FIXES = {" + ", ".join(f"{op!r}: {fn.__name__}" for op, fn in fixes.items()) + "}\n\n\n"
        return "".join(inspect.getsource(fn) + "\n\n" for fn in fixes.values()) + table + REPRO_RUNNER

    def run(self, artifact_path: Path, inputs: list) -> list:
        return run_library(artifact_path, inputs)
