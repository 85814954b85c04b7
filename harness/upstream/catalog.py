"""The catalog of runtime defects (catalog.yaml): one entry per upstream repro bundle.

Data, not code: a new defect is an entry naming its minimal program (programs.py) and its runtime
check (a function of checks/, by name); the entry's fields are validated here, and a bad one is
an error naming the entry and the field.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from .checks import check_names
from .programs import PROGRAMS
from ..plumbing.errors import UsageError

CATALOG = Path(__file__).with_name("catalog.yaml")


class _Known(BaseModel):
    model_config = ConfigDict(extra="forbid")
    link: str
    what: str


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid")
    file: str  # under site-packages
    line: str  # text on the line where Kokoro meets the defect


class _Entry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    title: str
    runtime: str
    module: str
    kind: Literal["convert", "delegation", "numerics", "run", "scaling"]
    signature: str
    program: Literal[tuple(PROGRAMS)]
    check: Literal[tuple(check_names())]
    source: _Source
    op: str
    workaround: str
    tracker: str
    known: list[_Known] = []
    onnx: bool = False
    expected: str = ""
    detail: str = ""
    searched: str | None = None


@dataclass(frozen=True)
class Defect:
    name: str  # the bundle's directory: <runtime>-<short-name>
    title: str
    runtime: str  # the distribution whose defect it is (its version goes in ENV.md)
    module: str  # the import name repro.py needs
    kind: str  # convert | delegation | numerics | run | scaling
    signature: str  # the text (error message, op name) that is this defect
    program: Callable  # () -> (module, inputs): the minimal program
    check: str  # harness.upstream.checks: the check pasted into repro.py, with what it calls
    source: tuple[str, str]  # (file under site-packages, text on the line) where Kokoro meets it
    op: str  # the op in question
    workaround: str  # the harness's workaround that hides it (harness.backends.Workaround names)
    tracker: str  # where to report
    known: tuple[tuple[str, str], ...] = ()  # (link, what it is) found by searching the tracker
    onnx: bool = False  # the bundle also carries model.onnx
    expected: str = ""  # what a fixed runtime does, where the kind's usual sentence does not say it
    detail: str = ""  # what kokoro-parity measured of it (a paragraph at the end of REPORT.md)
    searched: str = ""  # when `known` was searched


def load_catalog(path: Path = CATALOG) -> tuple[str, list[Defect]]:
    """(the default search date, the defects) of a catalog file; ValueError naming the file, the
    entry and the field of a malformed one."""
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    searched = str(data.get("searched", ""))
    defects = []
    for i, raw in enumerate(data.get("defects") or []):
        name = raw.get("name", f"#{i + 1}") if isinstance(raw, dict) else f"#{i + 1}"
        try:
            e = _Entry.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise UsageError(f"{path}: defect {name}: field {where}: {first['msg']}") from None
        defects.append(Defect(
            e.name, e.title, e.runtime, e.module, e.kind, e.signature, PROGRAMS[e.program], e.check,
            (e.source.file, e.source.line), e.op, e.workaround, e.tracker,
            tuple((k.link, k.what) for k in e.known),
            e.onnx, e.expected, e.detail, e.searched or searched))
    names = [d.name for d in defects]
    if len(set(names)) != len(names):
        raise UsageError(f"{path}: defect names repeat: {sorted({n for n in names if names.count(n) > 1})}")
    return searched, defects


SEARCHED, DEFECTS = load_catalog()
BY_NAME = {d.name: d for d in DEFECTS}
