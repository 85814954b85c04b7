"""Case files: the shipped ones load; a malformed one gets an error naming the file and field."""
from __future__ import annotations

import pytest

from harness.cases import CASES_DIR, CaseError, load_case, load_cases
from harness.model import load_vocab

GOOD = """id: tiny
language: en-us
text: Hi.
phonemes: hˈI.
voice: jf_alpha
bucket: {tokens: 16, frames: 64}
"""


def write(tmp_path, text, name="tiny"):
    p = tmp_path / f"{name}.yaml"
    p.write_text(text, encoding="utf-8")
    return p


def test_shipped_cases_are_valid():
    cases = load_cases()
    assert {"en_short", "en_long", "ja"} <= {c.id for c in cases}
    vocab = load_vocab()
    long = next(c for c in cases if c.id == "en_long")
    assert 450 <= len(long.token_ids(vocab)) <= 512
    for c in cases:
        assert len(c.token_ids(vocab)) <= c.bucket.tokens


@pytest.mark.parametrize("edit, field", [
    (lambda t: t.replace("voice: jf_alpha\n", ""), "voice"),
    (lambda t: t.replace("tokens: 16", "tokens: 900"), "bucket.tokens"),
    (lambda t: t.replace("tokens: 16", "tokens: many"), "bucket.tokens"),
    (lambda t: t.replace("language: en-us", "language: klingon"), "language"),
    (lambda t: t + "colour: blue\n", "colour"),
    (lambda t: t.replace("phonemes: hˈI.", "phonemes: ''"), "phonemes"),
])
def test_malformed_case_names_file_and_field(tmp_path, edit, field):
    p = write(tmp_path, edit(GOOD))
    with pytest.raises(CaseError) as e:
        load_case(p)
    assert str(p) in str(e.value) and f"field '{field}'" in str(e.value)


def test_not_yaml_and_not_a_mapping(tmp_path):
    with pytest.raises(CaseError, match="not valid YAML"):
        load_case(write(tmp_path, "id: [unclosed"))
    with pytest.raises(CaseError, match="expected a mapping"):
        load_case(write(tmp_path, "- a\n- b\n"))


def test_id_must_match_file_name(tmp_path):
    with pytest.raises(CaseError, match="field 'id'"):
        load_case(write(tmp_path, GOOD, name="other"))


def test_unknown_phonemes_are_named_not_dropped(tmp_path):
    case = load_case(write(tmp_path, GOOD.replace("hˈI.", "hˈI.§")))
    with pytest.raises(CaseError, match="'§'"):
        case.token_ids(load_vocab())


def test_too_many_tokens_for_the_bucket(tmp_path):
    case = load_case(write(tmp_path, GOOD.replace("tokens: 16", "tokens: 4")))
    with pytest.raises(CaseError, match="bucket.tokens"):
        case.token_ids(load_vocab())


def test_unknown_case_id_is_named():
    with pytest.raises(CaseError, match="nope"):
        load_cases(CASES_DIR, only=["nope"])
