"""Audio-domain parity metrics: a candidate waveform against a reference waveform.

Pure functions on 1-D numpy arrays (float audio, nominally in [-1, 1]); every score is a plain
float, so results drop straight into JSON reports. Heavy libraries are imported inside the
functions that use them, so importing this module costs nothing.

Libraries (why each one):
- ``pesq`` (0.0.4): ludlows' wrapper of the ITU-T P.862/P.862.2 reference C code, the PESQ
  everybody quotes; wideband mode needs 16 kHz input.
- ``soxr``: libsoxr "VHQ" band-limited resampler (already a librosa dependency) for the
  24 kHz -> 16 kHz conversion before PESQ; any input rate works, not only 3:2.
- ``librosa``: the maintained reference implementation of STFT / mel filterbank / power_to_db /
  DTW that TTS papers use, so log-mel and MR-STFT numbers match what people compute elsewhere.
- ``pysptk``: SPTK's ``freqt`` all-pass frequency warping, i.e. ``sp2mc``, the mel-cepstrum of
  the standard MCD recipe (SPTK conventions: c0 is log gain, c1.. one-sided). ``_sp2mc`` runs
  sp2mc's three numpy lines batched and applies freqt as a cached matrix (bit-for-bit the same
  result as ``pysptk.sp2mc``, checked in the tests, ~20x faster than its per-frame loop).
  pysptk 1.0.1 still does ``import pkg_resources`` (removed in setuptools >= 81) for an example
  file we never use; ``_import_pysptk`` provides a throwaway stand-in only for that import.

Conventions (all measured on the common prefix when lengths differ; ``length_ratio`` =
len(candidate) / len(reference) reports the mismatch):
- The reference must be finite (a non-finite golden is a harness bug: ``ValueError``).
- A candidate holding any NaN/Inf gets NaN for every spectral metric (pesq, mcd_db, logmel_*,
  mrstft*, rms_ratio_db); the raw-sample metrics take their worst value instead
  (``max_abs`` = +inf, ``snr_db`` = -inf) so they still sort as "worst" in min/max summaries;
  ``nan_rate`` / ``inf_rate`` (over the whole candidate) say what happened.
- Log spectra are floored at ``DYNAMIC_RANGE_DB`` (80 dB) below each signal's own loudest bin
  (librosa's ``top_db`` convention), so digital silence stays finite, inaudible noise-floor
  detail does not dominate, and a pure gain change is an exact shift (MCD 0, log-mel
  correlation 1, log-mel MAD 6.02 dB for x0.5). Price: a loud click in the candidate lifts its
  floor too. MR-STFT keeps Parallel WaveGAN's absolute clamp (power >= 1e-7) instead.
- NaN always comes with a reason in ``audio_metrics_with_notes`` (e.g. PESQ's
  "No utterances detected" on silence), never an exception.

Metric definitions:
- ``pesq``: P.862.2 wideband MOS-LQO on 16 kHz resampled audio, range ~1.04 .. 4.64.
- ``mcd_db``: (10 / ln 10) * sqrt(2 * sum_{d=1..D} (c_d - c'_d)^2), averaged over frames,
  c0 excluded (so a pure gain change scores 0). Mel-cepstra: Hann 25 ms window, 5 ms hop,
  order D = 24, all-pass constant alpha = pysptk.util.mcepalpha(sample_rate) (0.466 at
  24 kHz), from the STFT power spectrum via ``pysptk.sp2mc`` (no WORLD analysis: no F0 tracker
  decision can perturb the measurement; order 24 smooths away most harmonic structure). Frame-aligned by
  default, because the harness compares time-aligned outputs; ``dtw=True`` aligns with
  ``librosa.sequence.dtw`` first (for outputs whose durations legitimately differ). All frames
  count, including silence where both are silent (those contribute 0 and dilute the mean).
- ``logmel_corr`` / ``logmel_mad_db``: Pearson correlation and mean |difference| in dB over
  the 80-band log-mel power matrix (n_fft 1024, hop 10 ms, Slaney mel, 10*log10, 80 dB
  floor); a silent (constant) candidate has no correlation: NaN + reason, unless identical.
- ``rms_ratio_db``: 20*log10(rms(candidate) / rms(reference)); -inf for a silent candidate.
- ``mrstft``: Parallel WaveGAN's multi-resolution STFT loss, mean over (fft, hop, win) in
  (1024, 120, 600), (2048, 240, 1200), (512, 50, 240) of spectral convergence
  ||ref_mag - cand_mag||_F / ||ref_mag||_F plus mean |log ref_mag - log cand_mag|, magnitudes
  clamped at sqrt(1e-7) like the original; ``mrstft_sc`` and ``mrstft_mag`` are the two parts.
- ``snr_db``: 10*log10(sum ref^2 / sum (ref - cand)^2); +inf when identical.
- ``max_abs``: max |ref - cand|; ``nan_rate`` / ``inf_rate``: fraction of candidate samples.
"""
from __future__ import annotations

import functools
import math
import os
import sys
import types
import wave
from pathlib import Path

import numpy as np

from harness.plumbing.deferred import deferred_import
from harness.plumbing.files import atomic_write

# imported at their first use (harness.plumbing.deferred): a record's reader, the dashboard and the
# report import this module and compute no metric
librosa = deferred_import("librosa")
pesq_lib = deferred_import("pesq")
soxr = deferred_import("soxr")

__all__ = [
    "DYNAMIC_RANGE_DB",
    "MCD_ORDER",
    "MRSTFT_RESOLUTIONS",
    "audio_metrics",
    "audio_metrics_with_notes",
    "inf_rate",
    "logmel_corr",
    "logmel_mad_db",
    "max_abs_error",
    "mcd_db",
    "mel_cepstrum",
    "mrstft",
    "nan_rate",
    "pesq_wb",
    "pesq_wb_with_reason",
    "rms_ratio_db",
    "snr_db",
    "write_wav",
]

DYNAMIC_RANGE_DB = 80.0
MCD_ORDER = 24
PESQ_RATE = 16000
# Parallel WaveGAN defaults: (fft_size, hop_size, win_length).
MRSTFT_RESOLUTIONS: tuple[tuple[int, int, int], ...] = ((1024, 120, 600), (2048, 240, 1200), (512, 50, 240))
_MIN_SPECTRAL_SAMPLES = 2048  # largest FFT above; shorter audio makes the spectral metrics NaN

NAN = float("nan")
Result = tuple[float, "str | None"]  # (value, reason it is NaN or None)


# ----------------------------------------------------------------------------- input handling

def _as_audio(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1:
        squeezed = np.squeeze(a)
        if squeezed.ndim != 1:
            raise ValueError(f"{name}: expected mono 1-D audio, got shape {a.shape}")
        a = squeezed
    if not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{name}: expected real audio samples, got dtype {a.dtype}")
    return a.astype(np.float64, copy=False)


class _Pair:
    """Reference and candidate cut to their common prefix, plus what the checks found."""

    def __init__(self, reference, candidate):
        ref = _as_audio(reference, "reference")
        cand = _as_audio(candidate, "candidate")
        if not np.all(np.isfinite(ref)):
            raise ValueError("reference audio contains NaN/Inf")
        self.full_candidate = cand
        self.ref_len = len(ref)
        self.length_ratio = len(cand) / len(ref) if len(ref) else NAN
        n = min(len(ref), len(cand))
        self.ref, self.cand = ref[:n], cand[:n]
        self.n = n
        self.finite = bool(np.all(np.isfinite(cand)))
        self.cache: dict = {}

    def spectral_reason(self) -> str | None:
        """Why a spectral metric cannot be computed (None when it can)."""
        if not self.finite:
            return "candidate contains NaN/Inf"
        if self.n < _MIN_SPECTRAL_SAMPLES:
            return f"common length {self.n} < {_MIN_SPECTRAL_SAMPLES} samples"
        return None


def _value(result: Result) -> float:
    return result[0]


# ----------------------------------------------------------------------------- raw samples

def nan_rate(candidate) -> float:
    """Fraction of NaN samples in the (whole) candidate; 0.0 for empty audio."""
    c = _as_audio(candidate, "candidate")
    return float(np.mean(np.isnan(c))) if len(c) else 0.0


def inf_rate(candidate) -> float:
    """Fraction of +/-Inf samples in the (whole) candidate; 0.0 for empty audio."""
    c = _as_audio(candidate, "candidate")
    return float(np.mean(np.isinf(c))) if len(c) else 0.0


def _max_abs(p: _Pair) -> Result:
    if p.n == 0:
        return NAN, "no common samples"
    if not p.finite:
        return math.inf, None
    return float(np.max(np.abs(p.ref - p.cand))), None


def max_abs_error(reference, candidate) -> float:
    """max |reference - candidate| over the common prefix (+inf if the candidate is non-finite)."""
    return _value(_max_abs(_Pair(reference, candidate)))


def _snr(p: _Pair) -> Result:
    if p.n == 0:
        return NAN, "no common samples"
    if not p.finite:
        return -math.inf, None
    err = float(np.sum((p.ref - p.cand) ** 2))
    sig = float(np.sum(p.ref**2))
    if err == 0.0:
        return math.inf, None
    if sig == 0.0:
        return -math.inf, None
    return 10.0 * math.log10(sig / err), None


def snr_db(reference, candidate) -> float:
    """10*log10(sum ref^2 / sum (ref - cand)^2) in dB; +inf when identical."""
    return _value(_snr(_Pair(reference, candidate)))


def _rms_ratio(p: _Pair) -> Result:
    if p.n == 0:
        return NAN, "no common samples"
    if not p.finite:
        return NAN, "candidate contains NaN/Inf"
    r = float(np.sqrt(np.mean(p.ref**2)))
    c = float(np.sqrt(np.mean(p.cand**2)))
    if r == 0.0 and c == 0.0:
        return 0.0, None
    if r == 0.0:
        return math.inf, None
    if c == 0.0:
        return -math.inf, None
    return 20.0 * math.log10(c / r), None


def rms_ratio_db(reference, candidate) -> float:
    """Level of the candidate relative to the reference: 20*log10(rms(cand) / rms(ref)) dB."""
    return _value(_rms_ratio(_Pair(reference, candidate)))


# ----------------------------------------------------------------------------- PESQ

def _pesq(p: _Pair, sample_rate: int) -> Result:
    if (reason := p.spectral_reason()) is not None:
        return NAN, reason
    if not np.any(p.ref) or not np.any(p.cand):
        # the pesq wrapper divides by the joint peak and the C code finds no utterance anyway
        return NAN, "pesq: no utterance (reference or candidate is all zeros)"

    ref, cand = p.ref, p.cand
    if sample_rate != PESQ_RATE:
        ref = soxr.resample(ref, sample_rate, PESQ_RATE, quality="VHQ")
        cand = soxr.resample(cand, sample_rate, PESQ_RATE, quality="VHQ")
    try:
        return float(pesq_lib.pesq(PESQ_RATE, ref, cand, "wb")), None
    except (pesq_lib.NoUtterancesError, pesq_lib.BufferTooShortError) as e:
        return NAN, f"pesq: {type(e).__name__}: {e}"


def pesq_wb_with_reason(reference, candidate, sample_rate: int = 24000) -> tuple[float, str | None]:
    """Wideband PESQ (P.862.2 MOS-LQO, max ~4.64) and, when it is NaN, why.

    Audio is resampled to 16 kHz with soxr VHQ. Silence, "no utterances detected", too-short
    audio and non-finite candidates give (NaN, reason) instead of raising.
    """
    return _pesq(_Pair(reference, candidate), sample_rate)


def pesq_wb(reference, candidate, sample_rate: int = 24000) -> float:
    """Wideband PESQ, NaN when it cannot be computed (see `pesq_wb_with_reason`)."""
    return _value(pesq_wb_with_reason(reference, candidate, sample_rate))


# ----------------------------------------------------------------------------- MCD

def _import_pysptk():
    try:
        # heavy runtime: audio metric, imported when computed
        import pysptk
    except ModuleNotFoundError as e:
        if e.name != "pkg_resources" or "pysptk" in sys.modules:
            raise
        # pysptk 1.0.1 imports pkg_resources only for `example_audio_file()`; provide a stand-in
        # for the duration of its import and take it away again.
        sys.modules["pkg_resources"] = types.ModuleType("pkg_resources")
        try:
            for name in [m for m in sys.modules if m == "pysptk" or m.startswith("pysptk.")]:
                del sys.modules[name]
            # heavy runtime: audio metric, imported when computed
            import pysptk
        finally:
            del sys.modules["pkg_resources"]
    return pysptk


def _frames_power(x: np.ndarray, n_fft: int, hop: int, win: int) -> np.ndarray:
    """|STFT|^2, frames on axis 0 (librosa.stft, Hann, centred with reflect padding)."""
    spec = librosa.stft(x, n_fft=n_fft, hop_length=hop, win_length=win, window="hann",
                        center=True, pad_mode="reflect")
    return (np.abs(spec) ** 2).T


def _mcep_power(x: np.ndarray, sample_rate: int) -> np.ndarray:
    """Power spectra for mel-cepstral analysis: Hann 25 ms in an FFT of the next power of 2, 5 ms hop."""
    win = int(round(0.025 * sample_rate))
    return _frames_power(x, 1 << (win - 1).bit_length(), int(round(0.005 * sample_rate)), win)


def _floor_below(peak_power: float) -> float:
    return max(peak_power, 1e-30) * 10 ** (-DYNAMIC_RANGE_DB / 10)


@functools.lru_cache(maxsize=8)
def _mcepalpha(sample_rate: int) -> float:
    return float(_import_pysptk().util.mcepalpha(sample_rate))


@functools.lru_cache(maxsize=8)
def _freqt_matrix(n_in: int, order: int, alpha: float) -> np.ndarray:
    """SPTK `freqt` as the linear map it is: (order + 1, n_in), built once from unit cepstra."""
    return np.ascontiguousarray(_import_pysptk().freqt(np.eye(n_in), order, alpha).T)


def _sp2mc(power: np.ndarray, order: int, alpha: float, floor_power: float) -> np.ndarray:
    """`pysptk.sp2mc` for many frames at once (log -> irfft -> c0/2 -> freqt); same numbers,
    without pysptk's per-frame Python overhead (~0.3 s per 3 s clip)."""
    c = np.fft.irfft(np.log(np.maximum(power, floor_power)), axis=-1)
    c[:, 0] /= 2.0
    return c @ _freqt_matrix(c.shape[1], order, alpha).T


def mel_cepstrum(audio, sample_rate: int = 24000, *, order: int = MCD_ORDER, alpha: float | None = None) -> np.ndarray:
    """Frame-wise mel-cepstra, shape (frames, order + 1), SPTK conventions (`pysptk.sp2mc`).

    Hann 25 ms window in an FFT of the next power of two, 5 ms hop, on the STFT power spectrum
    floored at 80 dB below this signal's loudest bin (keeps log() finite on digital silence, and
    scales with the signal so a gain change moves c0 only). `alpha` defaults to
    pysptk.util.mcepalpha(sample_rate) (0.466 at 24 kHz, 0.41 at 16 kHz).
    """
    power = _mcep_power(_as_audio(audio, "audio"), sample_rate)
    if alpha is None:
        alpha = _mcepalpha(sample_rate)
    return _sp2mc(power, order, float(alpha), _floor_below(float(power.max())))


_MCD_K = 10.0 / math.log(10.0) * math.sqrt(2.0)


def _mcd(p: _Pair, sample_rate: int, order: int, dtw: bool) -> Result:
    if (reason := p.spectral_reason()) is not None:
        return NAN, reason
    c_ref = mel_cepstrum(p.ref, sample_rate, order=order)[:, 1:]
    c_cand = mel_cepstrum(p.cand, sample_rate, order=order)[:, 1:]
    if dtw:
        _, path = librosa.sequence.dtw(X=c_ref.T, Y=c_cand.T, metric="euclidean")
        c_ref, c_cand = c_ref[path[:, 0]], c_cand[path[:, 1]]
    dist = _MCD_K * np.sqrt(np.sum((c_ref - c_cand) ** 2, axis=1))
    return float(np.mean(dist)), None


def mcd_db(reference, candidate, sample_rate: int = 24000, *, order: int = MCD_ORDER, dtw: bool = False) -> float:
    """Mel-cepstral distortion in dB (c0 excluded), frame-aligned unless `dtw=True`.

    `dtw=True` uses librosa.sequence.dtw (numba: the first call in a process JIT-compiles, ~1 s)
    and averages the frame distances along the warping path.
    """
    return _value(_mcd(_Pair(reference, candidate), sample_rate, order, dtw))


# ----------------------------------------------------------------------------- log-mel

def _logmel(x: np.ndarray, sample_rate: int) -> np.ndarray:
    mel = librosa.feature.melspectrogram(
        y=x, sr=sample_rate, n_fft=1024, hop_length=int(round(0.010 * sample_rate)), win_length=1024,
        window="hann", center=True, pad_mode="reflect", power=2.0, n_mels=80, fmin=0.0, fmax=sample_rate / 2)
    return librosa.power_to_db(mel, ref=1.0, amin=1e-10, top_db=DYNAMIC_RANGE_DB)


def _logmel_pair(p: _Pair, sample_rate: int) -> tuple[np.ndarray, np.ndarray]:
    key = ("logmel", sample_rate)
    if key not in p.cache:
        p.cache[key] = (_logmel(p.ref, sample_rate), _logmel(p.cand, sample_rate))
    return p.cache[key]


def _logmel_corr(p: _Pair, sample_rate: int) -> Result:
    if (reason := p.spectral_reason()) is not None:
        return NAN, reason
    ref, cand = _logmel_pair(p, sample_rate)
    if np.array_equal(ref, cand):
        return 1.0, None  # identical, even if constant (both silent)
    ref, cand = ref.ravel() - ref.mean(), cand.ravel() - cand.mean()
    denom = math.sqrt(float(ref @ ref) * float(cand @ cand))
    if denom == 0.0:
        return NAN, "log-mel is constant (silence) in reference or candidate"
    return float(ref @ cand) / denom, None


def logmel_corr(reference, candidate, sample_rate: int = 24000) -> float:
    """Pearson correlation over the whole log-mel matrix (1.0 for identical audio)."""
    return _value(_logmel_corr(_Pair(reference, candidate), sample_rate))


def _logmel_mad(p: _Pair, sample_rate: int) -> Result:
    if (reason := p.spectral_reason()) is not None:
        return NAN, reason
    ref, cand = _logmel_pair(p, sample_rate)
    return float(np.mean(np.abs(ref - cand))), None


def logmel_mad_db(reference, candidate, sample_rate: int = 24000) -> float:
    """Mean |log-mel(ref) - log-mel(cand)| in dB (6.02 for a x0.5 gain change)."""
    return _value(_logmel_mad(_Pair(reference, candidate), sample_rate))


# ----------------------------------------------------------------------------- MR-STFT

def _mrstft(p: _Pair, resolutions=MRSTFT_RESOLUTIONS) -> tuple[float, float, str | None]:
    if (reason := p.spectral_reason()) is not None:
        return NAN, NAN, reason
    sc_total = mag_total = 0.0
    for n_fft, hop, win in resolutions:
        ref_mag = np.sqrt(np.maximum(_frames_power(p.ref, n_fft, hop, win), 1e-7))
        cand_mag = np.sqrt(np.maximum(_frames_power(p.cand, n_fft, hop, win), 1e-7))
        sc_total += float(np.linalg.norm(ref_mag - cand_mag) / np.linalg.norm(ref_mag))
        mag_total += float(np.mean(np.abs(np.log(ref_mag) - np.log(cand_mag))))
    k = len(resolutions)
    return sc_total / k, mag_total / k, None


def mrstft(reference, candidate, resolutions=MRSTFT_RESOLUTIONS) -> float:
    """Parallel WaveGAN multi-resolution STFT distance: spectral convergence + log-magnitude L1."""
    sc, mag, _ = _mrstft(_Pair(reference, candidate), resolutions)
    return sc + mag


# ----------------------------------------------------------------------------- all together

def audio_metrics_with_notes(reference, candidate, sample_rate: int = 24000, *,
                             mcd_dtw: bool = False) -> tuple[dict[str, float], dict[str, str]]:
    """All metrics (see `audio_metrics`) plus {key: reason} for every NaN among them."""
    p = _Pair(reference, candidate)
    values: dict[str, float] = {}
    notes: dict[str, str] = {}

    def put(key: str, result: Result) -> None:
        values[key], reason = result
        if reason is not None:
            notes[key] = reason

    put("pesq", _pesq(p, sample_rate))
    put("mcd_db", _mcd(p, sample_rate, MCD_ORDER, mcd_dtw))
    put("logmel_corr", _logmel_corr(p, sample_rate))
    put("logmel_mad_db", _logmel_mad(p, sample_rate))
    put("rms_ratio_db", _rms_ratio(p))
    sc, mag, reason = _mrstft(p)
    put("mrstft", (sc + mag, reason))
    put("mrstft_sc", (sc, reason))
    put("mrstft_mag", (mag, reason))
    put("nan_rate", (nan_rate(p.full_candidate), None))
    put("inf_rate", (inf_rate(p.full_candidate), None))
    put("max_abs", _max_abs(p))
    put("snr_db", _snr(p))
    put("length_ratio", (p.length_ratio, None if p.ref_len else "empty reference"))
    return values, notes


def audio_metrics(reference, candidate, sample_rate: int = 24000, *, mcd_dtw: bool = False) -> dict[str, float]:
    """Every metric as {key: float}, keys always present and stable:

    pesq, mcd_db, logmel_corr, logmel_mad_db, rms_ratio_db, mrstft (+ mrstft_sc, mrstft_mag),
    nan_rate, inf_rate, max_abs, snr_db, length_ratio. NaN means "could not be computed"; use
    `audio_metrics_with_notes` to learn why.
    """
    return audio_metrics_with_notes(reference, candidate, sample_rate, mcd_dtw=mcd_dtw)[0]


# ----------------------------------------------------------------------------- WAV output

def write_wav(path: str | os.PathLike, audio, sample_rate: int = 24000) -> Path:
    """Write mono float audio as 16-bit PCM WAV, atomically (stdlib `wave`).

    Samples are clipped to [-1, 1] and scaled by 32767 with rounding; NaN is written as 0 and
    +/-Inf as full scale, so a broken candidate can still be listened to (the metrics report it).
    """
    x = _as_audio(audio, "audio")
    x = np.clip(np.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)
    pcm = np.round(x * 32767.0).astype("<i2").tobytes()

    def write(f) -> None:
        with wave.open(f, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(int(sample_rate))
            w.writeframes(pcm)

    return atomic_write(path, write)


def write_audio(report_dir, item_id: str, outputs: dict, valid) -> dict[str, str]:
    """Reference and backend WAVs (valid region) of audio outputs, `{name: (reference, backend)}`,
    so that a person can hear what the metrics summarize: <report_dir>/audio/<item_id>/{reference,
    backend}.wav (a name prefix when there are several). Returns role -> path relative to report_dir."""
    paths = {}
    for name, pair in outputs.items():
        prefix = "" if len(outputs) == 1 else f"{name}-"
        for role, tensor in zip(("reference", "backend"), pair):
            rel = Path("audio") / item_id / f"{prefix}{role}.wav"
            write_wav(Path(report_dir) / rel, valid(name, tensor).detach().cpu().numpy())
            paths[prefix + role] = rel.as_posix()
    return paths
