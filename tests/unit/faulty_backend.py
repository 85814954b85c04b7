"""Fault-injection backends: a real backend whose compiled program computes one chosen node wrongly.

They exist to test bisection against a known answer. Registered for tests only, through
`KOKORO_PARITY_EXTRA_BACKENDS="faulty-eager=faulty_backend:FaultyEager"` with tests/unit on
PYTHONPATH; the fault comes from `KOKORO_PARITY_FAULT`, e.g. `node=convolution_3,kind=scale`
(kinds: nan, scale [factor=1.01], sign, shift (one sample along the last axis), jitter [factor=1e-5]:
x + factor * x shifted by one sample, a small error that normalization does not remove), or
`op=aten.transpose.int` instead of `node=` to corrupt every node of one op (errors that accumulate). Without a
fault the backend is its base, clean. The rewrite happens before compiling, on the program's
graph, so the fault exists in every program that contains the node and in no other.
"""
from __future__ import annotations

import inspect
import os
import tempfile
from pathlib import Path

from harness.backends import Backend, get_backend

FAULT_ENV = "KOKORO_PARITY_FAULT"
KINDS = ("nan", "scale", "sign", "shift", "jitter")


def parse_fault(text: str | None) -> list[dict] | None:
    """One fault, or several separated by ';' (a small error upstream of a large one)."""
    if not text:
        return None
    faults = []
    for one in text.split(";"):
        fault = dict(part.split("=", 1) for part in one.split(",") if part)
        if fault.get("kind") not in KINDS or not ({"node", "op"} & set(fault)):
            raise ValueError(f"{FAULT_ENV}={text!r}: want node=<name> or op=<aten op>, and kind= one of {KINDS}")
        faults.append(fault)
    return faults


def insert_fault(program, fault: dict):
    """Corrupt, in place, the output of the node named fault['node'] (or of every float node whose
    op is fault['op']) in the program's graph; the program stays a valid ExportedProgram (no
    re-export: quick, and the names stay). Uses only torch, so a repro bundle can carry this
    function as its 'backend bug'."""
    import torch

    graph = program.graph_module.graph

    def chosen(n):
        val = n.meta.get("val")
        return (n.op == "call_function" and isinstance(val, torch.Tensor) and val.is_floating_point()
                and (n.name == fault.get("node") or str(n.target) == fault.get("op")))

    targets = [n for n in graph.nodes if chosen(n)]
    aten = torch.ops.aten
    renamed = {}
    for n in targets:
        kind = fault["kind"]
        with graph.inserting_after(n):
            if kind == "nan":
                bad = graph.call_function(aten.mul.Tensor, (n, float("nan")))
            elif kind == "scale":
                bad = graph.call_function(aten.mul.Tensor, (n, float(fault.get("factor", 1.01))))
            elif kind == "sign":
                bad = graph.call_function(aten.neg.default, (n,))
            else:  # shift, jitter
                bad = graph.call_function(aten.roll.default, (n, [1], [-1]))
        if kind == "jitter":
            with graph.inserting_after(bad):
                bad = graph.call_function(aten.add.Tensor, (n, bad), {"alpha": float(fault.get("factor", 1e-5))})
        for new in (bad, *bad.all_input_nodes):
            if new is not n:
                new.meta["val"] = n.meta["val"]  # same shape and dtype
        mine = {bad, *bad.all_input_nodes} - {n}
        n.replace_all_uses_with(bad, delete_user_cb=lambda user, mine=mine: user not in mine)
        renamed[n.name] = bad.name
    for spec in program.graph_signature.output_specs:  # a corrupted program output
        if getattr(spec.arg, "name", None) in renamed:
            spec.arg.name = renamed[spec.arg.name]
    program.graph_module.recompile()
    return program


class _Faulty(Backend):
    base = ""
    fault_env = FAULT_ENV

    def __init__(self) -> None:
        self._base = get_backend(self.base)

    def available(self):
        return self._base.available()

    def version(self) -> str:
        return f"{self._base.version()}+fault[{os.environ.get(self.fault_env, '')}]"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        import torch

        fault = parse_fault(os.environ.get(self.fault_env))
        if fault is None:
            return self._base.compile(program_path, out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            faulty = Path(tmp) / "program.pt2"
            program = torch.export.load(str(program_path))
            for one in fault:
                program = insert_fault(program, one)
            torch.export.save(program, str(faulty))
            audit = self._base.compile(faulty, out_dir)
        return {**(audit or {}), "injected_fault": fault}

    def run(self, artifact_path: Path, inputs: list) -> list:
        return self._base.run(artifact_path, inputs)

    def repro_source(self) -> str:
        """The `run_backend(program, inputs)` of a standalone repro: the fault, then the base."""
        base = self._base.repro_source().replace("def run_backend(", "def run_base_backend(")
        fault = parse_fault(os.environ.get(self.fault_env))
        return (f"{inspect.getsource(insert_fault)}\n\n{base}\n\nFAULT = {fault!r}\n\n\n"
                "def run_backend(program, inputs):\n"
                "    \"\"\"The 'backend bug' of this test backend: one node computed wrongly.\"\"\"\n"
                "    for one in FAULT or []:\n"
                "        program = insert_fault(program, one)\n"
                "    return run_base_backend(program, inputs)\n")


def faulty(base: str, prefix: str = "faulty", fault_env: str = FAULT_ENV) -> type[_Faulty]:
    """The test backend `faulty-<base>`: the registered backend `base` with one node corrupted."""
    b = type(get_backend(base))
    return type(f"{prefix.title()}_{base.replace('-', '_')}", (_Faulty,), {
        "name": f"{prefix}-{base}", "base": base, "fault_env": fault_env, "requires": b.requires,
        "patches": b.patches, "artifact_name": b.artifact_name, "run_requires": b.run_requires,
        "description": f"TEST ONLY: {base} with one node corrupted (${fault_env})"})


# a second build of eager with only "the runtime's own deviation" ($KOKORO_PARITY_BAND_FAULT): the
# band a bisection of faulty-eager is judged against (`--band-from band-eager`)
BAND_FAULT_ENV = "KOKORO_PARITY_BAND_FAULT"
BASES = {"eager": "FaultyEager", "xnnpack": "FaultyXnnpack", "portable": "FaultyPortable",
         "onnxruntime": "FaultyOnnxruntime", "tvm": "FaultyTvm"}
EXTRA = ",".join([*(f"faulty-{b}=tests.unit.faulty_backend:{cls}" for b, cls in BASES.items()),
                  "band-eager=tests.unit.faulty_backend:BandEager"])  # the registry's value
_CLASSES = {**{cls: (b, "faulty", FAULT_ENV) for b, cls in BASES.items()},
            "BandEager": ("eager", "band", BAND_FAULT_ENV)}


def __getattr__(name: str):
    """FaultyEager, FaultyXnnpack, ..., BandEager: each built on its first use, since building one
    imports its base backend (XNNPACK's and the portable one import ExecuTorch: seconds) and a
    process (a test, a worker of one backend) uses one or two of them."""
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    cls = globals()[name] = faulty(*_CLASSES[name])
    return cls
