"""Backends: a small Runner-like class per runtime, found by name.

A backend knows nothing of Kokoro or pytest. It takes an exported program file and arrays, so a
third party can write one (entry-point group `kokoro_parity.backends`) and a repro can reuse it.
Heavy runtime packages are imported inside `compile`/`run`, in the child process that needs them.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import os
from pathlib import Path
from typing import Any

ENTRY_POINT_GROUP = "kokoro_parity.backends"
EXTRA_ENV = "KOKORO_PARITY_EXTRA_BACKENDS"  # "name=module:Class,...": backends outside the package


class Backend:
    """Subclass and set the class attributes; override `compile` and `run` (and `audit`)."""

    name: str = ""
    requires: tuple[str, ...] = ()  # importable top-level packages
    patches: tuple[str, ...] = ()  # patches of harness.patches that its programs need
    artifact_name: str = "artifact.bin"
    description: str = ""

    def available(self) -> tuple[bool, str]:
        missing = [p for p in self.requires if importlib.util.find_spec(p) is None]
        if missing:
            return False, f"package(s) not installed: {', '.join(missing)} (install the extra for {self.name!r})"
        return True, ""

    def version(self) -> str:
        versions = []
        for p in self.requires:
            try:
                versions.append(f"{p}=={importlib.metadata.version(p)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(p)
        return ",".join(versions) or "builtin"

    def artifact_key(self, program_key: str) -> str:
        """The cache key of this backend's artifact of a program. `version()` is part of it: a
        backend whose compile depends on its configuration must say so in `version()`."""
        from ..plumbing.files import content_key

        return content_key("artifact", program_key, self.name, self.version())

    def repro_source(self) -> str | None:
        """Python source of `run_backend(program, inputs) -> list[Tensor]` for a standalone repro.py:
        it may import torch, numpy and the backend's own package, nothing of this harness (inline
        helpers with `inspect.getsource`). None: the bundle's repro.py exits 2, "cannot run here"."""
        return None

    def runnable(self) -> tuple[bool, str]:
        """Whether `run` can execute here; compiling may still work (Core ML converts on Linux and
        predicts only on macOS). When not, the item is SKIPPED with the reason and its audit kept."""
        return True, ""

    def audit(self, program_path: Path) -> dict[str, Any]:
        """What the backend will not take, before compiling (kept in the record if compile fails)."""
        return {}

    def compile(self, program_path: Path, out_dir: Path) -> dict[str, Any]:
        """Turn the exported program into `out_dir / self.artifact_name`; return an audit dict."""
        raise NotImplementedError

    def run(self, artifact_path: Path, inputs: list) -> list:
        """Run the artifact on a list of torch tensors; return a list of torch tensors. May set
        `self.run_audit` (e.g. activation ranges), which joins the record's audit."""
        raise NotImplementedError

    run_audit: dict[str, Any] = {}


_BUILTIN = {
    "eager": "harness.backends.eager:EagerBackend",
    "xnnpack": "harness.backends.executorch:XnnpackBackend",
    "portable": "harness.backends.executorch:PortableBackend",
    "tvm": "harness.backends.tvm:TvmBackend",
    "onnxruntime": "harness.backends.onnx:OnnxRuntimeBackend",
    "tvm-onnx": "harness.backends.onnx:TvmOnnxBackend",
    "coreml-fp32": "harness.backends.coreml:CoreMLFp32Backend",
    "coreml-fp16": "harness.backends.coreml:CoreMLFp16Backend",
    "fp16": "harness.backends.fp16:Fp16Backend",
}


def _load(ref: str) -> type[Backend]:
    module, _, cls = ref.partition(":")
    return getattr(importlib.import_module(module), cls)


def registry() -> dict[str, str]:
    """name -> "module:Class" for built-in and entry-point backends."""
    found = dict(_BUILTIN)
    for spec in os.environ.get(EXTRA_ENV, "").split(","):  # tests register fault-injection backends
        name, _, ref = spec.partition("=")
        if ref:
            found.setdefault(name.strip(), ref.strip())
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def get_backend(name: str) -> Backend:
    refs = registry()
    if name not in refs:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(sorted(refs))}")
    return _load(refs[name])()


def backend_names() -> list[str]:
    return list(registry())


# ---- job functions (run in the child process by harness.plumbing.jobs) ------------------------------

def compile_job(backend: str, program_path: str, out_dir: str) -> dict[str, Any]:
    """Compile one exported program; returns the backend's audit and the artifact size."""
    b = get_backend(backend)
    out = Path(out_dir)
    try:
        audit = dict(b.audit(Path(program_path)) or {})
    except Exception as e:  # noqa: BLE001 - an audit that fails must not hide the compile outcome
        from ..plumbing.jobs import first_error_line

        audit = {"audit_error": first_error_line(e)}
    try:
        audit.update(b.compile(Path(program_path), out) or {})
    except Exception as e:
        audit.update(getattr(b, "compile_audit", None) or {})  # what compile learned before failing
        with contextlib.suppress(AttributeError, TypeError):
            e.partial = {"audit": audit}  # harness.plumbing.jobs keeps it as the failed job's value
        raise
    artifact = out / b.artifact_name
    size = (sum(p.stat().st_size for p in artifact.rglob("*") if p.is_file()) if artifact.is_dir()
            else artifact.stat().st_size)
    return {"audit": audit, "artifact_bytes": size}


def run_job(backend: str, artifact_path: str, inputs_path: str, outputs_path: str) -> dict[str, Any]:
    import time

    import torch

    b = get_backend(backend)
    inputs = torch.load(inputs_path, weights_only=True)
    start = time.perf_counter()
    outputs = b.run(Path(artifact_path), inputs)
    seconds = time.perf_counter() - start
    torch.save([torch.as_tensor(o).detach().clone() for o in outputs], outputs_path)
    return {"run_s": seconds, "n_outputs": len(outputs), "audit": b.run_audit}


def compile_run_job(backend: str, program_path: str, out_dir: str, inputs_path: str, outputs_path: str) -> dict:
    """Job function: compile_job then run_job in one child (a bisection probe); `compiled.json`
    marks that the compile finished, so a crash after it is known to be the run's."""
    from ..plumbing.files import atomic_write_json

    compiled = compile_job(backend, program_path, out_dir)
    atomic_write_json(Path(out_dir) / "compiled.json", compiled)
    artifact = Path(out_dir) / get_backend(backend).artifact_name
    return {"compile": compiled, "run": run_job(backend, str(artifact), inputs_path, outputs_path)}
