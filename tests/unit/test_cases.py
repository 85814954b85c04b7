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


# ---- your own cases, beside the shipped ones ------------------------------------------------

def test_a_users_cases_come_first_and_the_shipped_ones_stay(tmp_path):
    from harness.cases import case_dirs

    write(tmp_path, GOOD)
    write(tmp_path, GOOD.replace("id: tiny", "id: en_short").replace("Hi.", "Mine."), name="en_short")
    cases = {c.id: c for c in load_cases(case_dirs([tmp_path]))}
    assert {"tiny", "en_short", "ja", "en_long"} <= set(cases)
    assert cases["en_short"].text == "Mine."  # the user's case of the same id wins
    with pytest.raises(CaseError, match="does not exist"):
        case_dirs([tmp_path / "nope"])


@pytest.mark.parametrize("edit, says", [
    (lambda t: t.replace("voice: jf_alpha", "voice: af_nobody"), "field 'voice' is 'af_nobody'"),
    (lambda t: t.replace("hˈI.", "hˈI.§"), "'§'"),
    (lambda t: t.replace("tokens: 16", "tokens: 4"), "bucket.tokens"),
])
def test_a_case_is_checked_whole_when_it_loads(tmp_path, edit, says):
    """An unknown voice, a phoneme outside the vocabulary or a bucket too small: one error naming the
    file and the field when the cases load (a Session's first look), not a traceback per item."""
    from harness.runner import Session

    p = write(tmp_path, edit(GOOD))
    with pytest.raises(CaseError) as e:
        Session(case_ids=["tiny"], cases_dirs=(str(tmp_path),)).cases
    assert str(p) in str(e.value) and says in str(e.value)


def test_the_cli_finds_the_users_cases_dir(tmp_path, monkeypatch):
    from harness.cases import CASES_ENV, configured_dirs

    monkeypatch.delenv(CASES_ENV, raising=False)
    (tmp_path / "pyproject.toml").write_text('[tool.pytest.ini_options]\nkokoro_parity_cases = ["my_cases"]\n')
    assert configured_dirs(tmp_path) == [tmp_path / "my_cases"]
    monkeypatch.setenv(CASES_ENV, "/elsewhere")
    assert configured_dirs(tmp_path)[0].as_posix() == "/elsewhere"
    (tmp_path / "pyproject.toml").write_text("[tool.pytest\n")
    with pytest.raises(CaseError, match="pyproject.toml"):
        configured_dirs(tmp_path)


def test_new_case_picks_the_smallest_standard_bucket_that_fits(random_model):
    from harness.cases import FRAME_BUCKETS, TOKEN_BUCKETS
    from harness.reference import fitting_bucket, run_chain

    from harness.cases import Case
    from harness.model import phonemize

    bucket = fitting_bucket(random_model, "Hello there.", "en-us", "jf_alpha")
    # the bucket holds the reference's own lengths, and the next smaller standard one would not
    c = Case(id="x", language="en-us", text="Hello there.", phonemes=phonemize("Hello there.", "en-us"),
             voice="jf_alpha", bucket=bucket)
    _, valid, _ = run_chain(random_model, c, synthesize=False)
    t, f = TOKEN_BUCKETS.index(bucket.tokens), FRAME_BUCKETS.index(bucket.frames)
    assert valid.tokens <= bucket.tokens and (t == 0 or valid.tokens > TOKEN_BUCKETS[t - 1])
    assert valid.frames <= bucket.frames and (f == 0 or valid.frames > FRAME_BUCKETS[f - 1])
