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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENTRY_POINT_GROUP = "kokoro_parity.backends"
COMMON_PATCHES = ("noise_as_input", "dropout_identity", "fold_weight_norm", "no_packing", "custom_stft")
EXTRA_ENV = "KOKORO_PARITY_EXTRA_BACKENDS"  # "name=module:Class,...": backends outside the package
NO_WORKAROUND_ENV = "KOKORO_PARITY_NO_WORKAROUND"  # "name,name" or "all": workarounds switched off


@dataclass(frozen=True)
class Workaround:
    """A graph fix a backend applies for a runtime defect, named so that it can be switched off
    (`--no-workaround NAME`) and the defect it hides seen as an item verdict and bisected.
    `patch`: the harness.patches patch that is the fix (dropped from the item's patches); else the
    fix lives inside the backend's compile, which reads `Backend.disabled_workarounds()`."""

    name: str
    defect: str  # what the runtime gets wrong without it
    runtime: str  # the package and version it was found on
    upstream: str  # the repro bundle under docs/upstream/ and the known report, if any
    patch: str | None = None
    kind: str = "failure"  # failure (does not convert / wrong values) | performance (slower, same values)


def disabled_workaround_names() -> set[str]:
    """The names switched off for this process and its job children (env NO_WORKAROUND_ENV)."""
    return {n.strip() for n in os.environ.get(NO_WORKAROUND_ENV, "").split(",") if n.strip()}


def set_disabled_workarounds(names) -> None:
    """Switch workarounds off (names or `all`) for this process and the children it starts; a
    name no backend declares is a ValueError naming the known ones."""
    names = sorted({n.strip() for n in names if n and n.strip()})
    known = {w for b in backend_names() for w in _workarounds_of(b)}
    unknown = [n for n in names if n != "all" and n not in known]
    if unknown:
        raise ValueError(f"--no-workaround {', '.join(unknown)}: unknown workaround; known: all, "
                         f"{', '.join(sorted(known))}")
    if names:
        os.environ[NO_WORKAROUND_ENV] = ",".join(names)
    else:
        os.environ.pop(NO_WORKAROUND_ENV, None)


def _workarounds_of(name: str) -> dict:
    try:
        return dict(get_backend(name).workarounds)
    except Exception:  # noqa: BLE001 - a third-party backend that does not load declares nothing
        return {}


class Backend:
    """Subclass and set the class attributes; override `compile` and `run` (and `audit`)."""

    name: str = ""
    requires: tuple[str, ...] = ()  # importable top-level packages
    # patches of harness.patches that its programs need; by default what every exported program of
    # Kokoro needs (noise as an input, no dropout, weight_norm folded, no PackedSequence, CustomSTFT)
    patches: tuple[str, ...] = COMMON_PATCHES
    audit_labels: dict[str, str] = {}  # audit key -> how the terminal table names it
    artifact_name: str = "artifact.bin"
    description: str = ""
    # what it computes in: "float16" backends are judged against float16 eager's own error (the
    # float16 floor, harness.precision), float32 ones against float32 eager's (`precision_of`)
    precision: str = "float32"
    workarounds: dict[str, Workaround] = {}  # name -> the runtime defect it hides (harness.upstream)

    def disabled_workarounds(self) -> set[str]:
        """This backend's workarounds switched off (`--no-workaround NAME|all`, env NO_WORKAROUND_ENV)."""
        off = disabled_workaround_names()
        return set(self.workarounds) if "all" in off else off & set(self.workarounds)

    def workaround_patches_disabled(self) -> set[str]:
        """The patches to drop from this backend's own: its patch-workarounds switched off."""
        return {w.patch for n, w in self.workarounds.items() if w.patch and n in self.disabled_workarounds()}

    def workaround_tag(self) -> str:
        """Part of `version()` (hence of the artifact key) when a workaround inside compile is off;
        patch-workarounds change the program (and its key) instead."""
        off = sorted(n for n in self.disabled_workarounds() if not self.workarounds[n].patch)
        return f";no-workaround={'+'.join(off)}" if off else ""

    # Where each phase executes when a run has a target (harness.plumbing.targets, `--target`):
    # "host" is the machine running the harness; "target" the `--target` machine (this one when local).
    # ExecuTorch, ONNX Runtime and Core ML convert on the host and run on the target; a backend whose
    # compile must happen on the device (TVM Metal) says compile_where = "target".
    compile_where: str = "host"
    run_where: str = "target"
    run_requires: tuple[str, ...] | None = None  # what `run` imports (default: `requires`): all a target needs

    def available(self) -> tuple[bool, str]:
        missing = [p for p in self.requires if importlib.util.find_spec(p) is None]
        if missing:
            return False, f"package(s) not installed: {', '.join(missing)} (install the extra for {self.name!r})"
        return True, ""

    def run_available(self) -> tuple[bool, str]:
        """Whether `run` can import what it needs here (on a target only `run_requires` must be installed)."""
        needed = self.requires if self.run_requires is None else self.run_requires
        missing = [p for p in needed if importlib.util.find_spec(p) is None]
        if missing:
            return False, f"package(s) not installed: {', '.join(missing)} (needed to run {self.name!r})"
        return True, ""

    def version(self) -> str:
        versions = []
        for p in self.requires:
            try:
                versions.append(f"{p}=={importlib.metadata.version(p)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(p)
        return (",".join(versions) or "builtin") + self.workaround_tag()

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
    "xnnpack-fp16": "harness.backends.xnnpack_fp16:XnnpackFp16Backend",
    # harness/backends/apple.py: lowered here as far as Linux allows, run on a macOS --target
    "et-coreml": "harness.backends.apple:EtCoreMLBackend",
    "et-mps": "harness.backends.apple:EtMpsBackend",
    "tvm-metal": "harness.backends.apple:TvmMetalBackend",
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


def precision_of(backend: Backend) -> str:
    """"float32" or "float16" (Core ML's backends spell their compute precision "FLOAT16")."""
    p = str(getattr(backend, "precision", "float32") or "float32").lower()
    return p if p in ("float32", "float16") else "float32"


def get_backend(name: str) -> Backend:
    if name.startswith("prebuilt:"):  # a user's artifact (harness.backends.prebuilt): one per file
        from .prebuilt import PREFIX, PrebuiltBackend

        return PrebuiltBackend(name[len(PREFIX):])
    refs = registry()
    if name not in refs:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(sorted(refs))}")
    return _load(refs[name])()


def backend_names() -> list[str]:
    return list(registry())


def audit_labels() -> dict[str, str]:
    """Every built-in backend's audit keys and their labels (a backend knows what its audit means)."""
    labels: dict[str, str] = {}
    for ref in _BUILTIN.values():
        labels.update(_load(ref).audit_labels)
    return labels


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


def run_artifact_job(backend: str, artifact_path: str, inputs_path: str, outputs_path: str) -> dict[str, Any]:
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
    return {"compile": compiled, "run": run_artifact_job(backend, str(artifact), inputs_path, outputs_path)}
