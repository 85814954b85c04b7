"""The e2e pieces that need no runtime: bucket choice, host alignment, the audio verdict."""
from __future__ import annotations

import math

import pytest
import torch

from harness.e2e import alignment, pick_bucket
from harness.verdict import Tolerance, Verdict, judge


def test_smallest_bucket_that_fits():
    assert pick_bucket(1) == 120 and pick_bucket(120) == 120 and pick_bucket(121) == 200
    with pytest.raises(ValueError, match="largest synthesizer bucket"):
        pick_bucket(10_000)


def test_alignment_is_one_hot_with_zero_padding():
    pred = torch.tensor([2, 1, 3])
    aln = alignment(pred, n_tokens_total=5, n_frames_total=8)
    assert aln.shape == (1, 5, 8)
    assert aln[0, :, :6].sum(0).eq(1).all()  # each valid frame belongs to exactly one token
    assert aln[0].sum(1).tolist() == [2, 1, 3, 0, 0] and aln[0, :, 6:].sum() == 0


def audio(pesq=4.5, mcd=0.1, nan=0.0):
    return {"pesq": pesq, "mcd_db": mcd, "nan_rate": nan, "inf_rate": 0.0}


def test_audio_quality_bars():
    tol = Tolerance()
    clean = {"audio": {"rel_l2": 0.01, "floor_rel_l2": 0.01, "nan_rate": 0, "inf_rate": 0, "new_nonfinite": 0}}
    assert judge(clean, tol, {"audio": audio()}, audio_only=True)[0] is Verdict.PASS
    v, why = judge(clean, tol, {"audio": audio(pesq=3.2)}, audio_only=True)
    assert v is Verdict.FAIL and "PESQ 3.20 < 4.0" in why
    assert judge(clean, tol, {"audio": audio(mcd=0.9)}, audio_only=True)[0] is Verdict.FAIL
    assert judge(clean, tol, {"audio": audio(pesq=math.nan)}, audio_only=True)[0] is Verdict.FAIL
    assert judge(clean, Tolerance(min_pesq=3.0), {"audio": audio(pesq=3.2)}, audio_only=True)[0] is Verdict.PASS
    # the unforced audio (other durations) is reported, not judged
    assert judge(clean, tol, {"audio": audio(), "audio_unforced": audio(pesq=1.0)}, audio_only=True)[0] is Verdict.PASS


def test_audio_only_still_fails_on_nan():
    bad = {"audio": {"rel_l2": math.nan, "nan_rate": 1.0, "inf_rate": 0, "new_nonfinite": 10}}
    assert judge(bad, Tolerance(), {"audio": audio()}, audio_only=True)[0] is Verdict.FAIL
