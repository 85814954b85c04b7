"""The serializable result of one item (case, step, backend, mode), with a versioned schema.

Records are what reports, history and dashboards read; nothing downstream re-runs anything.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import math
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import __version__
from .plumbing.files import atomic_write_json
from .verdict import Verdict
from .plumbing.errors import UsageError

SCHEMA = "kokoro-parity/record/1"


def item_id(case: str, step: str, backend: str, mode: str) -> str:
    """The one spelling of an item's id: `case-step-backend-mode` (pytest ids, file names, history)."""
    return f"{case}-{step}-{backend}-{mode}"


def backend_label(backend: str, target: str | None = None) -> str:
    """The backend as ids, tables and history name it: `xnnpack` on this machine, `xnnpack@mac` on
    the remote target `mac` (harness.plumbing.targets), so that targets are separate columns."""
    return backend if not target or target == "local" else f"{backend}@{target}"


@dataclass
class Record:
    case: str
    step: str
    backend: str
    mode: str
    verdict: Verdict
    reason: str = ""
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # per output, vs float64
    rewrite_drift: dict[str, dict[str, float]] = field(default_factory=dict)  # static vs dynamic fp32
    patch_drift: dict[str, dict[str, float]] = field(default_factory=dict)  # patched vs unpatched fp32
    audio_metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # PESQ, MCD, ... per audio output
    durations: dict[str, int] = field(default_factory=dict)  # e2e: backend vs reference durations
    patches: list[str] = field(default_factory=list)
    semantic_patches: list[str] = field(default_factory=list)  # applied patches that change semantics
    audit: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # export_s, compile_s, run_s
    cache: dict[str, str] = field(default_factory=dict)  # program/artifact: hit or miss
    peak_rss_mb: dict[str, float] = field(default_factory=dict)
    artifact_bytes: int | None = None
    model: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    log: str = ""  # tail of the child's log on errors
    bisect: dict[str, Any] = field(default_factory=dict)  # harness.bisect: first diverging module/op, repro
    audio: dict[str, str] = field(default_factory=dict)  # role -> WAV path relative to the report dir
    workarounds: dict[str, list[str]] = field(default_factory=dict)  # named workarounds: applied, disabled
    stages: list[dict[str, Any]] = field(default_factory=list)  # harness.port: one row per stage of a port
    bands: dict[str, dict[str, Any]] = field(default_factory=dict)  # harness.port.noise: metric -> value, band, ok
    target: dict[str, Any] = field(default_factory=dict)  # where it ran: name, os, machine, python, runtimes
    precision: str = "float32"  # what the backend computes in; float16 items are judged by the float16 floor
    shippable: bool | None = None  # harness.verdict.shippable: audio bars / durations vs float64; None: n/a
    shippable_reason: str = ""
    real_time: dict[str, float] = field(default_factory=dict)  # audio items: rtf = run_s / audio_s (`real_time`)
    schema: str = SCHEMA

    @property
    def item_id(self) -> str:
        return item_id(self.case, self.step, backend_label(self.backend, self.target.get("name")), self.mode)

    def failed(self, verdict: Verdict, error: str, log: str = "") -> "Record":
        """The item ended before a verdict on its outputs: an error, a crash or a timeout."""
        self.verdict, self.reason, self.log = verdict, error, log
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["verdict"] = self.verdict.value
        return _finite_json(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Record":
        if d.get("schema") != SCHEMA:
            raise UsageError(f"record schema {d.get('schema')!r} is not {SCHEMA!r}")
        d = dict(d)
        d["verdict"] = Verdict(d["verdict"])
        return cls(**d)

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
    out = []
    for p in sorted(Path(directory).glob("*.json")):
        out.append(Record.from_dict(json.loads(p.read_text())))
    return out


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
