"""The Apple routes beyond coremltools itself: `et-coreml`, `et-mps` (ExecuTorch's Core ML and MPS
delegates) and `tvm-metal` (TVM Relax, target `metal`: the kokoro-tvm port's route).

Each converts as far as the machine that runs the harness allows, so that conversion errors are
findings even on Linux, and runs only where the Apple frameworks are: a macOS target
(`--target mac`, harness.plumbing.targets). Measured on Linux x86_64 with executorch 1.5.1,
coremltools 9.0, apache-tvm 0.27.0.post1 (docs/targets.md):

- et-coreml: `CoreMLPartitioner` imports and lowers here (coremltools converts each partition);
  the Linux runtime has no `CoreMLBackend` registered ("Backend CoreMLBackend is not registered"),
  so it runs on a macOS target whose executorch wheel has it.
- et-mps: `executorch.backends.apple.mps` is not in the Linux wheel at all, so it cannot even
  lower here: compile_where = "target" (lowered and run on the Mac).
- tvm-metal: `relax.build(mod, target="metal")` of a Linear+ReLU on Linux spends minutes importing
  TVM's CUDA tensor intrinsics (dlight's GPU matmul rule) and then dies with SIGSEGV in
  `tvm::s_tir::Tensorize`; the Relax VM needs `tvm.metal()` anyway, i.e. a Mac with a Metal-enabled
  TVM. So it is not attempted here (available() says why): compile_where = "target".
"""
from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

import numpy as np
import torch

from .executorch import EXECUTORCH_PATCHES, XnnpackBackend
from .tvm import TvmBackend, converter_fixes
from .tvm_library import _flatten
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
ct = deferred_import("coremltools")
et_coreml_compiler = deferred_import("executorch.backends.apple.coreml.compiler")
et_coreml_partition = deferred_import("executorch.backends.apple.coreml.partition")
et_mps_partition = deferred_import("executorch.backends.apple.mps.partition")
et_runtime = deferred_import("executorch.runtime")
tvm = deferred_import("tvm")
relax = deferred_import("tvm.relax")
relax_torch = deferred_import("tvm.relax.frontend.torch")


def _not_macos(what: str) -> tuple[bool, str]:
    if platform.system() != "Darwin":
        return False, f"{what} needs macOS (this is {platform.system()} {platform.machine()}); give a macOS --target"
    return True, ""


def _et_runtime_has(name: str) -> tuple[bool, str]:
    registry = et_runtime.Runtime.get().backend_registry
    if not registry.is_available(name):
        return False, (f"this ExecuTorch runtime has no {name} (registered: "
                       f"{', '.join(registry.registered_backend_names)}); it runs on a macOS target")
    return True, ""


class EtCoreMLBackend(XnnpackBackend):
    """ExecuTorch with the Core ML delegate: lowered here, run where Core ML is."""

    name = "et-coreml"
    requires = ("executorch", "coremltools")
    # coremltools converts the delegated partitions: the graph fixes the coreml-* backends need
    patches = EXECUTORCH_PATCHES + ("stft_phase_where", "rsqrt_float_const")  # no scan_lstm: unmeasured here
    run_requires = ("executorch",)
    description = "ExecuTorch with the Core ML delegate (lowers anywhere, runs on macOS)"
    workarounds = {}
    compute_units = "CPU_ONLY"  # Core ML's compute units: CPU_ONLY, CPU_AND_GPU, CPU_AND_NE, ALL

    repro_partitioner = dict(partitioner_name="CoreMLPartitioner", partitioners="[CoreMLPartitioner()]",
                             partitioner_import="    from executorch.backends.apple.coreml.partition import "
                                                "CoreMLPartitioner")

    def version(self) -> str:
        return super().version() + f";compute_units={self.compute_units}"

    def partitioners(self) -> list:
        specs = et_coreml_compiler.CoreMLBackend.generate_compile_specs(
            compute_unit=getattr(ct.ComputeUnit, self.compute_units), minimum_deployment_target=ct.target.iOS17)
        return [et_coreml_partition.CoreMLPartitioner(compile_specs=specs)]

    def runnable(self) -> tuple[bool, str]:
        ok, why = _not_macos("ExecuTorch's Core ML delegate")
        return _et_runtime_has("CoreMLBackend") if ok else (False, why)


class EtMpsBackend(XnnpackBackend):
    """ExecuTorch with the MPS (Metal Performance Shaders) delegate: its partitioner ships only in
    the macOS wheels, so both phases happen on the Mac."""

    name = "et-mps"
    requires = ("executorch",)
    compile_where = "target"
    description = "ExecuTorch with the MPS delegate (lowers and runs on macOS)"
    patches = EXECUTORCH_PATCHES  # no scan_lstm: unmeasured here
    workarounds = {}
    repro_partitioner = dict(partitioner_name="MPSPartitioner", partitioners="[MPSPartitioner([])]",
                             partitioner_import="    from executorch.backends.apple.mps.partition import MPSPartitioner")

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why

        try:
            found = importlib.util.find_spec("executorch.backends.apple.mps") is not None
        except ImportError:
            found = False
        if not found:
            return False, ("executorch.backends.apple.mps is not in this executorch wheel (only macOS wheels have "
                           "it): lowering and running need a macOS target")
        return True, ""

    def partitioners(self) -> list:
        return [et_mps_partition.MPSPartitioner([])]

    def runnable(self) -> tuple[bool, str]:
        ok, why = _not_macos("ExecuTorch's MPS delegate")
        return _et_runtime_has("MPSBackend") if ok else (False, why)


class TvmMetalBackend(TvmBackend):
    """TVM Relax built for `metal` (the kokoro-tvm route): the library holds Metal shaders and a
    host module; the Relax VM runs it on `tvm.metal()`. The frontend, its fixes and the audit are
    the `tvm` backend's."""

    name = "tvm-metal"
    compile_where = "target"
    description = "TVM Relax, target metal (builds and runs on macOS with a Metal-enabled TVM)"

    def version(self) -> str:
        return super().version() + ";target=metal"

    def available(self) -> tuple[bool, str]:
        if platform.system() != "Darwin":
            return False, ("TVM Metal builds and runs on a macOS target (compile_where=target); here (Linux) "
                           "relax.build(target='metal') of a Linear+ReLU died with SIGSEGV in "
                           "tvm::s_tir::Tensorize after minutes (apache-tvm 0.27.0.post1, docs/targets.md)")
        return super().available()

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        mod = relax_torch.from_exported_program(torch.export.load(str(program_path)),
                                                custom_convert_map=converter_fixes(self.disabled_workarounds()))
        host = "llvm -mtriple=arm64-apple-macos" if platform.machine() == "arm64" else "llvm"
        with tvm.transform.PassContext(opt_level=3):
            executable = relax.build(mod, target=tvm.target.Target("metal", host=host))
        executable.export_library(str(out_dir / self.artifact_name))
        return {"target": "metal", "host": host}

    def repro_source(self) -> None:
        return None

    def runnable(self) -> tuple[bool, str]:
        ok, why = _not_macos("TVM's Metal runtime")
        if not ok:
            return ok, why

        if not tvm.metal().exist:
            return False, "no Metal device for TVM here (tvm.metal().exist is False: TVM built without Metal?)"
        return True, ""

    def run(self, artifact_path: Path, inputs: list) -> list:
        dev = tvm.metal()
        vm = relax.VirtualMachine(tvm.runtime.load_module(str(artifact_path)), dev)
        out = vm["main"](*[tvm.runtime.tensor(np.ascontiguousarray(t.detach().cpu().numpy()), dev) for t in inputs])
        return [torch.from_numpy(np.array(o.numpy())) for o in _flatten(out)]
