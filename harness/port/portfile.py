"""`port.yaml`: a port as an ordered list of stages, each an artifact whose inputs and outputs are
mapped to Kokoro tensors (harness/port/tensors.py). `load_port` validates the file whole before any
work starts and raises ONE `PortError` naming the file, the stage and the field.

    name: kokoro-int8
    stages:
      - name: whole
        artifact: kokoro-v1.0.int8.onnx   # relative to this file; or synth_{frames}.onnx + buckets
        precision: int8                   # optional: the profile's `step: int8` overrides apply
        runtime: ort-web-wasm             # optional: native (default) | ort-web-wasm | ort-web-webgpu (ONNX only)
        noise: own                        # optional: own | inputs | none (found when not given)
        inputs:  {tokens: input_ids, style: ref_s, speed: speed}
        outputs: {audio: audio}           # or {audio: {tensor: audio, dtype: int16}}

The host glue between stages is the harness's own reference code, or a user callable
(`glue: package.module:function`, per port for a Kokoro tensor or per stage input) where the port's
host code differs (another alignment rule, its own bucket choice).

A stage may name a harness step instead of an artifact (`step: synthesizer`): the harness exports
and compiles it for the item's backend. The `e2e` item is such a port (harness/data/ports/e2e.yaml):

    - name: synthesizer
      step: synthesizer                 # harness/steps.py; inputs and outputs are its own names
      buckets: {tokens: case, frames: [120, 200, 400, 1200, 1600]}   # static mode only; `case`: the case's

The whole-model file (`--artifact e2e=PATH`) is a one-stage port built by `guess_port`;
`--artifact STEP=PATH` a one-stage port whose boundaries are a step's.
"""
from __future__ import annotations

import importlib
import itertools
import re
import sys
from pathlib import Path
from typing import Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from . import tensors
from .matching import by_shape, family, is_int8
from .noise import stage_noise
from ..backends.prebuilt import NATIVE, RUNTIMES, describe, kind_of, runtime_problem
from ..steps import STAGES, STEPS, get_step
from ..plumbing.errors import UsageError

# What the case gives a port's first stage, and what the host glue derives between stages
# (the harness's own reference code: steps.build_alignment, the matmuls of run_chain).
CASE_TENSORS = ("input_ids", "input_lengths", "text_mask", "attention_mask", "ref_s", "s_pred", "s_dec",
                "speed", *tensors.NOISE)
HOST_GLUE = {"pred_dur": ("duration",), "aln": ("pred_dur",), "frame_lengths": ("pred_dur",),
             "en": ("d", "aln"), "asr": ("t_en", "aln")}


class PortError(UsageError):
    """A port file (or an artifact's declared inputs and outputs) that cannot be run."""


GLUE_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# the units a bucket can be in (`{frames}` or `{tokens}` in the file name), and the axis units of
# the vocabulary that scale with it: unit -> length in the bucket's unit
BUCKET_UNITS = {"frames": {"frames": 1, "frames2": 2, "samples": 600}, "tokens": {"tokens": 1}}


class TensorRef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tensor: str
    dtype: str | None = None  # the artifact's side, when it differs from the vocabulary's (float16, int32)
    glue: str | None = None  # a stage input computed by the user's host code: `package.module:function`

    @field_validator("tensor")
    @classmethod
    def _known(cls, v: str) -> str:
        if not tensors.known(v):
            raise UsageError(f"unknown Kokoro tensor {v!r}; known: {', '.join(tensors.VOCAB)} or a module "
                             f"path `module.path:out`")
        return v


def _ref(v):
    return {"tensor": v} if isinstance(v, str) else v  # anything else: pydantic names what it is


class StageSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    artifact: str | None = None  # a prebuilt file (relative to the port file) ...
    step: str | None = None  # ... or a harness step (harness/steps.py) exported and compiled for the item's backend
    # [sizes] with `{frames}` (or `{tokens}`) in `artifact`, or per unit: {tokens: case, frames: [...]}
    # (`case`: the case file's own bucket); a `step:` stage is bucketed in static mode only
    buckets: list[int] | dict[str, list[int] | Literal["case"]] | None = None
    precision: Literal["float32", "float16", "int8"] = "float32"
    # what runs the artifact: `native` (the runtime of its kind: onnxruntime CPU for an .onnx) or, for an
    # ONNX, onnxruntime-web in headless Chromium (harness.backends.prebuilt.RUNTIMES); checked by validate
    runtime: str = "native"
    # own (draws its own: the noise band) | inputs (noise is an input) | none (draws none); when the
    # file says nothing, found from the stage by load_port (harness.port.noise.stage_noise)
    noise: Literal["own", "inputs", "none"] | None = None
    # a .pte's ETRecord (relative to the port file; default: `<artifact stem>.etrecord` beside it):
    # `--bisect` localizes inside the stage through ExecuTorch's ETDump (harness.port.pte_stages)
    etrecord: str | None = None
    inputs: dict[str, TensorRef]
    outputs: dict[str, TensorRef]

    @field_validator("inputs", "outputs", mode="before")
    @classmethod
    def _refs(cls, v):
        return {k: _ref(x) for k, x in v.items()} if isinstance(v, dict) else ({} if v is None else v)

    @property
    def bucket_unit(self) -> str | None:
        """`tokens` when the file name holds `{tokens}`, else `frames` (for a bucketed stage); with
        buckets per unit, the first unit."""
        if not self.buckets:
            return None
        if isinstance(self.buckets, dict):
            return next(iter(self.buckets))
        return "tokens" if "{tokens}" in (self.artifact or "") else "frames"

    @property
    def bucket_units(self) -> dict[str, list[int] | str]:
        """unit -> its sizes (or `case`): the list form's one unit, or the per-unit mapping."""
        if not self.buckets:
            return {}
        return dict(self.buckets) if isinstance(self.buckets, dict) else {self.bucket_unit: list(self.buckets)}

    def files(self, root: Path) -> list[Path]:
        if self.artifact is None:
            return []
        if self.buckets:
            units = {u: s for u, s in self.bucket_units.items() if s != "case"}
            return [root / self.artifact.format(**dict(zip(units, sizes)), **{u: 0 for u in BUCKET_UNITS
                                                                               if u not in units})
                    for sizes in itertools.product(*units.values())]
        return [root / self.artifact]

    def bucket_for(self, size: int, unit: str | None = None) -> int:
        """The smallest bucket that holds `size` (in `unit`, by default the bucket's unit)."""
        unit = unit or self.bucket_unit
        sizes = self.bucket_units.get(unit) or ()
        fits = [b for b in sorted(sizes) if b >= size]
        if not fits:
            raise PortError(f"stage {self.name!r}, field 'buckets': {size} {unit} exceed the largest "
                            f"bucket {max(sizes) if sizes else '(none)'}")
        return fits[0]

    def etrecord_for(self, root: Path) -> Path | None:
        """The stage's ETRecord: its `etrecord:` field, else `<artifact stem>.etrecord` beside a .pte."""
        if self.etrecord is not None:
            return root / self.etrecord
        beside = (root / self.artifact).with_suffix(".etrecord") if (self.artifact or "").endswith(".pte") else None
        return beside if beside is not None and beside.is_file() else None

    def file_for(self, root: Path, bucket: int | dict[str, int] | None = None) -> Path:
        """The artifact of `bucket` (a size from `bucket_for`, or {unit: size}), or the stage's one file."""
        if self.artifact is None:
            raise PortError(f"stage {self.name!r}, field 'artifact': the stage runs the harness step {self.step!r}")
        if not self.buckets:
            return root / self.artifact
        if bucket is None:
            raise PortError(f"stage {self.name!r}, field 'buckets': a bucketed stage runs one bucket at a time")
        sizes = bucket if isinstance(bucket, dict) else {self.bucket_unit: bucket}
        return root / self.artifact.format(**{u: sizes.get(u, 0) for u in BUCKET_UNITS})


class PortSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    glue: dict[str, str] = Field(default_factory=dict)  # Kokoro tensor -> `package.module:function`
    stages: list[StageSpec] = Field(min_length=1)

    @field_validator("glue")
    @classmethod
    def _glue_tensors(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not tensors.known(name):
                raise UsageError(f"glue for unknown Kokoro tensor {name!r}; known: {', '.join(tensors.VOCAB)}")
        return v


class Port:
    """A validated port: its spec, the directory its artifact paths are relative to, its file."""

    def __init__(self, spec: PortSpec, root: Path, source: str):
        self.spec, self.root, self.source = spec, Path(root), source
        self.found_noise: set[str] = set()  # the stages whose noise rule was found, not given

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def stages(self) -> list[StageSpec]:
        return self.spec.stages

    def glue_for(self, ref: TensorRef) -> str | None:
        """The user callable that computes this stage input, if any: the input's own `glue`, else
        the port's for its tensor."""
        return ref.glue or self.spec.glue.get(ref.tensor)


def resolve_glue(spec: str, root: Path | None = None) -> Callable:
    """`package.module:function` -> the function, importable from the environment or from the
    port file's directory; ValueError saying why not."""
    if not GLUE_SPEC.match(spec):
        raise UsageError(f"{spec!r} is not `package.module:function`")
    module_name, _, attr = spec.partition(":")
    added = root is not None and str(root) not in sys.path
    if added:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # noqa: BLE001 - any import failure: one clear error
        raise UsageError(f"cannot import {module_name!r} ({type(e).__name__}: {e})") from None
    finally:
        if added:
            sys.path.remove(str(root))
    fn = getattr(module, attr, None)
    if fn is None:
        raise UsageError(f"module {module_name!r} has no {attr!r}")
    if not callable(fn):
        raise UsageError(f"{spec!r} is a {type(fn).__name__}, not a callable")
    return fn


def _where(source: str, stage: str | None, field: str) -> str:
    return f"port {source}" + (f", stage {stage!r}" if stage else "") + f", field {field!r}"


# ---- pydantic's errors in the port file's terms: one line naming the file, the stage, the field ----

def validation_message(source: str, data, e: ValidationError) -> str:
    """The first mistake of the file (for a union such as `buckets`, the branch the value's type
    picks) as `port FILE, stage 'S', field 'F': what was expected, got what`."""
    errors = e.errors()
    err = next((x for x in errors if _branch_fits(data, x["loc"])), errors[0])
    loc, stage = list(err["loc"]), None
    if len(loc) > 1 and loc[0] == "stages" and isinstance(loc[1], int):
        entry = _follow(data, loc[:2])
        name = entry.get("name") if isinstance(entry, dict) else None
        stage = name if isinstance(name, str) and name else f"#{loc[1]}"
        loc = loc[2:]
    as_key = "[key]" in loc
    # pydantic's union tags (`list[int]`) are not fields of the file, nor a tensor reference's `tensor`
    parts = [str(x) for x in loc if not _is_tag(x)]
    if len(parts) >= 3 and parts[-1] == "tensor" and parts[0] in ("inputs", "outputs"):
        parts = parts[:-1]
    field = ".".join(parts) or ("(stage)" if stage else "(top)")
    return f"{_where(source, stage, field)}: {_expected(err, parts, as_key, stage is not None)}"


def _is_tag(x) -> bool:
    return isinstance(x, str) and "[" in x


def _follow(data, loc):
    """The file's value at a pydantic location (tags skipped), or None."""
    for x in loc:
        if _is_tag(x):
            continue
        if isinstance(data, dict) and x in data:
            data = data[x]
        elif isinstance(data, list) and isinstance(x, int) and x < len(data):
            data = data[x]
        else:
            return None
    return data


def _branch_fits(data, loc) -> bool:
    """Whether every union branch along `loc` is the one the file's value there has the type of."""
    for i, x in enumerate(loc):
        if _is_tag(x) and x != "[key]":
            value = _follow(data, loc[:i])
            kind = {list: "list", dict: "dict", str: "literal", int: "int"}.get(type(value))
            if kind is None or not x.startswith(kind):
                return False
    return True


def _got(v) -> str:
    if v is None:
        return "nothing"
    text = repr(v) if len(repr(v)) <= 40 else repr(v)[:37] + "..."
    what = ("true/false" if isinstance(v, bool) else "a number" if isinstance(v, (int, float)) else "text"
            if isinstance(v, str) else "a list" if isinstance(v, list) else "a mapping" if isinstance(v, dict)
            else type(v).__name__)
    return f"{what} {text}" if isinstance(v, (list, dict)) else f"{text} ({what})"


FIELDS = {"(top)": "name, glue, stages",
          "stage": "name, artifact, step, buckets, precision, runtime, noise, inputs, outputs",
          "tensor": "tensor, dtype, glue"}


def _expected(err: dict, parts: list[str], as_key: bool, in_stage: bool) -> str:
    kind, value = err["type"], err.get("input")
    if parts == ["buckets"] and kind in ("list_type", "dict_type"):
        return f"expected a list of sizes or a mapping {{unit: sizes}}, got {_got(value)}"
    ref = len(parts) == 2 and parts[0] in ("inputs", "outputs")  # `inputs.x`: a tensor reference
    if kind == "value_error":
        return err["msg"].removeprefix("Value error, ")
    if kind == "missing":
        return "missing (required)"
    if kind == "extra_forbidden":
        level = "tensor" if len(parts) == 3 and parts[0] in ("inputs", "outputs") else \
            "stage" if len(parts) == 1 and parts[0] not in FIELDS["(top)"].split(", ") else "(top)"
        return f"unknown field {parts[-1]!r}; the fields here are: {FIELDS[level]}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        want = ("a Kokoro tensor name, or a mapping {tensor: NAME, dtype: ..., glue: ...}" if ref
                else "a mapping of names to Kokoro tensors" if parts and parts[-1] in ("inputs", "outputs")
                else "a stage: a mapping (name:, artifact:, inputs:, outputs:)" if not parts and in_stage
                else "a port: a mapping (name:, stages:)" if not parts
                else "a mapping of Kokoro tensors to `package.module:function`" if parts == ["glue"]
                else "a mapping")
        return f"expected {want}, got {_got(value)}"
    if kind == "list_type":
        return f"expected a list, got {_got(value)}"
    if kind == "string_type":
        return f"expected a name (text){' as the key' if as_key else ''}, got {_got(value)}"
    msg = err["msg"].replace("Input should be", "expected")
    return f"{msg}, got {_got(value)}"


def load_port(path: str | Path, describe_artifacts: bool = True) -> Port:
    """Read and validate a port file whole; one PortError naming file, stage and field."""
    path = Path(path)
    if not path.is_file():
        raise PortError(f"port {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PortError(f"port {path}: not valid YAML ({' '.join(str(e).split())})") from None
    try:
        spec = PortSpec.model_validate(data)
    except ValidationError as e:
        raise PortError(validation_message(str(path), data, e)) from None
    port = Port(spec, path.parent, str(path))
    validate(port, describe_artifacts)
    for stage in port.stages:  # `noise:` only overrides: a stage without it has its rule found
        if stage.noise is None:
            stage.noise = stage_noise(stage, port.root)
            port.found_noise.add(stage.name)
    return port


def validate(port: Port, describe_artifacts: bool = True) -> None:
    """Files exist, the chain connects (the first stage takes any reference tensor: a port may
    start anywhere in Kokoro; each later one what the case, the earlier stages or the host glue
    give), and (with `describe_artifacts`) every declared input and
    output of each artifact is mapped, with a rank and dtype family that agree with the vocabulary."""
    # the durations: a stage's own `duration` when one outputs it, else the reference's (host glue)
    available = {*CASE_TENSORS, "pred_dur"}
    names = [s.name for s in port.stages]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PortError(f"{_where(port.source, sorted(dup)[0], 'name')}: stage names must be unique")
    for name, spec in port.spec.glue.items():
        _check_glue(port, None, f"glue.{name}", spec)
    available |= set(port.spec.glue)  # the user's host glue computes them
    for stage in port.stages:
        _check_source(port, stage)
        _check_runtime(port, stage)
        for side, refs in (("inputs", stage.inputs), ("outputs", stage.outputs)):
            for io_name, ref in refs.items():
                why = tensors.unknown_module(ref.tensor) if tensors.MODULE_REF.match(ref.tensor) else None
                if why:
                    raise PortError(f"{_where(port.source, stage.name, f'{side}.{io_name}')}: {ref.tensor!r}: {why}")
                if ref.glue is not None:
                    if side == "outputs":
                        raise PortError(f"{_where(port.source, stage.name, f'outputs.{io_name}.glue')}: glue "
                                        f"computes a stage's input; an output comes from the artifact")
                    _check_glue(port, stage.name, f"inputs.{io_name}.glue", ref.glue)
        _check_buckets(port, stage)
        _check_etrecord(port, stage)
        for f in stage.files(port.root):
            if not f.exists():
                raise PortError(f"{_where(port.source, stage.name, 'artifact')}: {f} does not exist")
        for io_name, ref in stage.inputs.items():
            if ref.glue is None and stage is not port.stages[0] and not _producible(ref.tensor, available):
                raise PortError(f"{_where(port.source, stage.name, f'inputs.{io_name}')}: {ref.tensor!r} is "
                                f"neither given by the case nor produced by an earlier stage or the host glue "
                                f"(the chain does not connect)")
        available |= {r.tensor for r in stage.outputs.values()}
        if describe_artifacts and stage.artifact is not None:
            check_declared(port, stage)


def _check_source(port: Port, stage: StageSpec) -> None:
    """`artifact:` or `step:`, not both; a step's inputs and outputs are exactly its own names,
    mapped to Kokoro tensors in Kokoro's own dtypes (the harness exports it)."""
    if (stage.artifact is None) == (stage.step is None):
        raise PortError(f"{_where(port.source, stage.name, 'artifact')}: give either `artifact:` (a prebuilt "
                        f"file) or `step:` (a harness step), not " + ("both" if stage.artifact else "neither"))
    if stage.step is None:
        return
    try:
        step = get_step(stage.step)
    except KeyError:
        raise PortError(f"{_where(port.source, stage.name, 'step')}: unknown harness step {stage.step!r}; steps: "
                        f"{', '.join(s.name for s in (*STEPS, *STAGES))}") from None
    for side, refs, names in (("inputs", stage.inputs, step.input_names), ("outputs", stage.outputs,
                                                                             step.output_names)):
        if set(refs) != set(names):
            extra, missing = sorted(set(refs) - set(names)), [n for n in names if n not in refs]
            raise PortError(f"{_where(port.source, stage.name, side)}: step {step.name!r} has {side} "
                            f"{', '.join(names)}" + (f"; not its {side}: {', '.join(extra)}" if extra else "")
                            + (f"; unmapped: {', '.join(missing)}" if missing else ""))
        for io_name, ref in refs.items():
            if ref.dtype is not None:
                raise PortError(f"{_where(port.source, stage.name, f'{side}.{io_name}.dtype')}: a harness step "
                                f"takes and gives Kokoro's own dtypes")
    if stage.buckets is not None and not isinstance(stage.buckets, dict):
        raise PortError(f"{_where(port.source, stage.name, 'buckets')}: a step stage names the unit of its "
                        f"buckets, e.g. `{{frames: [120, 200]}}` or `{{tokens: case}}`")


def _check_etrecord(port: Port, stage: StageSpec) -> None:
    """`etrecord:` belongs to a single `.pte` stage, and the file exists."""
    if stage.etrecord is None:
        return
    where = _where(port.source, stage.name, "etrecord")
    if not (stage.artifact or "").endswith(".pte") or stage.buckets:
        raise PortError(f"{where}: an ETRecord belongs to a single .pte artifact, not to "
                        f"{stage.artifact or 'step: ' + str(stage.step)!r}")
    if not (port.root / stage.etrecord).is_file():
        raise PortError(f"{where}: {port.root / stage.etrecord} does not exist")


def _check_runtime(port: Port, stage: StageSpec) -> None:
    """`runtime:` is one the harness knows, for an artifact whose kind it runs (a browser runtime:
    ONNX files only); a `step:` stage runs on the item's backend, so names none."""
    where = _where(port.source, stage.name, "runtime")
    if stage.runtime not in RUNTIMES:
        raise PortError(f"{where}: unknown runtime {stage.runtime!r}; runtimes: {', '.join(RUNTIMES)}")
    if stage.runtime == NATIVE:
        return
    if stage.step is not None:
        raise PortError(f"{where}: a `step:` stage runs on the item's backend (e.g. --backend {stage.runtime}); "
                        f"`runtime:` is for an `artifact:`")
    for f in stage.files(port.root) or [Path(stage.artifact)]:
        problem = runtime_problem(f, stage.runtime)
        if problem:
            raise PortError(f"{where}: {problem}")


def _check_glue(port: Port, stage: str | None, field: str, spec: str) -> None:
    try:
        resolve_glue(spec, port.root)
    except UsageError as e:
        raise PortError(f"{_where(port.source, stage, field)}: {e}") from None


def _check_buckets(port: Port, stage: StageSpec) -> None:
    """`buckets:` with `{frames}` or `{tokens}` in the file name, and an input whose axes give the
    length a bucket is chosen by; every input and output padded or trimmed must have known axes."""
    where = _where(port.source, stage.name, "buckets")
    artifact = stage.artifact or ""
    marked = "{frames}" in artifact or "{tokens}" in artifact
    if not stage.buckets:
        if marked:
            raise PortError(f"{_where(port.source, stage.name, 'artifact')}: {stage.artifact!r} names a bucket "
                            f"but the stage has no `buckets:`")
        return
    if stage.artifact is not None and not marked:
        raise PortError(f"{where}: the artifact {stage.artifact!r} has no `{{frames}}` or `{{tokens}}` in its name")
    for unit, sizes in stage.bucket_units.items():
        if unit not in BUCKET_UNITS:
            raise PortError(f"{where}: unknown bucket unit {unit!r}; units: {', '.join(BUCKET_UNITS)}")
        if sizes == "case":
            if stage.artifact is not None:
                raise PortError(f"{where}: `{unit}: case` is for a `step:` stage; an artifact lists the sizes it "
                                f"was compiled for")
        elif not sizes or min(sizes) < 1:
            raise PortError(f"{where}: bucket sizes must be positive, got {sizes}")
        if stage.artifact is not None and f"{{{unit}}}" not in artifact:
            raise PortError(f"{where}: the artifact {stage.artifact!r} has no `{{{unit}}}` in its name")
    for side, refs in (("inputs", stage.inputs), ("outputs", stage.outputs)):
        for io_name, ref in refs.items():
            if tensors.MODULE_REF.match(ref.tensor):
                raise PortError(f"{where}: {side[:-1]} {io_name!r} is the module reference {ref.tensor!r}, whose "
                                f"axes the harness does not know: a bucketed stage's inputs and outputs must be "
                                f"vocabulary tensors (padding and trimming go by their axes)")
    for unit in stage.bucket_units:
        if not any(u in BUCKET_UNITS[unit] for ref in stage.inputs.values()
                   for u in tensors.VOCAB[ref.tensor].axes.values()):
            raise PortError(f"{where}: no input of the stage has a {unit} axis to choose the bucket by")


def _producible(name: str, available: set[str], depth: int = 0) -> bool:
    if name in available:
        return True
    if depth > 4 or name not in HOST_GLUE:
        return False
    return all(_producible(n, available, depth + 1) for n in HOST_GLUE[name])


def check_declared(port: Port, stage: StageSpec) -> None:
    for f in stage.files(port.root):
        try:
            ins, outs = describe(f)
        except Exception as e:  # noqa: BLE001 - a corrupted file: one clear error naming it
            raise PortError(f"{_where(port.source, stage.name, 'artifact')}: cannot read {f}: "
                            f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
        for side, declared, mapped in (("inputs", ins, stage.inputs), ("outputs", outs, stage.outputs)):
            if declared is None:
                continue
            named = [p for p in declared if p.name is not None]
            if len(named) != len(declared):  # unnamed (.pte): positional, counts must agree
                if len(declared) != len(mapped):
                    raise PortError(f"{_where(port.source, stage.name, side)}: {f.name} declares "
                                    f"{len(declared)} {side}, the port maps {len(mapped)}")
                continue
            for p in declared:
                if p.name not in mapped:
                    raise PortError(f"{_where(port.source, stage.name, f'{side}.{p.name}')}: {f.name} declares "
                                    f"{side[:-1]} {p.name!r} {_show(p)}, which the port does not map "
                                    f"(expected: {', '.join(mapped) or 'none'})")
            for io_name, ref in mapped.items():
                p = next((q for q in declared if q.name == io_name), None)
                if p is None:
                    raise PortError(f"{_where(port.source, stage.name, f'{side}.{io_name}')}: {f.name} has no "
                                    f"{side[:-1]} {io_name!r}; it declares {[q.name for q in declared]}")
                check_fits(port, stage, side, io_name, ref, p, f)


def _show(p) -> str:
    return f"{p.dtype or '?'} {list(p.shape) if p.shape is not None else '[?]'}"


def check_fits(port: Port, stage: StageSpec, side: str, io_name: str, ref: TensorRef, p, f: Path) -> None:
    """Rank (the leading batch axis may be squeezed away) and dtype family against the vocabulary."""
    t = tensors.VOCAB.get(ref.tensor)
    if t is None:
        return  # a module reference: checked against the capture when it runs
    where = _where(port.source, stage.name, f"{side}.{io_name}")
    rank = t.shape.count(",") + 1 if t.shape != "[]" else 0
    if p.rank is not None and p.rank not in (rank, rank - 1, rank + 1):
        raise PortError(f"{where}: {f.name} declares {side[:-1]} {io_name!r} {_show(p)} of rank {p.rank}; "
                        f"Kokoro's {tensors.describe(t.name)} has rank {rank}")
    want = family(ref.dtype or t.dtype)
    got = family(p.dtype)
    if got is not None and want is not None and got != want and not (t.name == "audio" and got == "int"):
        raise PortError(f"{where}: {f.name} declares {side[:-1]} {io_name!r} {_show(p)}; Kokoro's "
                        f"{tensors.describe(t.name)} is {want} (declare `dtype:` if the port converts it)")


# ---- a port from artifacts alone (whole-model files, `port init`) ----------------------------

def guess_mapping(ports, side: str, candidates=None) -> tuple[dict[str, str], list[str]]:
    """{declared name: tensor} by name, else by rank and dtype; the names it could not place."""
    mapping, unplaced = {}, []
    for p in ports:
        t = tensors.guess(p.name, p.rank, p.dtype, candidates)
        if t is None:
            t = by_shape(p, side, candidates, set(mapping.values()))
        if t is None:
            unplaced.append(p.name)
        else:
            mapping[p.name] = t
    return mapping, unplaced


def whole_model_port(artifact: str | Path, runtime: str = "native") -> Port:
    """The one-stage port of a whole-model artifact (tokens, style, speed in; audio, maybe
    durations out), its mapping guessed from the declared names, ranks and dtypes; a declared
    input or output that fits nothing is one clear error naming it and what was expected. Its
    stage runs on `runtime` (`--artifact-runtime`)."""
    artifact = Path(artifact).resolve()
    source = f"(whole-model port of {artifact.name})"
    if not artifact.exists():
        raise PortError(f"{source}: {artifact} does not exist")
    kind_of(artifact)
    if runtime_problem(artifact, runtime):
        raise PortError(f"{source}, field 'runtime': {runtime_problem(artifact, runtime)}")
    try:
        ins, outs = describe(artifact)
    except Exception as e:  # noqa: BLE001
        raise PortError(f"{source}, field 'artifact': cannot read {artifact}: {type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}") from None
    expected = "tokens int64 [1, T] (pad id 0 at both ends), style float32 [1, 256], speed float32 [1]"
    inputs, bad = guess_mapping(ins, "inputs", ("input_ids", "ref_s", "speed"))
    if bad:
        p = next(q for q in ins if q.name == bad[0])
        raise PortError(f"{source}, field 'inputs.{p.name}': {artifact.name} declares input {p.name!r} "
                        f"{_show(p)}, which is none of a whole model's inputs: {expected}")
    outputs, bad = guess_mapping(outs or [], "outputs", ("audio", "pred_dur", "duration"))
    if bad:
        p = next(q for q in outs if q.name == bad[0])
        raise PortError(f"{source}, field 'outputs.{p.name}': {artifact.name} declares output {p.name!r} "
                        f"{_show(p)}, which is neither audio (float, rank 1-3) nor durations (int [T])")
    if outs is not None and "audio" not in outputs.values():
        raise PortError(f"{source}, field 'outputs': {artifact.name} has no audio output among "
                        f"{[q.name for q in outs]}")
    precision = "int8" if is_int8(artifact) else "float32"
    spec = PortSpec(name=artifact.stem.replace(".", "_"), stages=[StageSpec(
        name="whole", artifact=str(artifact), precision=precision, runtime=runtime, noise="own", inputs=inputs,
        outputs=outputs)])
    # a whole model is judged by the noise band (random ops or not; the zero-noise comparison is
    # printed beside it, and `--bisect` finds the graph's noise itself)
    port = Port(spec, artifact.parent, source)
    for io_name, ref in spec.stages[0].inputs.items():
        check_fits(port, spec.stages[0], "inputs", io_name, ref, next(q for q in ins if q.name == io_name), artifact)
    for io_name, ref in spec.stages[0].outputs.items():
        check_fits(port, spec.stages[0], "outputs", io_name, ref, next(q for q in outs if q.name == io_name), artifact)
    return port


def open_port(spec: str, runtime: str = "native") -> Port:
    """A port file, or `e2e=PATH`'s whole-model port run on `runtime` (a port file names its stages' own)."""
    return whole_model_port(spec[4:], runtime) if spec.startswith("e2e=") else load_port(spec)
