"""Cases: one YAML file each, validated into a frozen record.

A case is already phonemized, so no G2P runs at test time. Its bucket is the static shape that a
port would compile for: tokens (including Kokoro's two pad tokens) and alignment frames.

The shipped cases are the repository's `cases/`, package data of the wheel (`harness/data/cases/`,
mapped there by pyproject.toml), so a plugin installed from a wheel has them; a user's own cases
live in their project (`--cases-dir`, or `kokoro_parity_cases` in pytest's ini: `pyproject.toml` /
`pytest.ini`) and take precedence over a shipped case of the same id.
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .plumbing.errors import UsageError
from .plumbing.files import atomic_write_text, content_key
from .model import PACKAGED_VOICES, phonemize


def shipped_dir(name: str) -> Path:
    """A shipped data directory (`cases`, `golden`): the wheel's package data (`harness/data/<name>`),
    else the checkout's top-level `<name>/` (an editable install, or a checkout on the path). One
    copy: pyproject.toml maps the top-level directory into the wheel."""
    package = Path(__file__).resolve().parent
    installed = package / "data" / name
    return installed if installed.is_dir() else package.parent / name


CASES_DIR = shipped_dir("cases")  # the shipped cases
CASES_DIR_INI = "kokoro_parity_cases"  # pytest ini key; the CLI reads it from ./pyproject.toml too
CASES_ENV = "KOKORO_PARITY_CASES"  # the user's cases directories for the CLI, os.pathsep-separated
TOKEN_BUCKETS = (16, 32, 64, 96, 128, 192, 256, 384, 512)  # standard static shapes `new-case` picks from
FRAME_BUCKETS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4000)
MAX_TOKENS = 512  # ALBERT's max_position_embeddings


class CaseError(UsageError):
    """A case file that cannot be used; the message names the file and the field."""


class Bucket(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    tokens: int = Field(gt=2, le=MAX_TOKENS, description="static token length, pads included")
    frames: int = Field(gt=0, le=4000, description="static alignment frames (600 samples each)")


class Case(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    language: Literal["en-us", "en-gb", "ja"]
    text: str = Field(min_length=1)
    phonemes: str = Field(min_length=1)
    voice: str
    speed: float = Field(default=1.0, gt=0.25, le=4.0)
    seed: int = Field(default=0, ge=0, description="seed of the SineGen/NSF noise inputs")
    bucket: Bucket

    @field_validator("phonemes")
    @classmethod
    def _no_control_chars(cls, v: str) -> str:
        if any(ord(c) < 32 for c in v):
            raise ValueError("contains control characters")
        return v

    @property
    def digest(self) -> str:
        return content_key(self.model_dump())

    def token_ids(self, vocab: dict[str, int]) -> list[int]:
        """[0, *ids, 0]; unlike kokoro, an unknown phoneme is an error, never silently dropped."""
        unknown = sorted({c for c in self.phonemes if c not in vocab})
        if unknown:
            raise CaseError(f"case {self.id!r}: field 'phonemes' has symbols outside Kokoro's vocabulary: "
                            + ", ".join(repr(c) for c in unknown))
        ids = [0, *(vocab[c] for c in self.phonemes), 0]
        if len(ids) > self.bucket.tokens:
            raise CaseError(f"case {self.id!r}: {len(ids)} tokens do not fit field 'bucket.tokens' "
                            f"= {self.bucket.tokens}")
        return ids


def load_case(path: str | Path) -> Case:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise CaseError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise CaseError(f"{path}: expected a mapping of fields, got {type(data).__name__}")
    try:
        case = Case.model_validate(data)
    except ValidationError as e:
        lines = [f"field '{'.'.join(str(p) for p in err['loc'])}': {err['msg']}" for err in e.errors()]
        raise CaseError(f"{path}: invalid case\n  " + "\n  ".join(lines)) from None
    if case.id != path.stem:
        raise CaseError(f"{path}: field 'id' is {case.id!r} but the file is named {path.stem!r}")
    return case


def case_dirs(user_dirs=()) -> list[Path]:
    """Where cases are looked up, first match wins: the user's directories, then the shipped ones."""
    dirs = [Path(d) for d in user_dirs if d]
    for d in dirs:
        if not d.is_dir():
            raise CaseError(f"cases directory {d}: does not exist (--cases-dir / {CASES_DIR_INI})")
    return [*dirs, CASES_DIR]


def load_cases(directory: str | Path | list = CASES_DIR, only: list[str] | None = None,
               vocab: dict[str, int] | None = None) -> list[Case]:
    """The cases of one directory, or of several (`case_dirs`: the first directory holding an id
    wins); with `vocab`, each selected case is checked whole (`check_case`) before any work."""
    dirs = [Path(d) for d in directory] if isinstance(directory, (list, tuple)) else [Path(directory)]
    paths: dict[str, Path] = {}
    for d in dirs:
        for p in sorted(d.glob("*.yaml")):
            paths.setdefault(p.stem, p)
    if only:
        missing = [c for c in only if c not in paths]
        if missing:
            raise CaseError(f"--case {', '.join(missing)}: no such case in {', '.join(map(str, dirs))} "
                            f"(have {sorted(paths)})")
    cases = [load_case(p) for cid, p in paths.items() if not only or cid in only]
    for case in cases if vocab is not None else ():
        try:
            check_case(case, vocab)
        except CaseError as e:
            raise CaseError(f"{paths[case.id]}: {e}") from None
    return cases


def check_case(case: Case, vocab: dict[str, int]) -> None:
    """The whole case, before any work: its voice exists, its phonemes are in the vocabulary and
    its tokens fit its bucket (one error naming the field, not a traceback in every item)."""
    if case.voice not in PACKAGED_VOICES and not Path(case.voice).is_file():
        raise CaseError(f"case {case.id!r}: field 'voice' is {case.voice!r}: neither a packaged voice "
                        f"({', '.join(PACKAGED_VOICES)}) nor a voice file (a .pt of [510, 1, 256])")
    case.token_ids(vocab)


def configured_dirs(cwd: Path | None = None) -> list[Path]:
    """The user's cases directories for the CLI (pytest reads its own ini): $KOKORO_PARITY_CASES
    (os.pathsep-separated), then `kokoro_parity_cases` in ./pyproject.toml's [tool.pytest.ini_options]."""
    cwd = Path(cwd or Path.cwd())
    dirs = [Path(d) for d in os.environ.get(CASES_ENV, "").split(os.pathsep) if d]
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        try:
            ini = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("tool", {}).get("pytest", {}) \
                .get("ini_options", {})
        except tomllib.TOMLDecodeError as e:
            raise CaseError(f"{pyproject}: not valid TOML ({e})") from None
        listed = ini.get(CASES_DIR_INI, [])
        dirs += [cwd / d for d in ([listed] if isinstance(listed, str) else listed)]
    return dirs


def write_case(directory: Path, case_id: str, text: str, language: str, voice: str,
               tokens: int, frames: int, speed: float = 1.0, seed: int = 0) -> Path:
    """A new phonemized case file (`harness.model.phonemize`; the bucket a caller did not choose:
    `harness.reference.fitting_bucket`)."""
    case = Case(id=case_id, language=language, text=text, phonemes=phonemize(text, language),
                voice=voice, speed=speed, seed=seed, bucket=Bucket(tokens=tokens, frames=frames))
    path = Path(directory) / f"{case_id}.yaml"
    atomic_write_text(path, yaml.safe_dump(case.model_dump(), allow_unicode=True, sort_keys=False))
    return path
