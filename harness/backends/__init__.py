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
import inspect
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..plumbing import cache
from ..plumbing.files import atomic_write_json, content_key, size_of
from ..plumbing.jobs import first_error_line
from ..plumbing.targets import probe as probe_machine
from .cost import CostLaw
from ..plumbing.errors import UnknownName, UsageError
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
torch = deferred_import("torch")

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
        raise UsageError(f"--no-workaround {', '.join(unknown)}: unknown workaround; known: all, "
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
        return content_key("artifact", program_key, self.name, self.version())

    def repro_source(self) -> str | None:
        """Python source of `run_backend(program, inputs) -> list[Tensor]` for a standalone repro.py:
        it may import torch, numpy and the backend's own package, nothing of this harness (inline
        helpers with `inspect.getsource`). None: the bundle's repro.py exits 2, "cannot run here"."""
        return None

    # Measured cost laws (harness.backends.cost): the runner SKIPs, before compiling, a program
    # whose estimated compile time, compile memory or run time passes its limit: a TIMEOUT or an
    # out-of-memory kill known in advance, with the law as the reason. None: no law.
    compile_time: CostLaw | None = None
    compile_memory: CostLaw | None = None
    run_time: CostLaw | None = None

    def runnable(self) -> tuple[bool, str]:
        """Whether `run` can execute here; compiling may still work (Core ML converts on Linux and
        predicts only on macOS). When not, the item is SKIPPED with the reason and its audit kept."""
        return True, ""

    def audit(self, program_path: Path) -> dict[str, Any]:
        """What the backend will not take, before compiling (kept in the record if compile fails)."""
        return {}

    # packages whose versions the audit's result depends on (None: `requires`); torch is in the program's key
    audit_requires: tuple[str, ...] | None = None

    def audit_key(self) -> str | None:
        """What this backend's audit of a program depends on besides the program: the function
        that computes it (its module's source), the packages it reads and the workarounds switched
        off. Backends that share it share one audit per program (xnnpack, portable, xnnpack-fp16;
        onnxruntime, tvm-onnx). None: no audit to keep (the default one is empty)."""
        fn = type(self).audit
        if fn is Backend.audit:
            return None
        try:
            source = inspect.getsource(sys.modules[fn.__module__])
        except (OSError, TypeError, KeyError):  # no source to key (a frozen or dynamic module): never cached
            return None
        versions = []
        for p in self.requires if self.audit_requires is None else self.audit_requires:
            try:
                versions.append(f"{p}=={importlib.metadata.version(p)}")
            except importlib.metadata.PackageNotFoundError:
                versions.append(p)
        return content_key("audit", fn.__module__, fn.__qualname__, source, versions,
                           sorted(self.disabled_workarounds()))

    def compile(self, program_path: Path, out_dir: Path) -> dict[str, Any]:
        """Turn the exported program into `out_dir / self.artifact_name`; return an audit dict."""
        raise NotImplementedError

    def run(self, artifact_path: Path, inputs: list) -> list:
        """Run the artifact on a list of torch tensors; return a list of torch tensors. May set
        `self.run_audit` (e.g. activation ranges), which joins the record's audit."""
        raise NotImplementedError

    run_audit: dict[str, Any] = {}
    # modules `run` imports: imported before a run's clock starts (and by a run process started
    # ahead of the run, harness.plumbing.worker), so a run's seconds are the runtime's, not Python's
    run_imports: tuple[str, ...] = ()

    def prepare_run(self) -> None:
        for module in self.run_imports:
            importlib.import_module(module)


_BUILTIN = {
    "eager": "harness.backends.eager:EagerBackend",
    "xnnpack": "harness.backends.executorch:XnnpackBackend",
    "portable": "harness.backends.executorch:PortableBackend",
    "tvm": "harness.backends.tvm:TvmBackend",
    "onnxruntime": "harness.backends.onnx:OnnxRuntimeBackend",
    "tvm-onnx": "harness.backends.onnx:TvmOnnxBackend",
    # harness/backends/onnxruntime_web.py: onnxruntime's ONNX file in onnxruntime-web, headless Chromium
    "ort-web-wasm": "harness.backends.onnxruntime_web:OrtWebWasmBackend",
    "ort-web-webgpu": "harness.backends.onnxruntime_web:OrtWebWebGpuBackend",
    "ort-web-webgpu-fp16": "harness.backends.onnxruntime_web:OrtWebWebGpuFp16Backend",
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
        # cycle: prebuilt imports this module
        from .prebuilt import PrebuiltBackend, parse_name

        return PrebuiltBackend(*parse_name(name))
    refs = registry()
    if name not in refs:
        raise UnknownName(f"unknown backend {name!r}; known: {', '.join(sorted(refs))}")
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

def audit_of(b: Backend, program_path: Path, audit_dir: str | None = None) -> tuple[dict[str, Any], bool | None]:
    """(the backend's audit of the program, whether it came from `audit_dir`; None: not cached).

    The audit depends on the program, not on the compile (XNNPACK's is a second core-ATen
    decomposition: 6.4 s of the decoder's 58 s compile), so it is kept beside the program, in
    `audit_dir` (the program's cache entry), under `Backend.audit_key()`: a second backend of the
    same program, or a compile again after a failure or a new backend version, reads it. An audit
    that fails is not kept."""
    key = b.audit_key() if audit_dir else None
    path = Path(audit_dir) / f"{key}.json" if key else None

    def compute() -> dict[str, Any]:
        try:
            return dict(b.audit(program_path) or {})
        except Exception as e:  # noqa: BLE001 - an audit that fails must not hide the compile outcome
            return {"audit_error": first_error_line(e)}

    if path is None:
        return compute(), None

    with cache.lock(path):  # a second compile of the program waits for the first one's audit
        try:
            return json.loads(path.read_text()), True
        except (OSError, ValueError):
            pass
        audit = compute()
        if "audit_error" not in audit:
            atomic_write_json(path, audit)
    return audit, False


def audit_beside(b: Backend, program_path: Path, audit_dir: str | None = None):
    """Start `audit_of` in a forked process beside the compile; returns the function that waits
    for its (audit, cached). The lowering keeps one core busy and the audit takes another, so a
    cold compile does not wait for it. A kept audit is read here, without a process; a backend
    without an audit, or a system without fork, gets it in this process first.
    The forked process's memory is not in the job's polled peak (its own peak is, once reaped)."""
    key = b.audit_key() if audit_dir else None
    if key:
        try:
            kept = json.loads((Path(audit_dir) / f"{key}.json").read_text()), True
            return lambda: kept
        except (OSError, ValueError):
            pass
    if type(b).audit is Backend.audit or "fork" not in multiprocessing.get_all_start_methods():
        now = audit_of(b, program_path, audit_dir)
        return lambda: now
    ctx = multiprocessing.get_context("fork")  # before the lowering starts any thread: a clean fork
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_audit_child, args=(b, program_path, audit_dir, send), daemon=True)
    proc.start()
    send.close()

    def wait() -> tuple[dict[str, Any], bool | None]:
        try:
            answer = receive.recv()
        except EOFError:  # it died (a crash in the audit, the OOM killer)
            proc.join()
            return {"audit_error": f"the audit's process died (exit code {proc.exitcode})"}, None
        proc.join()
        return answer

    return wait


def _audit_child(b: Backend, program_path: Path, audit_dir: str | None, send) -> None:
    send.send(audit_of(b, program_path, audit_dir))
    send.close()


def compile_job(backend: str, program_path: str, out_dir: str, audit_dir: str | None = None) -> dict[str, Any]:
    """Compile one exported program; returns the backend's audit and the artifact size. The audit
    runs beside the lowering (`audit_beside`); with `audit_dir` (the program's cache entry) it is
    computed once per program (`audit_of`)."""
    b = get_backend(backend)
    out = Path(out_dir)
    audit_result = audit_beside(b, Path(program_path), audit_dir)
    try:
        compiled = b.compile(Path(program_path), out) or {}
    except Exception as e:
        audit, audit_cached = audit_result()
        audit.update(getattr(b, "compile_audit", None) or {})  # what compile learned before failing
        with contextlib.suppress(AttributeError, TypeError):
            e.partial = {"audit": audit, "audit_cached": audit_cached}  # the failed job's value (harness.plumbing.jobs)
        raise
    audit, audit_cached = audit_result()
    audit.update(compiled)
    return {"audit": audit, "artifact_bytes": size_of(out / b.artifact_name), "audit_cached": audit_cached}


def probe_job(backends: list[str]) -> dict[str, Any]:
    """Job function a target runs to describe itself: the machine (`plumbing.targets.probe`) and,
    per backend, whether its package is there and whether it can run there, with its version."""
    def versions(packages) -> str:
        out = []
        for p in packages:
            try:
                out.append(f"{p}=={importlib.metadata.version('apache-tvm' if p == 'tvm' else p)}")
            except importlib.metadata.PackageNotFoundError:
                out.append(p)
        return ",".join(out)

    out: dict[str, Any] = {**probe_machine(), "backends": {}}
    for name in backends:
        try:
            b = get_backend(name)
            ok, why = b.run_available()
            if ok:
                ok, why = b.runnable()
            needed = b.requires if b.run_requires is None else b.run_requires
            out["backends"][name] = {"ok": ok, "why": why, "version": versions(needed) if ok else ""}
        except Exception as e:  # noqa: BLE001 - an unknown or broken backend there is its answer
            out["backends"][name] = {"ok": False, "why": first_error_line(e), "version": ""}
    return out


def run_artifact_job(backend: str, artifact_path: str, inputs_path: str, outputs_path: str,
                     browser: str | None = None) -> dict[str, Any]:
    """`browser`: the DevTools endpoint of the harness run's Chromium a browser runtime's page opens
    in (harness.backends.web_page.SharedBrowser); without it, one is started for this run."""
    b = get_backend(backend)
    b.prepare_run()
    inputs = torch.load(inputs_path, weights_only=True)
    shared = contextlib.nullcontext()
    if browser:
        # cycle: onnxruntime_web imports this module
        from .onnxruntime_web import on_shared_browser
        shared = on_shared_browser(browser)
    start = time.perf_counter()
    with shared:
        outputs = b.run(Path(artifact_path), inputs)
    seconds = time.perf_counter() - start
    torch.save([torch.as_tensor(o).detach().clone() for o in outputs], outputs_path)
    return {"run_s": seconds, "n_outputs": len(outputs), "audit": b.run_audit}


def prepare_run(backend: str) -> None:
    """What a run process started ahead of its run does while the compile runs (worker `preload`)."""
    get_backend(backend).prepare_run()


def compile_run_job(backend: str, program_path: str, out_dir: str, inputs_path: str, outputs_path: str) -> dict:
    """Job function: compile_job then run_job in one child (a bisection probe); `compiled.json`
    marks that the compile finished, so a crash after it is known to be the run's."""
    compiled = compile_job(backend, program_path, out_dir)
    atomic_write_json(Path(out_dir) / "compiled.json", compiled)
    artifact = Path(out_dir) / get_backend(backend).artifact_name
    return {"compile": compiled, "run": run_artifact_job(backend, str(artifact), inputs_path, outputs_path)}
