"""Model loading: a user's .pth is loaded strictly, errors name the file and keys, nothing downloads."""
from __future__ import annotations

import pytest
import torch

from harness.model import (PACKAGED_VOICES, build_empty_kmodel, load_model, load_user_weights, load_voice,
                           style_for)


@pytest.fixture(scope="module")
def checkpoint(random_model):
    return {k: getattr(random_model.kmodel, k).state_dict() for k in
            ("bert", "bert_encoder", "predictor", "text_encoder", "decoder")}


def test_user_pth_with_module_prefix_loads_strictly(tmp_path, checkpoint):
    """The official kokoro-v1_0.pth prefixes keys with `module.`; both forms load."""
    path = tmp_path / "kokoro-v1_0.pth"
    torch.save({k: {f"module.{n}": t for n, t in sd.items()} for k, sd in checkpoint.items()}, path)
    m = load_user_weights(path)
    assert m.name == "user-kokoro-v1_0" and len(m.digest) == 16
    w = checkpoint["decoder"]["generator.conv_post.bias"]
    assert torch.equal(m.kmodel.decoder.generator.conv_post.bias, w)


def test_user_pth_problems_are_all_named(tmp_path, checkpoint):
    bad = {k: dict(sd) for k, sd in checkpoint.items()}
    del bad["predictor"]["F0_proj.bias"]
    bad["decoder"]["generator.extra"] = torch.zeros(1)
    path = tmp_path / "bad.pth"
    torch.save(bad, path)
    with pytest.raises(ValueError) as e:
        load_user_weights(path)
    msg = str(e.value)
    assert str(path) in msg and "F0_proj.bias" in msg and "generator.extra" in msg


def test_missing_and_unloadable_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pth"):
        load_user_weights(tmp_path / "nope.pth")
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.pth"):
        load_user_weights(junk)


def test_hf_weights_are_looked_up_offline_only(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import importlib

    import huggingface_hub.constants as c
    importlib.reload(c)
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_model("hf")


def test_random_weights_are_seeded():
    a, b = load_model("random:3"), load_model("random:3")
    assert a.digest == b.digest
    assert torch.equal(a.kmodel.bert_encoder.weight, b.kmodel.bert_encoder.weight)
    assert not torch.equal(a.kmodel.bert_encoder.weight, load_model("random:4").kmodel.bert_encoder.weight)


def test_packaged_voices_and_user_voice(tmp_path):
    for v in PACKAGED_VOICES:
        assert load_voice(v).shape == (510, 1, 256)
    torch.save(torch.ones(510, 256), tmp_path / "mine.pt")
    assert load_voice(str(tmp_path / "mine.pt")).shape == (510, 1, 256)
    assert style_for(load_voice("jf_alpha"), 48).shape == (1, 256)
    with pytest.raises(ValueError, match="neither a packaged voice"):
        load_voice("af_heart")


def test_empty_model_is_the_real_architecture():
    km = build_empty_kmodel(0)
    assert 81e6 < sum(p.numel() for p in km.parameters()) < 83e6
