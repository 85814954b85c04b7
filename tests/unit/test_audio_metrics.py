"""harness.metrics.audio on synthetic signals whose scores theory predicts.

The test signal is speech-like (PESQ needs utterances, not tones): a band-limited harmonic
source with a wandering f0 (declination, intonation, jitter) and aspiration noise, shaped by
vowel formant resonators, cut into syllables of 140-240 ms with pauses and occasional
fricatives; 3 s at 24 kHz, peak 0.5, seeded.
"""
from __future__ import annotations

import math
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest
from scipy import signal as sps

from harness.metrics import audio as A

SR = 24000
KEYS = {"pesq", "mcd_db", "logmel_corr", "logmel_mad_db", "rms_ratio_db", "mrstft", "mrstft_sc",
        "mrstft_mag", "nan_rate", "inf_rate", "max_abs", "snr_db", "length_ratio"}
SPECTRAL = ("pesq", "mcd_db", "logmel_corr", "logmel_mad_db", "rms_ratio_db", "mrstft", "mrstft_sc", "mrstft_mag")
GAIN_DB = 20 * math.log10(0.5)  # -6.0206
PESQ_WB_MAX = 4.644  # P.862.2 mapping of the raw maximum 4.5


def speech_like(sr: int = SR, seconds: float = 3.0, seed: int = 1234) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(sr * seconds)
    t = np.arange(n) / sr
    jitter = sps.lfilter([0.002], [1, -0.998], rng.standard_normal(n))
    f0 = 140.0 - 20.0 * t / seconds + 20.0 * np.sin(2 * np.pi * 0.9 * t + 0.3) + 40.0 * jitter
    phase = 2 * np.pi * np.cumsum(f0) / sr
    source = np.zeros(n)
    for k in range(1, 90):  # 1/k harmonics (glottal source + lip radiation), band-limited
        source += np.where(k * f0 < 0.45 * sr, 1.0 / k, 0.0) * np.sin(k * phase)
    source += 0.02 * rng.standard_normal(n)  # aspiration
    vowels = [(730, 1090, 2440), (270, 2290, 3010), (530, 1840, 2480), (570, 840, 2410), (300, 870, 2240)]
    filtered = []
    for formants in vowels:
        y = source
        for f, bw in zip(formants, (90, 110, 170)):
            r = np.exp(-np.pi * bw / sr)
            y = sps.lfilter([1.0], [1.0, -2 * r * np.cos(2 * np.pi * f / sr), r * r], y)
        filtered.append(y / np.std(y))
    b, a = sps.butter(4, 3500 / (sr / 2), "high")
    hiss = sps.lfilter(b, a, rng.standard_normal(n))
    hiss /= np.std(hiss)
    out = np.zeros(n)
    pos = int(0.25 * sr)
    while pos < n - int(0.4 * sr):
        length = int(rng.uniform(0.14, 0.24) * sr)  # a syllable: ~4-5 per second with the gaps
        env = np.hanning(length) ** 0.6 * rng.uniform(0.5, 1.0)
        out[pos:pos + length] += env * filtered[rng.integers(len(vowels))][pos:pos + length]
        pos += length
        if rng.random() < 0.3:  # a fricative after some syllables
            fl = int(rng.uniform(0.04, 0.08) * sr)
            out[pos:pos + fl] += 0.15 * np.hanning(fl) * hiss[pos:pos + fl]
            pos += fl
        pos += int(rng.uniform(0.0, 0.1) * sr)
    return 0.5 * out / np.max(np.abs(out))


def with_noise(x: np.ndarray, snr_db: float, seed: int = 7) -> np.ndarray:
    """x plus white noise scaled so that sum(x^2) / sum(noise^2) is exactly 10^(snr/10)."""
    w = np.random.default_rng(seed).standard_normal(len(x))
    return x + w * math.sqrt(np.sum(x**2) / np.sum(w**2) / 10 ** (snr_db / 10))


def delayed(x: np.ndarray, k: int) -> np.ndarray:
    return np.concatenate([np.zeros(k), x[:-k]])


@pytest.fixture(scope="module")
def ref() -> np.ndarray:
    return speech_like()


def test_signal_is_speech_like(ref):
    assert ref.shape == (3 * SR,) and np.max(np.abs(ref)) == pytest.approx(0.5)
    assert np.array_equal(ref, speech_like())  # seeded
    active = np.abs(ref) > 1e-3
    assert 0.4 < active.mean() < 0.95  # syllables and pauses


def test_identical(ref):
    m, notes = A.audio_metrics_with_notes(ref, ref.copy())
    assert set(m) == KEYS and notes == {}
    assert all(isinstance(v, float) for v in m.values())
    assert m["snr_db"] == math.inf
    assert m["max_abs"] == 0.0
    assert m["mcd_db"] == pytest.approx(0.0, abs=1e-9)
    assert m["logmel_corr"] == pytest.approx(1.0, abs=1e-12)
    assert m["logmel_mad_db"] == 0.0
    assert m["rms_ratio_db"] == 0.0
    assert m["mrstft"] == 0.0
    assert m["nan_rate"] == m["inf_rate"] == 0.0
    assert m["length_ratio"] == 1.0
    assert m["pesq"] == pytest.approx(PESQ_WB_MAX, abs=0.01)


def test_gain_half(ref):
    m = A.audio_metrics(ref, 0.5 * ref)
    assert m["rms_ratio_db"] == pytest.approx(GAIN_DB, abs=1e-9)  # -6.0206 dB
    assert m["snr_db"] == pytest.approx(-GAIN_DB, abs=1e-9)  # error = 0.5 ref -> 6.0206 dB
    assert m["max_abs"] == pytest.approx(0.25)  # half the 0.5 peak
    # each log spectrum (and its own 80 dB floor) shifts by exactly 6.02 dB
    assert m["logmel_corr"] == pytest.approx(1.0, abs=1e-9)
    assert m["logmel_mad_db"] == pytest.approx(-GAIN_DB, abs=1e-6)
    # a gain only moves c0, which MCD excludes
    assert m["mcd_db"] == pytest.approx(0.0, abs=1e-6)
    # spectral convergence of 0.5*Y against Y is 0.5; the log term is ln 2 except where PWG's clamp bites
    assert m["mrstft_sc"] == pytest.approx(0.5, abs=1e-4)
    assert 0.0 < m["mrstft_mag"] < math.log(2) + 1e-9
    assert m["pesq"] == pytest.approx(PESQ_WB_MAX, abs=0.01)  # PESQ normalises level


def test_white_noise_20db(ref):
    m = A.audio_metrics(ref, with_noise(ref, 20.0))
    assert m["snr_db"] == pytest.approx(20.0, abs=0.1)
    # uncorrelated noise adds power: 10*log10(1 + 1/100) = 0.043 dB
    assert m["rms_ratio_db"] == pytest.approx(10 * math.log10(1.01), abs=0.01)
    assert m["pesq"] < 3.0
    assert m["mcd_db"] > 3.0
    assert m["logmel_corr"] < 0.98
    assert m["mrstft_sc"] == pytest.approx(0.1, abs=0.02)  # ~ sqrt(noise/signal) = 0.1
    assert m["max_abs"] > 0.0 and m["nan_rate"] == 0.0


def test_pesq_falls_with_snr(ref):
    scores = [A.pesq_wb(ref, with_noise(ref, snr)) for snr in (10.0, 30.0, 50.0)]
    assert scores == sorted(scores) and scores[0] < 1.5 < 2.5 < scores[2] < 4.0


@pytest.mark.parametrize("shift, snr_below", [(1, 20.0), (240, 0.0)])
def test_time_shift(ref, shift, snr_below):
    m = A.audio_metrics(ref, delayed(ref, shift))
    # 1 sample: the error is a first difference (~15 dB for this spectrum); 10 ms: the
    # signals are nearly uncorrelated, error power ~2x the signal, SNR ~ -3 dB
    assert m["snr_db"] < snr_below
    assert m["logmel_corr"] > 0.95
    assert m["rms_ratio_db"] == pytest.approx(0.0, abs=0.01)  # only leading/trailing silence moved
    assert m["pesq"] > 4.5  # PESQ aligns in time itself


def test_mcd_dtw_undoes_a_shift(ref):
    cand = delayed(ref, 240)
    framewise, aligned = A.mcd_db(ref, cand), A.mcd_db(ref, cand, dtw=True)
    assert framewise > 1.0
    assert aligned < 0.05  # 240 samples = 2 hops of 5 ms: DTW finds the exact offset


def test_silent_candidate(ref):
    m, notes = A.audio_metrics_with_notes(ref, np.zeros_like(ref))
    assert m["rms_ratio_db"] == -math.inf
    assert m["snr_db"] == pytest.approx(0.0, abs=1e-12)  # the error is the whole reference
    assert m["max_abs"] == pytest.approx(0.5)
    assert math.isnan(m["pesq"]) and "utterance" in notes["pesq"]
    assert math.isnan(m["logmel_corr"]) and "constant" in notes["logmel_corr"]
    assert m["logmel_mad_db"] > 30.0
    assert m["mcd_db"] > 5.0
    assert m["mrstft_sc"] == pytest.approx(1.0, abs=1e-3)  # ||Y - 0|| / ||Y||, up to the clamp
    assert m["nan_rate"] == m["inf_rate"] == 0.0


def test_both_silent():
    z = np.zeros(SR)
    m, notes = A.audio_metrics_with_notes(z, z.copy())
    assert m["snr_db"] == math.inf and m["rms_ratio_db"] == 0.0 and m["mcd_db"] == 0.0
    assert m["logmel_corr"] == 1.0  # identical, though constant
    assert math.isnan(m["pesq"]) and set(notes) == {"pesq"}


def test_nan_candidate(ref):
    m, notes = A.audio_metrics_with_notes(ref, np.full_like(ref, np.nan))
    assert m["nan_rate"] == 1.0 and m["inf_rate"] == 0.0
    for key in SPECTRAL:
        assert math.isnan(m[key]), key
        assert "NaN/Inf" in notes[key]
    assert m["max_abs"] == math.inf and m["snr_db"] == -math.inf  # worst, not NaN


def test_one_inf_sample_poisons_spectral_metrics(ref):
    cand = ref.copy()
    cand[1000] = -np.inf
    m = A.audio_metrics(ref, cand)
    assert m["inf_rate"] == pytest.approx(1 / len(ref)) and m["nan_rate"] == 0.0
    assert all(math.isnan(m[key]) for key in SPECTRAL)
    assert m["max_abs"] == math.inf and m["snr_db"] == -math.inf


def test_length_mismatch_compares_common_prefix(ref):
    shorter = A.audio_metrics(ref, ref[:-2400])
    assert shorter["length_ratio"] == pytest.approx(1 - 2400 / len(ref))
    assert shorter["snr_db"] == math.inf and shorter["mcd_db"] == pytest.approx(0.0, abs=1e-9)
    longer = np.concatenate([ref, np.full(SR, np.nan)])  # the tail is not compared ...
    m = A.audio_metrics(ref, longer)
    assert m["length_ratio"] == pytest.approx(4 / 3)
    assert m["nan_rate"] == pytest.approx(0.25)  # ... but the rates cover the whole candidate
    assert math.isnan(m["mcd_db"])


def test_too_short_for_spectra(ref):
    x = ref[8000:9000]
    assert np.any(x)
    m, notes = A.audio_metrics_with_notes(x, 0.5 * x)
    assert m["snr_db"] == pytest.approx(-GAIN_DB) and m["rms_ratio_db"] == pytest.approx(GAIN_DB)
    assert all(math.isnan(m[k]) for k in ("pesq", "mcd_db", "logmel_corr", "mrstft"))
    assert "2048" in notes["mcd_db"]


def test_reference_must_be_finite(ref):
    bad = ref.copy()
    bad[0] = np.nan
    with pytest.raises(ValueError, match="reference"):
        A.audio_metrics(bad, ref)
    with pytest.raises(ValueError, match="mono"):
        A.snr_db(np.zeros((2, 100)), np.zeros((2, 100)))


def test_single_functions_agree_with_the_dict(ref):
    cand = with_noise(ref, 30.0)[None, :]  # (1, N) is accepted as mono
    m = A.audio_metrics(ref, cand)
    assert A.pesq_wb(ref, cand) == m["pesq"]
    assert A.mcd_db(ref, cand) == m["mcd_db"]
    assert A.logmel_corr(ref, cand) == m["logmel_corr"]
    assert A.logmel_mad_db(ref, cand) == m["logmel_mad_db"]
    assert A.rms_ratio_db(ref, cand) == m["rms_ratio_db"]
    assert A.mrstft(ref, cand) == pytest.approx(m["mrstft"], rel=1e-12)
    assert A.max_abs_error(ref, cand) == m["max_abs"]
    assert A.snr_db(ref, cand) == m["snr_db"]
    assert A.nan_rate(cand) == m["nan_rate"] and A.inf_rate(cand) == m["inf_rate"]
    assert A.mcd_db(cand, ref) == pytest.approx(m["mcd_db"], rel=1e-9)  # symmetric


def test_batched_mel_cepstrum_equals_pysptk_sp2mc(ref):
    pysptk = A._import_pysptk()
    power = A._mcep_power(ref, SR)[::7]
    floor = A._floor_below(float(power.max()))
    expected = pysptk.sp2mc(np.maximum(power, floor), 24, 0.466)
    got = A._sp2mc(power, 24, 0.466, floor)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-10)
    assert A.mel_cepstrum(ref, SR).shape == (len(ref) // 120 + 1, 25)


def test_write_wav_roundtrip(tmp_path):
    x = np.array([0.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0, np.nan, np.inf, -np.inf, 1e-5], dtype=np.float32)
    path = A.write_wav(tmp_path / "sub" / "a.wav", x, SR)
    assert path == tmp_path / "sub" / "a.wav"
    assert [p.name for p in path.parent.iterdir()] == ["a.wav"]  # no temp file left behind
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()) == (1, 2, SR, len(x))
        pcm = np.frombuffer(w.readframes(len(x)), dtype="<i2")
    assert pcm.tolist() == [0, 16384, -16384, 32767, -32767, 32767, -32767, 0, 32767, -32767, 0]


def test_import_is_light():
    code = ("import sys, harness.metrics.audio; "
            "print(sorted(m for m in ('torch', 'librosa', 'pesq', 'pysptk', 'soxr') if m in sys.modules))")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "[]"
