"""`--artifact STEP=PATH`: judge an artifact a user already has against the references of a step.

A port rarely goes through our exporter: people bring their own `.pte`, `.onnx`, TVM library
(`.so`) or `.mlpackage`. We read the inputs the artifact declares, map the step's inputs onto
them by name (else by position) and check shapes, run it in a child process like any backend,
and judge the outputs with the same references and verdicts. A misfit is a clear error, not a
wrong comparison.
"""
from __future__ import annotations

import platform
import re
from dataclasses import dataclass
from pathlib import Path

KINDS = {".pte": "executorch", ".onnx": "onnx", ".so": "tvm", ".dylib": "tvm", ".dll": "tvm",
         ".mlpackage": "coreml", ".mlmodel": "coreml"}


class ArtifactMismatch(ValueError):
    """The artifact's inputs or outputs do not fit the step's."""


@dataclass(frozen=True)
class Port:
    name: str | None  # None: the format has no names (.pte)
    shape: tuple | None  # None: unknown; an entry that is not an int is a symbolic (free) axis
    dtype: str | None = None


@dataclass(frozen=True)
class ArtifactItem:
    """A (case, step, artifact, mode) item: what `--artifact STEP=PATH` adds to a run."""

    case: str
    step: str
    path: str
    mode: str

    @property
    def backend(self) -> str:
        return "artifact-" + Path(self.path).name.replace(".", "_")

    @property
    def id(self) -> str:
        from .record import item_id

        return item_id(self.case, self.step, self.backend, self.mode)


def parse_spec(spec: str) -> tuple[str, str]:
    """"STEP=PATH" -> (step, path), checking both."""
    from .steps import STEP_NAMES

    step, sep, path = spec.partition("=")
    if not sep or not step or not path:
        raise ValueError(f"--artifact {spec!r}: expected STEP=PATH, e.g. decoder=kokoro_decoder.onnx")
    if step not in STEP_NAMES:
        raise ValueError(f"--artifact {spec!r}: unknown step {step!r}; steps: {', '.join(STEP_NAMES)}")
    if not Path(path).exists():
        raise FileNotFoundError(f"--artifact {spec!r}: {path} does not exist")
    kind_of(path)
    return step, path


def kind_of(path: str | Path) -> str:
    suffix = Path(path).suffix.lower()
    if suffix not in KINDS:
        raise ValueError(f"{path}: unknown artifact type {suffix!r}; known: {', '.join(sorted(KINDS))}")
    return KINDS[suffix]


# ---- what the artifact declares ----------------------------------------------------------

def describe(path: str | Path) -> tuple[list[Port], int | None]:
    """(declared inputs, number of outputs or None) of an artifact, without running it."""
    kind, path = kind_of(path), str(path)
    if kind == "onnx":
        import onnx

        graph = onnx.load(path, load_external_data=False).graph
        init = {i.name for i in graph.initializer}
        ports = []
        for i in graph.input:
            if i.name in init:
                continue
            t = i.type.tensor_type
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim)
            ports.append(Port(i.name, shape, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name))
        return ports, len(graph.output)
    if kind == "executorch":
        from executorch.runtime import Runtime

        meta = Runtime.get().load_program(path).metadata("forward")
        ports = []
        for i in range(meta.num_inputs()):
            info = meta.input_tensor_meta(i)
            ports.append(Port(None, tuple(info.sizes()), str(info.dtype()).split(".")[-1].lower()))
        return ports, meta.num_outputs()
    if kind == "tvm":
        import tvm
        from tvm import relax

        vm = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
        n = vm._get_function_arity("main")
        return [Port(vm._get_function_param_name("main", i), None) for i in range(n)], None
    import coremltools as ct

    spec = ct.utils.load_spec(path)
    ports = []
    for i in spec.description.input:
        shape = tuple(i.type.multiArrayType.shape) or None
        ports.append(Port(i.name, shape))
    return ports, len(spec.description.output)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def map_inputs(ports: list[Port], inputs: dict, where: str = "") -> list[str]:
    """The step input name for each artifact input, by name (exact, then case- and punctuation-
    insensitive), else by position when the counts agree; shapes checked where declared."""
    names = list(inputs)
    if len(ports) != len(names):
        raise ArtifactMismatch(
            f"{where}the artifact takes {len(ports)} inputs {[p.name or f'#{i}' for i, p in enumerate(ports)]}, "
            f"the step gives {len(names)} {names}")
    by_norm = {_norm(n): n for n in names}
    mapped = [p.name if p.name in inputs else by_norm.get(_norm(p.name)) if p.name else None for p in ports]
    if None in mapped or len(set(mapped)) != len(mapped):
        mapped = names  # positional: the only rule left when names are absent or foreign
    for port, name in zip(ports, mapped):
        shape = tuple(inputs[name].shape)
        if port.shape is None:
            continue
        fits = len(port.shape) == len(shape) and all(not isinstance(a, int) or a in (b, -1)
                                                       for a, b in zip(port.shape, shape))
        if not fits:
            label = port.name or f"#{ports.index(port)}"
            raise ArtifactMismatch(f"{where}artifact input {label!r} has shape {list(port.shape)}, the step's "
                                   f"{name!r} has {list(shape)}")
    return mapped


# ---- running (in a child process) ----------------------------------------------------------

def run_artifact(path: str | Path, inputs: list) -> list:
    """Run an artifact on tensors in its own input order; outputs as float32/int torch tensors."""
    import numpy as np
    import torch

    kind, path = kind_of(path), Path(path)
    if kind == "executorch":
        from executorch.runtime import Runtime

        program = Runtime.get().load_program(str(path))
        meta = program.metadata("forward")
        casts = [_torch_dtype(str(meta.input_tensor_meta(i).dtype())) for i in range(meta.num_inputs())]
        inputs = [t.to(c) if c is not None else t for t, c in zip(inputs, casts)]
        return list(program.load_method("forward").execute([t.contiguous() for t in inputs]))
    if kind == "onnx":
        import onnxruntime as ort

        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feed = {}
        for port, t in zip(sess.get_inputs(), inputs):
            want = {"tensor(float16)": np.float16, "tensor(int32)": np.int32, "tensor(float)": np.float32,
                    "tensor(int64)": np.int64, "tensor(bool)": np.bool_}.get(port.type)
            a = t.detach().cpu().numpy()
            feed[port.name] = a.astype(want) if want is not None else a
        return [torch.from_numpy(np.asarray(o)) for o in sess.run(None, feed)]
    if kind == "tvm":
        from .backends.tvm import run_library

        return run_library(path, inputs)
    import coremltools as ct

    model = ct.models.MLModel(str(path))
    spec = model.get_spec()
    out = model.predict({i.name: t.numpy() for i, t in zip(spec.description.input, inputs)})
    return [torch.from_numpy(np.asarray(out[o.name])) for o in spec.description.output]


def _torch_dtype(name: str):
    import torch

    return {"float": torch.float32, "half": torch.float16, "long": torch.int64, "int": torch.int32,
            "bool": torch.bool}.get(name.split(".")[-1].lower())


def run_job(path: str, inputs_path: str, outputs_path: str) -> dict:
    """Job function: run the artifact on saved inputs, save its outputs."""
    import time

    import torch

    inputs = torch.load(inputs_path, weights_only=True)
    start = time.perf_counter()
    outputs = run_artifact(path, inputs)
    seconds = time.perf_counter() - start
    torch.save([torch.as_tensor(o).detach().clone().float() if torch.as_tensor(o).is_floating_point()
                else torch.as_tensor(o) for o in outputs], outputs_path)
    return {"run_s": seconds, "n_outputs": len(outputs)}


def describe_job(path: str) -> dict:
    ports, n_out = describe(path)
    return {"inputs": [[p.name, list(p.shape) if p.shape is not None else None, p.dtype] for p in ports],
            "n_outputs": n_out}


# ---- one item -----------------------------------------------------------------------------

def check_artifact(session, item: ArtifactItem):
    """Judge `item.path` against the references of its step: a Record like any backend's."""
    import torch

    from .patches import canonical
    from .plumbing.files import save_tensors
    from .plumbing.jobs import run_job as run_in_child
    from .runner import Item, Resolved, failed
    from .steps import get_step
    from .verdict import Verdict

    rec = session.new_record(item, list(canonical(session.extra_patches)), None)
    rec.audit = {"artifact": str(Path(item.path).resolve()), "kind": kind_of(item.path)}
    kind = kind_of(item.path)
    if kind == "coreml" and platform.system() != "Darwin":
        rec.reason = f"Core ML prediction needs macOS (this is {platform.system()})"
        return _write(session, rec)
    run_dir = session.report_dir / "runs" / item.id
    described = run_in_child("harness.artifacts:describe_job", dict(path=str(item.path)), run_dir / "describe",
                             session.limits.run_s)
    if not described.ok:
        failed(rec, described, Verdict.RUN_ERROR)
        return _write(session, rec)
    ports = [Port(n, tuple(s) if s is not None else None, d) for n, s, d in described.value["inputs"]]
    traces = session.traces(item.case)
    step = get_step(item.step)
    try:
        mapped = _map_for_mode(session, traces, item, ports)
    except ArtifactMismatch as e:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, f"artifact does not fit step {item.step!r}: {e}"
        return _write(session, rec)
    if mapped is None:
        other = "static" if item.mode == "dynamic" else "dynamic"
        rec.reason = f"the artifact's input shapes fit the {other} mode, not {item.mode}"
        return _write(session, rec)
    n_out = described.value["n_outputs"]
    if n_out is not None and n_out != len(step.output_names):
        rec.verdict = Verdict.RUN_ERROR
        rec.reason = f"artifact does not fit step {item.step!r}: {n_out} outputs, the step has {step.output_names}"
        return _write(session, rec)
    rec.audit["input_mapping"] = dict(zip([p.name or f"#{i}" for i, p in enumerate(ports)], mapped))
    inputs = traces.inputs(item.step, item.mode, "float32")
    save_tensors(run_dir / "inputs.pt", {n: inputs[n] for n in mapped})
    result = run_in_child("harness.artifacts:run_job",
                          dict(path=str(item.path), inputs_path=str(run_dir / "inputs.pt"),
                               outputs_path=str(run_dir / "outputs.pt")), run_dir, session.limits.run_s)
    rec.timings["run_s"] = result.value["run_s"] if result.ok else result.seconds
    rec.peak_rss_mb["run"] = result.peak_rss_mb
    rec.artifact_bytes = _size(Path(item.path))
    if not result.ok:
        failed(rec, result, Verdict.RUN_ERROR)
        return _write(session, rec)
    outputs = torch.load(run_dir / "outputs.pt", weights_only=True)
    resolved = Resolved(Item(item.case, item.step, item.backend, item.mode), step, session.cases[item.case], traces,
                        None, rec.patches)
    return _write(session, session.judge(rec, resolved, outputs))


def _map_for_mode(session, traces, item: ArtifactItem, ports: list[Port]) -> list[str] | None:
    """The mapping for the item's mode; None when only the other mode's shapes fit."""
    where = f"case {item.case!r}, {item.mode}: "
    try:
        return map_inputs(ports, traces.inputs(item.step, item.mode, "float32"), where)
    except ArtifactMismatch as mismatch:
        other = "static" if item.mode == "dynamic" else "dynamic"
        try:
            map_inputs(ports, traces.inputs(item.step, other, "float32"))
        except ArtifactMismatch:
            raise mismatch from None
        return None


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def _write(session, rec):
    return session.finish(rec)


def artifact_items(session, specs: list[str], modes) -> list[ArtifactItem]:
    items = []
    for spec in specs:
        step, path = parse_spec(spec)
        items += [ArtifactItem(c, step, path, m) for c in session.cases for m in modes]
    return items
