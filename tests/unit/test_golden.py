"""The golden store: round trip, and every way golden data can be untrustworthy is an error."""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness.cases import Bucket, Case
from harness.golden import GoldenError, GoldenStore, compare
from harness.reference import compute_traces

CASE = Case(id="tiny", language="en-us", text="Hi.", phonemes="hˈI.", voice="jf_alpha",
            bucket=Bucket(tokens=16, frames=400))


@pytest.fixture(scope="module")
def traces(random_model):
    return compute_traces(random_model, CASE, steps=("bert", "bert_encoder", "duration_encoder", "duration"))


@pytest.fixture
def store(tmp_path, traces, random_model):
    s = GoldenStore(tmp_path / "golden" / random_model.name)
    s.write(CASE, "static", traces, random_model)
    return s


def test_round_trip(store, traces, random_model):
    assert store.check(CASE, "static", traces, random_model) == []
    files = sorted(p.name for p in store.dir("tiny", "static").iterdir())
    assert "manifest.json" in files and "duration.duration.npy" in files


def test_missing_golden_says_how_to_make_it(tmp_path, traces, random_model):
    with pytest.raises(GoldenError, match="--update-golden"):
        GoldenStore(tmp_path).check(CASE, "static", traces, random_model)


def test_corrupted_file_fails_its_checksum(store, traces, random_model):
    path = store.dir("tiny", "static") / "bert.bert_dur.npy"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(GoldenError, match="bert.bert_dur.npy: fails its checksum"):
        store.check(CASE, "static", traces, random_model)


def test_other_weights_are_an_error(store, traces):
    from harness.model import load_random

    with pytest.raises(GoldenError, match="other weights"):
        store.check(CASE, "static", traces, load_random(1))


def test_changed_case_is_an_error(store, traces, random_model):
    changed = CASE.model_copy(update={"speed": 1.1})
    with pytest.raises(GoldenError, match="changed"):
        store.check(changed, "static", traces, random_model)


def test_changed_reference_is_reported(store, traces, random_model):
    name, mode = "duration", "static"
    outputs = traces.io[(name, mode, "float32")][1]
    original = outputs["duration"].clone()
    outputs["duration"] = original * 1.01
    try:
        problems = store.check(CASE, mode, traces, random_model)
    finally:
        outputs["duration"] = original
    assert problems and "duration.duration" in problems[0]


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_never_equals_nan(bad):
    a = np.ones(8, np.float32)
    a[3] = bad
    assert compare("x", a, a.copy()) is not None  # unlike pytest-regressions' NaN == NaN


def test_large_tensors_stored_as_float16_are_compared_at_that_precision():
    x = np.random.default_rng(0).standard_normal(200_000).astype(np.float32)
    assert compare("x", x, x.astype(np.float16)) is None
    assert compare("x", x * 1.01, x.astype(np.float16)) is not None


def test_the_fp32_floor_widens_the_tolerance_and_nothing_else():
    """Finding 12: another CPU path moves the vocoder's fp32 audio by about its own fp32 floor."""
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    moved = x * (1 + 5e-3 * np.random.default_rng(2).standard_normal(1000).astype(np.float32))
    problem = compare("decoder.audio", moved, x)
    assert problem and "exceeds 1e-05" in problem and "floor" not in problem
    assert compare("decoder.audio", moved, x, floor=7e-3) is None
    problem = compare("decoder.audio", moved, x, floor=1e-3)
    assert problem and "2 x its fp32 floor 1.00e-03" in problem
    nan = moved.copy()
    nan[0] = np.nan
    assert compare("decoder.audio", nan, x, floor=1.0) is not None  # a NaN never passes, floor or not


def test_the_manifest_records_the_cpu_path_and_a_failure_names_both(store, traces, random_model):
    import json

    from harness.reference import numerics

    manifest = store.dir("tiny", "static") / "manifest.json"
    assert json.loads(manifest.read_text())["numerics"] == numerics()
    assert json.loads(manifest.read_text())["files"]["duration.duration.npy"]["floor"] > 0
    floors = store.floors(traces, "static")
    assert floors["duration.duration"] > 0 and all(v < 1e-4 for v in floors.values()), floors
    data = json.loads(manifest.read_text())
    data["numerics"] = "2.13.0;AVX512;mkl=auto"
    manifest.write_text(json.dumps(data))
    outputs = traces.io[("duration", "static", "float32")][1]
    original = outputs["duration"].clone()
    outputs["duration"] = original * 1.01
    try:
        problems = store.check(CASE, "static", traces, random_model)
    finally:
        outputs["duration"] = original
    assert problems[-1] == f"(golden made under the CPU path 2.13.0;AVX512;mkl=auto; this run: {numerics()})"
    assert store.check(CASE, "static", traces, random_model) == []  # no problem: the paths go unsaid


def test_a_check_reads_no_float64_reference_where_the_manifest_has_each_floor(store, traces, random_model, monkeypatch):
    """The float64 runs are most of a check's time (the vocoder's): the floors written with the
    golden data serve; a float file whose floor is missing from the manifest has its floor computed."""
    class Reads(dict):
        def __getitem__(self, key):
            read.append(key[2])
            return dict.__getitem__(self, key)

    read = []
    monkeypatch.setattr(traces, "io", Reads(traces.io))
    assert store.check(CASE, "static", traces, random_model) == [] and read and set(read) == {"float32"}
    manifest = store.dir("tiny", "static") / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["files"]["bert.bert_dur.npy"]["floor"]
    manifest.write_text(json.dumps(data))
    read.clear()
    assert store.check(CASE, "static", traces, random_model) == [] and "float64" in read
