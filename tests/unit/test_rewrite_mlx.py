"""mlx-audio's MLX Kokoro judged module by module (harness/rewrite) on the seeded random model's
tiny case: a clean run keeps every mapped module within its floor, a fault injected into the
rewrite is named at its module with its kind, and a bad adapter is one error naming the file,
the field and the nearest module paths."""
from __future__ import annotations

import importlib.util

import pytest

from harness.rewrite import RewriteError, RewriteItem, load_adapter, resolve_modules
from harness.rewrite.item import run_rewrite_item

from .conftest import tiny_session_at

MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_audio") is not None
needs_mlx = pytest.mark.skipif(not MLX, reason="mlx-audio not installed (pip install -e '.[mlx]')")

# The generator's subtree: where both injected faults sit, and enough modules (20) to show which
# one the table names first. The clean run maps every module.
GENERATOR = "decoder.generator"


def test_a_module_path_kokoro_does_not_have_names_the_file_the_field_and_the_nearest(tmp_path):
    from harness.port.tensors import module_paths

    bad = tmp_path / "my_adapter.py"
    bad.write_text("from harness.rewrite.adapter import Adapter\n\n"
                   "class Mine(Adapter):\n    name = 'mine'\n"
                   "    modules = {'decoder.generater.m_source': 'call'}\n\nADAPTER = Mine()\n")
    adapter = load_adapter(str(bad))
    with pytest.raises(RewriteError) as e:
        resolve_modules(adapter, module_paths(), str(bad))
    msg = str(e.value)
    assert str(bad) in msg and "field 'modules'" in msg and "'decoder.generater.m_source'" in msg
    assert "decoder.generator.m_source" in msg.split("nearest:")[1]
    none = tmp_path / "empty.py"
    none.write_text("x = 1\n")
    with pytest.raises(RewriteError, match=r"empty\.py: field 'ADAPTER'"):
        load_adapter(str(none))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with tiny_session_at(tmp_path_factory.mktemp("rewrite")) as session:
        session.noise_k = 4
        yield session


def item_for(session, prefix: str = "") -> RewriteItem:
    from harness.port.tensors import module_paths

    adapter = load_adapter("mlx-audio")
    mapped = tuple(m for m in resolve_modules(adapter, module_paths(), "mlx-audio")
                   if m.path == prefix or m.path.startswith(prefix + "."))
    return RewriteItem("tiny", "mlx-audio", adapter, mapped)


@needs_mlx
@pytest.mark.slow
def test_every_mapped_module_is_within_its_floor_on_a_clean_run(tiny):
    rec = run_rewrite_item(tiny, item_for(tiny))
    rows = {r["stage"]: r["outputs"]["out"]["local"] for r in rec.stages}
    assert len(rows) >= 60 and {"bert", "text_encoder", "decoder", GENERATOR} <= set(rows)
    outside = {p: m["why"] for p, m in rows.items() if not m["ok"]}
    assert not outside, outside
    assert all(m["floor_rel_l2"] > 0 and m["rel_l2"] <= 4 * m["floor_rel_l2"] or m["rel_l2"] <= 1e-5
               for m in rows.values())
    assert rec.durations["tokens_differ"] == 0
    assert rec.verdict.value == "pass", rec.reason


def modules_only():
    """The mlx-audio adapter without its tokens -> audio entry: a fault test judges the modules."""
    from harness.rewrite.mlx_audio import MlxAudio

    class ModulesOnly(MlxAudio):
        def synthesize(self, *a, **kw):
            return None

    return ModulesOnly()


@needs_mlx
@pytest.mark.slow
def test_a_wrong_inverse_stft_normalization_is_named_at_the_generator_as_a_gain(tiny, monkeypatch):
    from mlx_audio.tts.models.kokoro import istftnet

    real = istftnet.istft
    monkeypatch.setattr(istftnet, "istft", lambda *a, **kw: real(*a, **{**kw, "normalized": False}))
    item = item_for(tiny, GENERATOR)
    rec = run_rewrite_item(tiny, RewriteItem(item.case, item.spec, modules_only(), item.mapped))
    failing = [r["stage"] for r in rec.stages if not r["local_ok"]]
    assert failing == [GENERATOR], failing  # every module inside it is within its floor
    assert f"first module whose local error leaves its floor: '{GENERATOR}' (constant gain x0.75" in rec.reason
    assert "-2.50 dB" in rec.reason


@needs_mlx
@pytest.mark.slow
def test_a_nan_in_one_adain_is_named_at_that_adain(tiny, monkeypatch):
    import mlx.core as mx
    from mlx_audio.tts.models.kokoro import istftnet

    from harness.rewrite.mlx_audio import counterpart

    target = "decoder.generator.resblocks.1.adain2.0"
    adapter = modules_only()
    real_load, real_call, victim = adapter.load, istftnet.AdaIN1d.__call__, []

    def load(kmodel):
        model = real_load(kmodel)
        victim.append(counterpart(model, target))
        return model

    def poisoned(self, x, s):
        out = real_call(self, x, s)
        return out * mx.array(float("nan")) if victim and self is victim[0] else out

    monkeypatch.setattr(adapter, "load", load)
    monkeypatch.setattr(istftnet.AdaIN1d, "__call__", poisoned)
    item = item_for(tiny, GENERATOR)
    rec = run_rewrite_item(tiny, RewriteItem(item.case, item.spec, adapter, item.mapped))
    failing = [r["stage"] for r in rec.stages if not r["local_ok"]]
    assert failing[0] == target and "NaN" in rec.reason.split(";")[0], rec.reason
    assert set(failing) == {target, "decoder.generator.resblocks.1", GENERATOR}
    assert rec.verdict.value == "fail"
