"""The serializable result of one item (case, step, backend, mode), with a versioned schema.

Records are what reports, history and dashboards read; nothing downstream re-runs anything. A record
and its parts are pydantic models, so that a malformed file fails on load naming its field, and
`Record.model_json_schema()` (docs/record.schema.json) is the written form's contract.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import math
import platform
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Tag, ValidationError, Field, TypeAdapter, field_validator, model_serializer

from . import __version__
from .plumbing.files import atomic_write_json
from .verdict import Verdict
from .plumbing.errors import UsageError

SCHEMA = "kokoro-parity/record/2"
SCHEMAS = ("kokoro-parity/record/1", SCHEMA)  # what loads: version 2 types the same JSON version 1 wrote


def item_id(case: str, step: str, backend: str, mode: str) -> str:
    """The one spelling of an item's id: `case-step-backend-mode` (pytest ids, file names, history)."""
    return f"{case}-{step}-{backend}-{mode}"


def backend_label(backend: str, target: str | None = None) -> str:
    """The backend as ids, tables and history name it: `xnnpack` on this machine, `xnnpack@mac` on
    the remote target `mac` (harness.plumbing.targets), so that targets are separate columns."""
    return backend if not target or target == "local" else f"{backend}@{target}"


# ---- the parts ---------------------------------------------------------------------------------

Figure = Annotated[Union[float, int, bool, str],  # "nan", "inf", "-inf" in JSON: the floats
                   BeforeValidator(lambda v: float(v) if v in ("nan", "inf", "-inf") else v)]
Figures = dict[str, Figure]  # one output's metrics (and a note or two, such as `floor_precision`)
Metrics = dict[str, Figures]  # output name -> its figures


class Part(BaseModel):
    """A typed part of a record. Keys it does not name are kept (backends and localizers add their
    own) and only the keys set are written, so the JSON is what the dicts before it wrote; it also
    reads like that dict (`get`, `[]`, `in`), since the table printers take a record's JSON too."""
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    @model_serializer(mode="wrap")
    def _set_only(self, handler):
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set or k in (self.model_extra or {})}

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key) if key in self else default

    def __getitem__(self, key: str) -> Any:
        if key not in self:
            raise KeyError(key)
        return getattr(self, key)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, key, value)

    def __contains__(self, key: object) -> bool:
        return key in self.model_fields_set or key in (self.model_extra or {})

    def update(self, other: dict[str, Any]) -> None:
        for k, v in other.items():
            setattr(self, k, v)


class Audit(Part):
    """What the backend or artifact said about the program before running it (each backend adds its
    own keys: `Backend.audit_labels`)."""
    artifact: str | None = None  # an `--artifact` item's file and its format
    kind: str | None = None
    input_mapping: dict[str, Any] | None = None  # the artifact's inputs -> the step's
    port: dict[str, Any] | None = None  # harness.port: the port file's stages
    ops_outside_delegate: dict[str, int] | None = None
    non_core_aten_ops: dict[str, int] | None = None


class Judged(Part):
    """One tensor judged against its reference: metrics, whether within its floor and why."""
    ok: bool = True
    why: str = ""
    kind: str = ""  # the kind of difference
    rel_l2: float | None = None
    floor_rel_l2: float | None = None


class StageOutput(Part):
    local: Judged  # the stage fed the reference's inputs
    chained: Judged  # the stage fed the earlier stages' outputs


class StageRow(Part):
    """One stage of a port (or a glue, or a rewritten module): its outputs judged locally and chained."""
    stage: str
    outputs: dict[str, StageOutput] = {}
    local_ok: bool = True
    chained_ok: bool = True
    bucket: dict[str, Any] | None = None  # the bucket(s) a bucketed stage ran
    defect: dict[str, Any] | None = None  # its rank by audio effect, when the chain has two defects
    inside: str | None = None  # a rewrite's sub-callable (`module.method`): the module that holds it


class NoiseBand(Part):
    """An audio metric beside the band that K reference runs with other noise seeds span."""
    value: float | None
    band: tuple[float, float]
    ok: bool
    direction: str
    why: str = ""
    k: int | None = None


class ZeroNoise(Part):
    """The audio against the reference run with every noise input zero, sample by sample."""
    rel_l2: float
    snr_db: float
    kind: str
    why: str = ""


Band = Union[NoiseBand, ZeroNoise]


class Bisection(Part):
    """harness.bisect: module cuts, then the first diverging op, and its repro bundle."""
    status: str = ""  # localized, not localized, error
    message: str | None = None
    modules: list[dict[str, Any]] | None = None
    first_module: str | None = None
    first_op: dict[str, Any] | None = None
    repro: dict[str, Any] | None = None


class Tagged(Part):
    """A localization that names its localizer: its `kind` is always written."""
    def model_post_init(self, context: Any) -> None:
        self.model_fields_set.add("kind")


class OnnxStages(Tagged):
    """harness.port.onnx_stages / onnx_steps: an ONNX marked and cut at the model's module boundaries."""
    kind: Literal["onnx-stages"] = "onnx-stages"
    artifact: str = ""
    stages: list[dict[str, Any]] | None = None
    defects: list[dict[str, Any]] | None = None
    first_stage: str | None = None
    repro: str | None = None  # the bundle's directory
    # an item judged on a browser runtime (`--artifact-runtime ort-web-*`): its stages ran there too
    runtime: str | None = None  # what ran them: "onnxruntime-web 1.30.0 wasm (Chromium ...)"
    judged_on: str | None = None  # the item's runtime (ort-web-wasm, ort-web-webgpu)
    ran_on: dict[str, Any] | None = None  # onnxruntime-web, its files, the browser, the WebGPU adapter
    note: str | None = None


class PteEtdump(Tagged):
    """harness.port.pte_stages: a .pte run with ETDump, judged module by module."""
    kind: Literal["pte-etdump"] = "pte-etdump"
    artifact: str = ""
    repro: str | None = None


class Rewrite(Tagged):
    """harness.rewrite: the first failing rewritten module's bundle."""
    kind: Literal["rewrite"] = "rewrite"
    module: str
    repro: str | None = None


class Unlocalized(Part):
    """A localization that could not run or does not apply: why."""
    error: str


class PortChain(Tagged):
    """harness.port.chain_localize: each stage of a chain localized inside, and the defects found."""
    kind: Literal["port-chain"] = "port-chain"
    port: str
    stages: dict[str, "Localization | None"] = {}
    defects: list[dict[str, Any]] = []
    repro: str | dict[str, Any] | None = None


def _localizer(v: Any) -> str:
    """Which localizer wrote it: its `kind`; harness.bisect's has none, an error only `error`."""
    if isinstance(v, Part):
        return getattr(v, "kind", None) or ("error" if isinstance(v, Unlocalized) else "bisect")
    kind = v.get("kind")
    return kind or ("error" if "error" in v and "status" not in v else "bisect")


Localization = Annotated[Union[Annotated[Bisection, Tag("bisect")], Annotated[OnnxStages, Tag("onnx-stages")],
                               Annotated[PteEtdump, Tag("pte-etdump")], Annotated[Rewrite, Tag("rewrite")],
                               Annotated[PortChain, Tag("port-chain")], Annotated[Unlocalized, Tag("error")]],
                         Discriminator(_localizer)]
PortChain.model_rebuild()
_LOCALIZATION = TypeAdapter(Localization | None)


def localization(value: Any) -> Localization | None:
    """A localization as its typed model, from a localizer's dict or a record's JSON ({}: none)."""
    return _LOCALIZATION.validate_python(value or None)


# ---- the record --------------------------------------------------------------------------------

class Record(BaseModel):
    """One item's result; every field is written, by the name it has here."""
    model_config = ConfigDict(validate_assignment=True, populate_by_name=True)

    case: str
    step: str
    backend: str
    mode: str
    verdict: Verdict
    reason: str = ""
    metrics: Metrics = {}  # per output, vs float64
    rewrite_drift: Metrics = {}  # static vs dynamic fp32
    patch_drift: Metrics = {}  # patched vs unpatched fp32
    audio_metrics: Metrics = {}  # PESQ, MCD, ... per audio output
    durations: dict[str, int] = {}  # e2e: backend vs reference durations
    patches: list[str] = []
    semantic_patches: list[str] = []  # applied patches that change semantics
    audit: Audit = Audit()
    timings: dict[str, float] = {}  # export_s, compile_s, run_s
    cache: dict[str, str] = {}  # program/artifact: hit or miss
    peak_rss_mb: dict[str, float] = {}
    artifact_bytes: int | None = None
    model: dict[str, str] = {}
    versions: dict[str, str] = {}
    log: str = ""  # tail of the child's log on errors
    bisect: Localization | None = None  # the localization (`{}` in JSON when there is none)
    audio: dict[str, str] = {}  # role -> WAV path relative to the report dir
    workarounds: dict[str, list[str]] = {}  # named workarounds: applied, disabled
    stages: list[StageRow] = []  # harness.port: one row per stage of a port
    bands: dict[str, Band] = {}  # harness.port.noise: metric -> value, band, ok; `zero_noise`
    target: dict[str, Any] = {}  # where it ran: name, os, machine, python, runtimes
    precision: str = "float32"  # what the backend computes in; float16 items are judged by the float16 floor
    shippable: bool | None = None  # harness.verdict.shippable: audio bars / durations vs float64; None: n/a
    shippable_reason: str = ""
    real_time: dict[str, float] = {}  # audio items: rtf = run_s / audio_s (`real_time`)
    schema_: str = Field(SCHEMA, alias="schema")

    def __init__(self, *args: Any, **fields: Any):
        """`Record(case, step, backend, mode, verdict, reason, ...)`, as the callers spell it."""
        super().__init__(**dict(zip(("case", "step", "backend", "mode", "verdict", "reason"), args)), **fields)

    @field_validator("bisect", mode="before")
    @classmethod
    def _none_when_empty(cls, v: Any) -> Any:
        return v or None

    @property
    def item_id(self) -> str:
        return item_id(self.case, self.step, backend_label(self.backend, self.target.get("name")), self.mode)

    def failed(self, verdict: Verdict, error: str, log: str = "") -> "Record":
        """The item ended before a verdict on its outputs: an error, a crash or a timeout."""
        self.verdict, self.reason, self.log = verdict, error, log
        return self

    def to_dict(self) -> dict[str, Any]:
        d = self.model_dump(by_alias=True, warnings=False)  # python mode: the JSON mode writes NaN as null
        d["verdict"], d["bisect"] = self.verdict.value, d["bisect"] or {}
        return _finite_json(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "record") -> "Record":
        """A record as written by this version or the one before (the same JSON, untyped then);
        a malformed one raises a UsageError naming `source` and the field."""
        if not isinstance(d, dict) or d.get("schema") not in SCHEMAS:
            schema = d.get("schema") if isinstance(d, dict) else None
            raise UsageError(f"{source}: record schema {schema!r} is not {SCHEMA!r}")
        try:
            return cls.model_validate({**d, "schema": SCHEMA})
        except ValidationError as e:
            x = e.errors()[0]
            raise UsageError(f"{source}: malformed record, field {'.'.join(map(str, x['loc']))}: {x['msg']}") from None

    def write(self, directory: Path) -> Path:
        return atomic_write_json(Path(directory) / f"{self.item_id}.json", self.to_dict())


def real_time(run_s: float | None, audio_s: float | None) -> dict[str, float]:
    """The real-time factor of an audio item: the runtime's seconds (loading the artifact and running
    it, as `run_s` measures) per second of audio it made; above 1 is slower than real time. Empty
    when either figure is missing."""
    if not run_s or not audio_s or run_s < 0 or audio_s <= 0:
        return {}
    return {"rtf": run_s / audio_s, "run_s": run_s, "audio_s": audio_s}


def _finite_json(obj: Any) -> Any:
    """JSON has no NaN/Infinity: write them as strings so that strict readers (browsers) parse it."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj


def read_records(directory: Path) -> list[Record]:
    return [Record.from_dict(json.loads(p.read_text()), str(p)) for p in sorted(Path(directory).glob("*.json"))]


# ---- filled by the runner and the port chain --------------------------------------------------

_JOB_VERDICTS = {"crashed": Verdict.CRASHED, "timeout": Verdict.TIMEOUT}


_COMPILED_NOT_RUN = "compiled; "  # the reason's prefix: written and read only here


def skip_compiled_not_run(rec: "Record", why: str) -> None:
    """The item's artifact compiled here but its target cannot run it (Core ML off macOS, an
    unreachable target): SKIPPED, with the compile's outcome and audit kept in the record."""
    rec.verdict, rec.reason = Verdict.SKIPPED, f"{_COMPILED_NOT_RUN}{why}"


def compiled_not_run(rec: "Record") -> bool:
    """Whether the item was skipped so (a port chain then goes on converting its later stages);
    the chain prefixes the stage's name to the reason, so the marker may be anywhere in it."""
    return rec.verdict is Verdict.SKIPPED and _COMPILED_NOT_RUN in (rec.reason or "")


def failed(rec: "Record", result, error_verdict: Verdict) -> None:
    """A job (harness.plumbing.jobs.JobResult) that did not succeed: crashed and timed-out jobs say so, anything else is the phase's error."""
    rec.failed(_JOB_VERDICTS.get(result.status, error_verdict), result.error, result.log_tail)


def versions(backend=None) -> dict[str, str]:
    """The versions a record carries (the backend's own, when there is one)."""
    out = {"python": platform.python_version(), "harness": __version__, "platform": platform.platform()}
    if backend is not None:
        out["backend"] = backend.version()
    for pkg in ("torch", "kokoro", "numpy"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out
