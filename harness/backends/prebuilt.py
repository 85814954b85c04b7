"""A user's own artifact as a backend: its "compile" is a copy of the user's file (a prebuilt backend).

People bring their own `.onnx`, `.pte`, TVM library (`.so`) or `.mlpackage`. Made a backend, such
a file goes through the same cache, child-process jobs, records, history and dashboard as every
program the harness exports itself. A prebuilt backend is created per artifact (its name is
`prebuilt:<absolute path>`, which `harness.backends.get_backend` understands), never listed among
the built-in backends. Heavy runtimes are imported inside the functions that run them.

A file runs on the native runtime of its kind (onnxruntime's CPU provider for an .onnx), or, for an
ONNX file, on another `runtime` (`--artifact-runtime`, a port stage's `runtime:`): onnxruntime-web's
WebAssembly or WebGPU provider in headless Chromium (harness.backends.onnxruntime_web), as a web
port ships it. The runtime is part of the backend's name (`prebuilt:<runtime>@<absolute path>`),
its version and so of the artifact's cache key, and of the item's id (`artifact-x_onnx@ort-web-wasm`).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..options import ARTIFACT_RUNTIMES as RUNTIMES
from ..options import NATIVE_RUNTIME as NATIVE  # the runtime of the file's kind (KINDS -> REQUIRES)
from ..options import WEB_RUNTIMES  # harness.backends.onnxruntime_web's backends
from ..plumbing.deferred import deferred_import
from ..plumbing.errors import UsageError
from ..plumbing.files import content_key, sha256_file_cached as sha256_file
from . import Backend, get_backend
from .onnx_child import run_onnx
from .onnxruntime_web import NPM_PACKAGE, browser_missing, chromium_version, ort_web_version, side_files, webgpu_missing
from .tvm_library import run_library

# imported at their first use (harness.plumbing.deferred)
ct = deferred_import("coremltools")
et_runtime = deferred_import("executorch.runtime")
onnx = deferred_import("onnx")
tvm = deferred_import("tvm")
relax = deferred_import("tvm.relax")

PREFIX = "prebuilt:"
KINDS = {".pte": "executorch", ".onnx": "onnx", ".so": "tvm", ".dylib": "tvm", ".dll": "tvm",
         ".mlpackage": "coreml", ".mlmodel": "coreml"}
REQUIRES = {"onnx": ("onnxruntime", "onnx"), "executorch": ("executorch",), "tvm": ("tvm",),
            "coreml": ("coremltools",)}


class ArtifactMismatch(ValueError):
    """The artifact's inputs or outputs do not fit what the harness gives it."""


@dataclass(frozen=True)
class Port:
    """One declared input or output of an artifact."""

    name: str | None  # None: the format has no names (.pte)
    shape: tuple | None  # None: unknown; an entry that is not an int is a symbolic (free) axis
    dtype: str | None = None

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


def kind_of(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in KINDS:
        raise UsageError(f"{path}: unknown artifact type {suffix!r}; known: {', '.join(sorted(KINDS))}")
    return KINDS[suffix]


def display_name(path: str | Path, runtime: str = NATIVE) -> str:
    """The backend column of records and item ids: `artifact-<file name>` (dots made underscores,
    so that `-k` selects it), `@<runtime>` after it when the file runs elsewhere than natively."""
    return "artifact-" + Path(path).name.replace(".", "_") + ("" if runtime == NATIVE else f"@{runtime}")


def runtime_problem(path: str | Path, runtime: str) -> str:
    """Why `runtime` cannot run the artifact `path` (an unknown runtime, a browser runtime for a file
    that is not ONNX), or ""."""
    if runtime not in RUNTIMES:
        return f"unknown runtime {runtime!r}; runtimes: {', '.join(RUNTIMES)}"
    kind = KINDS.get(Path(path).suffix.lower())
    if runtime != NATIVE and kind != "onnx":
        return (f"runtime {runtime!r} runs ONNX files (onnxruntime-web); {Path(path).name} is a "
                f"{Path(path).suffix or 'suffix-less'} ({kind or 'unknown'}) artifact, which runs on its native "
                f"runtime")
    return ""


def parse_name(name: str) -> tuple[str, str]:
    """`prebuilt:[<runtime>@]<absolute path>` (a PrebuiltBackend's name) -> (path, runtime)."""
    rest = name[len(PREFIX):]
    head, sep, tail = rest.partition("@")
    return (tail, head) if sep and head in WEB_RUNTIMES else (rest, NATIVE)


def runtimes_for(spec: str, path: str, runtimes) -> list[str]:
    """The runtimes asked (`--artifact-runtime`, default native) that run this artifact: a browser
    runtime runs ONNX files only. ValueError when none does, or a runtime is unknown."""
    runtimes = list(dict.fromkeys(runtimes or (NATIVE,)))
    unknown = [r for r in runtimes if runtime_problem(path, r).startswith("unknown runtime")]
    if unknown:
        raise UsageError(f"--artifact-runtime {unknown[0]}: {runtime_problem(path, unknown[0])}")
    fit = [r for r in runtimes if not runtime_problem(path, r)]
    if not fit:
        raise UsageError(f"--artifact {spec}: {runtime_problem(path, runtimes[0])} (add --artifact-runtime "
                         f"{NATIVE} to run it there)")
    return fit


class PrebuiltBackend(Backend):
    description = "a user's prebuilt artifact (compile = copy of the file)"

    def __init__(self, path: str | Path, runtime: str = NATIVE):
        self.path = Path(path).resolve()
        self.kind = kind_of(self.path)
        problem = runtime_problem(self.path, runtime)
        if problem:
            raise UsageError(f"{self.path}: {problem}")
        self.runtime = runtime
        self.name = PREFIX + ("" if runtime == NATIVE else f"{runtime}@") + str(self.path)
        # a browser runtime reads the ONNX (its input names) and drives Chromium through Playwright
        self.requires = REQUIRES[self.kind] if runtime == NATIVE else ("onnx", "playwright")
        self.run_imports = () if runtime == NATIVE else ("playwright.sync_api", "onnx")
        self.artifact_name = "artifact" + self.path.suffix.lower()
        self.run_audit = {}

    @property
    def display(self) -> str:
        return display_name(self.path, self.runtime)

    def web(self):
        """The onnxruntime-web backend of a browser runtime (its page, its audit of where it ran)."""
        return get_backend(self.runtime)

    def available(self) -> tuple[bool, str]:
        if not self.path.exists():
            return False, f"{self.path} does not exist"
        missing = [p for p in self.requires if importlib.util.find_spec(p) is None]
        if missing:
            extra = "" if self.runtime == NATIVE else " (pip install -e '.[web]')"
            return False, f"package(s) not installed to run a {self.kind} artifact: {', '.join(missing)}{extra}"
        if self.runtime != NATIVE:
            why = browser_missing()
            if why:
                return False, f"runtime {self.runtime}: {why}"
        return True, ""

    def runnable(self) -> tuple[bool, str]:
        if self.kind == "coreml" and platform.system() != "Darwin":
            return False, f"Core ML prediction needs macOS (this is {platform.system()})"
        if self.runtime == "ort-web-webgpu":
            why = webgpu_missing()
            if why:
                return False, f"runtime {self.runtime}: {why}"
        return True, ""

    def version(self) -> str:
        digest = (sha256_file(self.path)[:16] if self.path.is_file() else
                  _tree_digest(self.path) if self.path.is_dir() else "missing")
        if self.kind == "onnx" and self.path.is_file():  # its side files are part of it
            digest += "".join(f"+{sha256_file(self.path.parent / rel)[:16]}" for rel in external_data(self.path)
                              if (self.path.parent / rel).is_file())
        where = ""
        if self.runtime != NATIVE:  # the browser's runtime and the browser: part of the artifact's key
            where = f",runtime={self.runtime},{NPM_PACKAGE}=={ort_web_version()},chromium=={chromium_version()}"
        return f"{super().version()}{where},file={digest}"

    def artifact_key(self, program_key: str = "") -> str:
        """Keyed by the file's content alone: a prebuilt artifact has no program."""
        return content_key("prebuilt", self.kind, self.version())

    def compile(self, program_path: Path, out_dir: Path) -> dict[str, Any]:
        """The copy: `program_path` is the user's file itself."""
        src, dest = Path(program_path), Path(out_dir) / self.artifact_name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dest)
        else:
            shutil.copyfile(src, dest)
        extra = external_data(src) if self.kind == "onnx" else []
        for rel in extra:  # an ONNX's weights in side files, found by their relative location
            (dest.parent / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src.parent / rel, dest.parent / rel)
        return {"artifact": str(self.path), "kind": self.kind, **({"external_data": extra} if extra else {})}

    def run(self, artifact_path: Path, inputs: list) -> list:
        if self.runtime == NATIVE:
            return run_artifact(artifact_path, inputs)
        return self.run_in_browser(artifact_path, inputs)

    def run_in_browser(self, artifact_path: Path, inputs: list) -> list:
        """The file on onnxruntime-web in headless Chromium (harness.backends.onnxruntime_web.run_in_browser):
        inputs in the file's own order, cast to its declared dtypes as onnxruntime's CPU run casts
        them; `run_audit` is the browser backends' (onnxruntime-web, browser, adapter, placement)."""
        ins, _ = describe(artifact_path)
        feed = {}
        for port, t in zip(ins, inputs):
            want = getattr(torch, port.dtype, None) if port.dtype else None  # numpy's names are torch's
            feed[port.name] = t.to(want) if isinstance(want, torch.dtype) else t
        web = self.web()
        outputs = web.run_feed(Path(artifact_path), feed)
        self.run_audit = {"runtime": self.runtime, **web.run_audit}
        return outputs


def external_data(path: Path) -> list[str]:
    """The side files an ONNX keeps its tensors in (`location` of external-data initializers);
    memoized per (path, size, mtime_ns): onnx.load reads the whole file, and every stage run keys it."""
    st = os.stat(path)
    stamp = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if stamp not in _EXTERNAL:
        _EXTERNAL[stamp] = list(side_files(Path(path)))
    return list(_EXTERNAL[stamp])


_EXTERNAL: dict[tuple, list[str]] = {}


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(path.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(path).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


# ---- what the artifact declares ----------------------------------------------------------

_DESCRIBED: dict[tuple, tuple] = {}


def describe(path: str | Path) -> tuple[list[Port], list[Port] | None]:
    """(declared inputs, declared outputs or None when the format does not say), without running;
    memoized per file (path, size, mtime): a port's validation and its stages' runs read it once."""
    st = Path(path).stat()
    stamp = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
    if stamp not in _DESCRIBED:
        _DESCRIBED[stamp] = _describe(path)
    return _DESCRIBED[stamp]


def _describe(path: str | Path) -> tuple[list[Port], list[Port] | None]:
    kind, path = kind_of(path), str(path)
    if kind == "onnx":
        graph = onnx.load(path, load_external_data=False).graph
        init = {i.name for i in graph.initializer}

        def port(v) -> Port:
            t = v.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim)
            dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name if t.elem_type else None
            return Port(v.name, shape if t.HasField("shape") else None, dtype)

        return [port(i) for i in graph.input if i.name not in init], [port(o) for o in graph.output]
    if kind == "executorch":
        meta = et_runtime.Runtime.get().load_program(path).metadata("forward")

        def et_port(info) -> Port:
            return Port(None, tuple(info.sizes()), _et_dtype(str(info.dtype())))

        return ([et_port(meta.input_tensor_meta(i)) for i in range(meta.num_inputs())],
                [et_port(meta.output_tensor_meta(i)) for i in range(meta.num_outputs())])
    if kind == "tvm":
        vm = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
        n = vm._get_function_arity("main")
        return [Port(vm._get_function_param_name("main", i), None) for i in range(n)], None

    spec = ct.utils.load_spec(path)
    ins, outs = ([Port(f.name, tuple(f.type.multiArrayType.shape) or None, _ml_dtype(f.type)) for f in features]
                 for features in (spec.description.input, spec.description.output))
    return ins, outs


_ML_DTYPES = {"FLOAT32": "float32", "FLOAT16": "float16", "DOUBLE": "float64", "INT32": "int32", "INT8": "int8"}


def _ml_dtype(feature_type) -> str | None:
    """A Core ML multi-array's element type as numpy names it: Core ML I/O has no bool or int64, so
    the chain casts to it (text_mask as float32, ids as int32)."""
    if feature_type.WhichOneof("Type") != "multiArrayType":
        return None

    name = ct.proto.FeatureTypes_pb2.ArrayFeatureType.ArrayDataType.Name(feature_type.multiArrayType.dataType)
    return _ML_DTYPES.get(name)


# c10::ScalarType's numbers: ExecuTorch's TensorInfo.dtype() gives the number, not a name
ET_SCALAR_TYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32",
                   7: "float64", 11: "bool", 15: "bfloat16"}


def _et_dtype(name: str) -> str:
    if name.isdigit():
        return ET_SCALAR_TYPES.get(int(name), f"scalar type {name}")
    name = name.split(".")[-1].lower()
    return {"float": "float32", "half": "float16", "long": "int64", "int": "int32", "double": "float64"}.get(name, name)


def describe_job(path: str) -> dict:
    """Job function (child process): a corrupted file crashes or raises there, not in the harness."""
    return describe_as_json(path)


def describe_as_json(path: str | Path) -> dict:
    """`describe` as plain lists (a job's result)."""
    ins, outs = describe(path)
    as_list = lambda ports: None if ports is None else [  # noqa: E731
        [p.name, list(p.shape) if p.shape is not None else None, p.dtype] for p in ports]
    return {"inputs": as_list(ins), "outputs": as_list(outs), "n_outputs": None if outs is None else len(outs)}


def ports_from_job(value: dict) -> tuple[list[Port], list[Port] | None]:
    mk = lambda rows: None if rows is None else [  # noqa: E731
        Port(n, tuple(s) if s is not None else None, d) for n, s, d in rows]
    return mk(value["inputs"]), mk(value["outputs"])


# ---- running (in a child process) ----------------------------------------------------------

def run_artifact(path: str | Path, inputs: list) -> list:
    """Run an artifact on tensors in its own input order (cast to its declared dtypes)."""
    kind, path = kind_of(path), Path(path)
    if kind == "executorch":
        program = et_runtime.Runtime.get().load_program(str(path))
        meta = program.metadata("forward")
        casts = [getattr(torch, _et_dtype(str(meta.input_tensor_meta(i).dtype())), None)
                 for i in range(meta.num_inputs())]
        inputs = [t.to(c) if isinstance(c, torch.dtype) else t for t, c in zip(inputs, casts)]
        return list(program.load_method("forward").execute([t.contiguous() for t in inputs]))
    if kind == "onnx":
        return [torch.from_numpy(o) for o in run_onnx(path, [t.detach().cpu().numpy() for t in inputs])]
    if kind == "tvm":
        return run_library(path, inputs)

    model = ct.models.MLModel(str(path))
    spec = model.get_spec()
    out = model.predict({i.name: t.numpy() for i, t in zip(spec.description.input, inputs)})
    return [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]
