"""Tensor metrics and the verdict rule. A NaN or Inf never passes, whatever the tolerance."""
from __future__ import annotations

import math

import numpy as np
import pytest

from harness.metrics.tensor import compare_to_floor, error_metrics
from harness.verdict import Profile, Tolerance, Verdict, comparator, judge


@pytest.fixture
def ref():
    return np.random.default_rng(0).standard_normal(10_000)


def test_identical(ref):
    m = error_metrics(ref.astype(np.float32), ref)
    assert m["nan_rate"] == 0 and m["cosine"] == pytest.approx(1.0)
    assert m["rel_l2"] < 1e-7 and m["snr_db"] > 140


def test_known_error_values(ref):
    m = error_metrics(ref * 1.01, ref)  # a 1% gain error
    assert m["rel_l2"] == pytest.approx(0.01, rel=1e-9)
    assert m["snr_db"] == pytest.approx(40.0, abs=1e-6)
    assert m["max_abs"] == pytest.approx(0.01 * np.abs(ref).max())
    assert m["cosine"] == pytest.approx(1.0)
    assert error_metrics(-ref, ref)["cosine"] == pytest.approx(-1.0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_single_nonfinite_value_fails_even_with_huge_tolerances(ref, bad):
    cand = ref.copy()
    cand[17] = bad
    m = compare_to_floor(cand, ref, ref)
    assert m["new_nonfinite"] == 1 and math.isnan(m["rel_l2"])
    ok, why = comparator(Tolerance(floor_multiplier=1e9, rel_l2=1e9))(m)
    assert not ok and "non-finite" in why
    assert judge({"out": m}, Tolerance(rel_l2=1e9))[0] is Verdict.FAIL


def test_all_nan_fails(ref):
    m = compare_to_floor(np.full_like(ref, np.nan), ref, ref)
    assert m["nan_rate"] == 1.0
    assert judge({"out": m}, Tolerance())[0] is Verdict.FAIL


def test_noise_floor_rule(ref):
    fp32_eager = ref + 1e-3 * np.random.default_rng(1).standard_normal(ref.size)  # floor ~1e-3
    within = ref + 3e-3 * np.random.default_rng(2).standard_normal(ref.size)
    beyond = ref + 5e-2 * np.random.default_rng(3).standard_normal(ref.size)
    tol = Tolerance(floor_multiplier=4, rel_l2=1e-5)
    m_in, m_out = compare_to_floor(within, fp32_eager, ref), compare_to_floor(beyond, fp32_eager, ref)
    assert m_in["floor_ratio"] == pytest.approx(3, rel=0.05)
    assert judge({"o": m_in}, tol)[0] is Verdict.PASS
    verdict, why = judge({"o": m_out}, tol)
    assert verdict is Verdict.FAIL and "fp32 floor" in why


def test_shape_mismatch_is_an_error(ref):
    with pytest.raises(ValueError, match="shape mismatch"):
        error_metrics(ref[:10], ref)


def test_profile_overrides_by_step_and_backend(tmp_path):
    p = tmp_path / "tol.yaml"
    p.write_text("default: {floor_multiplier: 4}\noverrides:\n  - {step: decoder, floor_multiplier: 8}\n"
                 "  - {step: decoder, backend: xnnpack, rel_l2: 0.01}\n")
    prof = Profile.load(p)
    assert prof.for_("bert", "xnnpack", "static").floor_multiplier == 4
    assert prof.for_("decoder", "eager", "static").floor_multiplier == 8
    t = prof.for_("decoder", "xnnpack", "dynamic")
    assert t.rel_l2 == 0.01 and t.floor_multiplier == 4


def test_bad_profile_names_the_file(tmp_path):
    p = tmp_path / "tol.yaml"
    p.write_text("default: {floor_multiplyer: 4}\n")
    with pytest.raises(ValueError, match="tol.yaml, default: floor_multiplyer: Unexpected"):
        Profile.load(p)
    p.write_text("overrides:\n  - {step: decoder}\n  - {step: f0n, rel_l2: small}\n")
    with pytest.raises(ValueError, match=r"overrides\[1\]: rel_l2: Input should be a valid number"):
        Profile.load(p)


def test_records_serialize_nonfinite_values():
    from harness.record import Record

    r = Record("c", "decoder", "xnnpack", "static", Verdict.FAIL, metrics={"audio": {"rel_l2": float("nan"), "snr_db": float("inf")}})
    d = r.to_dict()
    assert d["metrics"]["audio"] == {"rel_l2": "nan", "snr_db": "inf"} and d["verdict"] == "fail"
    import json
    assert Record.from_dict(json.loads(json.dumps(d))).verdict is Verdict.FAIL
