"""mlx-audio's MLX Kokoro judged module by module (harness/rewrite) on the seeded random model's
tiny case: a clean run keeps every mapped module within its floor, a fault injected into the
rewrite is named at its module with its kind, and a bad adapter is one error naming the file,
the field and the nearest module paths."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from harness.plumbing import stopping
from harness.record import Record
from harness.rewrite import RewriteError, RewriteItem, load_adapter, resolve_modules
from harness.repro import run_repro
from harness.rewrite.adapter import Adapter, Mapped
from harness.rewrite.item import run_rewrite_item

from .conftest import tiny_session_at

MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_audio") is not None
needs_mlx = pytest.mark.skipif(not MLX, reason="mlx-audio not installed (pip install -e '.[mlx]')")

# MLX's CPU convolutions are slow (the whole vocoder: about a minute on the tiny case's 36 frames on
# a busy 2-core machine), so the clean run leaves out the decoder's own row (the same vocoder as
# the generator's row, which it keeps) and the fault tests map only the modules they need.
GENERATOR = "decoder.generator"


def test_a_module_path_kokoro_does_not_have_names_the_file_the_field_and_the_nearest(tmp_path, random_model):
    paths = tuple(p for p, _ in random_model.kmodel.named_modules() if p)
    bad = tmp_path / "my_adapter.py"
    bad.write_text("from harness.rewrite.adapter import Adapter\n\n"
                   "class Mine(Adapter):\n    name = 'mine'\n"
                   "    modules = {'decoder.generater.m_source': 'call'}\n\nADAPTER = Mine()\n")
    adapter = load_adapter(str(bad))
    with pytest.raises(RewriteError) as e:
        resolve_modules(adapter, paths, str(bad))
    msg = str(e.value)
    assert str(bad) in msg and "field 'modules'" in msg and "'decoder.generater.m_source'" in msg
    assert "decoder.generator.m_source" in msg.split("nearest:")[1]
    calls = tmp_path / "calls.py"
    calls.write_text("from harness.rewrite.adapter import Adapter\n\n"
                     "class Mine(Adapter):\n    name = 'mine'\n    modules = {'decoder.generator': 'call'}\n"
                     "    calls = {'decoder.generator.sftf.inverse': 'call'}\n\nADAPTER = Mine()\n")
    with pytest.raises(RewriteError) as e:
        resolve_modules(load_adapter(str(calls)), paths, str(calls))
    assert "field 'calls'" in str(e.value) and "decoder.generator.stft" in str(e.value).split("nearest modules:")[1]
    none = tmp_path / "empty.py"
    none.write_text("x = 1\n")
    with pytest.raises(RewriteError, match=r"empty\.py: field 'ADAPTER'"):
        load_adapter(str(none))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    with tiny_session_at(tmp_path_factory.mktemp("rewrite")) as session:
        yield session


def item_for(session, keep=lambda path: path != "decoder", adapter=None) -> RewriteItem:
    adapter = adapter or load_adapter("mlx-audio")
    paths = tuple(p for p, _ in session.model.kmodel.named_modules() if p)
    mapped = tuple(m for m in resolve_modules(adapter, paths, "mlx-audio") if keep(m.path))
    return RewriteItem("tiny", "mlx-audio", adapter, mapped)


def test_captures_hold_the_running_modules_inputs_and_one_output_never_a_whole_step(tiny):
    """Each module is handed on from inside the reference run that captured it and dropped: the
    peak bytes held are one module's inputs and outputs plus the inputs of its mapped ancestors
    still running, a fraction of the decoder step's captures held together."""
    from harness.rewrite.captures import module_io, nbytes, reference_models

    paths = [m.path for m in item_for(tiny, keep=lambda p: p.startswith("decoder")).mapped]
    sizes, order = {}, []

    def consume(io):
        sizes[io.path] = (nbytes((io.args, io.kwargs)), nbytes((io.out64, io.out32)))
        order.append(io.path)

    peak = module_io(*reference_models(tiny.model.kmodel), tiny.traces("tiny"), paths, consume)
    assert sorted(order) == sorted(paths) and len(paths) > 50
    assert order.index(f"{GENERATOR}.m_source") < order.index(GENERATOR) < order.index("decoder")  # children first
    whole = sum(i + o for i, o in sizes.values())  # the step's captures held together
    ancestors = {p: sum(sizes[q][0] for q in sizes if p.startswith(q + ".")) for p in sizes}
    assert peak <= max(i + o + ancestors[p] for p, (i, o) in sizes.items())
    assert peak < whole / 4, (peak, whole)


def test_the_first_failing_module_is_written_as_a_bundle_whose_repro_exits_2_without_a_runner(tiny):
    """A rewrite whose adapter has no `repro` (here torch itself, with a 10% gain on one
    convolution) still gets the bundle's data; its repro.py says it cannot run here (2)."""
    import numpy as np
    import torch

    from harness.report import item_table
    from harness.rewrite.adapter import Adapter, Mapped

    class Gain(Adapter):
        name = "gain"
        modules = {"decoder.F0_conv": "call"}

        def load(self, kmodel):
            return kmodel

        def run(self, model, path, convention, args, kwargs):
            with torch.no_grad():
                return model.get_submodule(path)(*args, **kwargs) * 1.1

    rec = run_rewrite_item(tiny, RewriteItem("tiny", "gain.py", Gain(), (Mapped("decoder.F0_conv", "call"),)))
    assert rec.verdict.value == "fail" and rec.bisect["module"] == "decoder.F0_conv"
    bundle = Path(rec.bisect["repro"])
    assert {p.name for p in bundle.iterdir()} == {"inputs.npz", "noise.npz", "expected.npy", "meta.json", "repro.py",
                                                  "REPORT.md"}
    meta = json.loads((bundle / "meta.json").read_text())
    assert meta["module"] == "decoder.F0_conv" and meta["kind"].startswith("constant gain x1.1")
    assert meta["tolerance"] >= 1e-5 and meta["rel_l2"] > meta["tolerance"]
    assert np.load(bundle / "inputs.npz")["arg0"].dtype == np.float32 and np.load(bundle / "expected.npy").dtype == np.float64
    assert "`decoder.F0_conv` leaves its floor" in (bundle / "REPORT.md").read_text()
    assert run_repro(bundle, timeout=120)["exit_code"] == 2
    assert f"repro of decoder.F0_conv: {bundle}" in item_table(rec)


class TorchItself(Adapter):
    """torch as the rewrite (every module within its floor), with a chain of its own that saves each
    mapped module's output (in the chain's temporary directory); `stop_at`: the module call that
    sends this process SIGTERM."""

    name = "torch"
    modules = {p: "call" for p in ("decoder.F0_conv", "decoder.N_conv", "decoder.asr_res", "decoder.encode")}

    def __init__(self, stop_at: int = 0) -> None:
        self.stop_at, self.calls, self.chain_files = stop_at, 0, []

    def load(self, kmodel):
        return kmodel

    def chained(self, model, phonemes, ref_s, speed, noise, conventions, save) -> bool:
        for path in conventions:
            save(path, np.zeros(3, np.float32))
        return True

    def run(self, model, path, convention, args, kwargs):
        self.calls += 1
        if self.calls == self.stop_at:
            self.chain_files = [p.name for p in Path(tempfile.gettempdir()).glob("kokoro-parity-chain-*/*")]
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # the handler raises in this thread before the sleep ends
        with torch.no_grad():
            return model.get_submodule(path)(*args, **kwargs)


def test_a_run_stopped_by_sigterm_keeps_the_rows_judged_so_far_and_no_temporary_directory(tiny, tmp_path, monkeypatch):
    """SIGTERM (as the CLI and the plugin turn it into `Stopped`) in the third module: the record on
    disk holds the two rows before it and says where the run stopped; the chain's temporary
    directory is gone. Run to its end, the same item's record is the finished one."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    adapter = TorchItself(stop_at=3)
    item = RewriteItem("tiny", "torch.py", adapter, tuple(Mapped(p, "call") for p in adapter.modules))
    saved = tiny.report_dir / "records" / f"{item.id}.json"
    previous = signal.signal(signal.SIGTERM, stopping._raise)
    try:
        with pytest.raises(stopping.Stopped):
            run_rewrite_item(tiny, item)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(adapter.chain_files) == 4  # the chain's outputs were there while it ran
    assert not list(tmp_path.glob("kokoro-parity-chain-*"))
    rec = Record.from_dict(json.loads(saved.read_text()), str(saved))
    assert rec.verdict.value == "run_error" and rec.reason == "stopped after 2 of 4 modules: SIGTERM"
    assert len(rec.stages) == 2 and all(r["local_ok"] for r in rec.stages)
    done = run_rewrite_item(tiny, item)
    assert done.verdict.value == "pass" and done.reason == "4 modules within their floor" and len(done.stages) == 4
    assert json.loads(saved.read_text())["reason"] == done.reason and not list(tmp_path.glob("kokoro-parity-*"))


@needs_mlx
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KOKORO_PARITY_HEAVY_TESTS"),
                    reason="heavy (every module through MLX's slow CPU convolutions, ~20 min): make heavy-tests; "
                           "CI's twins are the two fault tests, whose untouched modules must stay within")
def test_every_mapped_module_is_within_its_floor_on_a_clean_run_but_albert_s_gelu(tiny):
    """mlx-audio 0.6.2's ALBERT uses the exact (erf) GELU where Kokoro's (transformers' AlbertConfig
    default, `gelu_new`) uses the tanh approximation: its activation and the `bert` around it are
    the only rows outside their floor, the activation first."""
    rec = run_rewrite_item(tiny, item_for(tiny))
    rows = {r["stage"]: r["outputs"]["out"]["local"] for r in rec.stages}
    assert len(rows) >= 100 and {"bert", "text_encoder", "predictor.F0.1", GENERATOR} <= set(rows)
    gelu = "bert.encoder.albert_layer_groups.0.albert_layers.0.activation"
    outside = [p for p, m in rows.items() if not m["ok"]]
    assert outside == [gelu, "bert"], {p: rows[p]["why"] for p in outside}
    assert rows[gelu]["kind"].startswith("noise-like") and rows[gelu]["rel_l2"] > 100 * rows[gelu]["floor_rel_l2"]
    assert all(m["rel_l2"] <= 4 * m["floor_rel_l2"] or m["rel_l2"] <= 1e-5 for p, m in rows.items() if p not in outside)
    assert rec.reason.startswith(f"first module whose local error leaves its floor: {gelu!r} (noise-like")
    assert rec.durations["tokens_differ"] == 0  # the rewrite's own pipeline: its durations are the reference's
    assert all(band["ok"] for band in rec.bands.values()), rec.bands  # and its audio is inside the noise band


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
    inverse = f"{GENERATOR}.stft.inverse"  # a sub-callable of the generator, as is its STFT's transform
    inside = (GENERATOR, f"{GENERATOR}.m_source", f"{GENERATOR}.ups.1", f"{GENERATOR}.conv_post",
              f"{GENERATOR}.stft.transform", inverse)
    rec = run_rewrite_item(tiny, item_for(tiny, inside.__contains__, modules_only()))
    failing = [r["stage"] for r in rec.stages if not r["local_ok"]]
    assert failing == [inverse, GENERATOR] and len(rec.stages) == 6, failing  # the rest inside it is within
    assert {r["stage"]: r.get("inside") for r in rec.stages}[inverse] == f"{GENERATOR}.stft"
    assert f"first module whose local error leaves its floor: '{GENERATOR}' (constant gain x0.74" in rec.reason
    assert f"inside it: '{inverse}' (constant gain x0.75" in rec.reason and "-2.50 dB" in rec.reason
    # mlx-audio's own chain beside each row: drawing Kokoro's noise, its NSF source matches sample by
    # sample, and the generator's output carries the same gain
    chained = {r["stage"]: r["outputs"]["out"]["chained"] for r in rec.stages if "inside" not in r}
    assert all(c.get("rel_l2") is not None for c in chained.values()), chained
    assert chained[f"{GENERATOR}.m_source"]["rel_l2"] < 1e-5
    assert chained[GENERATOR]["kind"].startswith("constant gain x0.7"), chained[GENERATOR]
    # the generator's bundle: its repro.py, run alone in a fresh interpreter, reproduces the fault
    # where mlx-audio has it and is fixed where it does not (the installed, clean mlx-audio)
    bundle = Path(rec.bisect["repro"])
    assert bundle == tiny.report_dir / "repro" / rec.item_id and json.loads((bundle / "meta.json").read_text())["module"] == GENERATOR
    assert {"inputs.npz", "noise.npz", "expected.npy", "meta.json", "repro.py", "REPORT.md", "weights.safetensors",
            "mlx_call.py"} <= {p.name for p in bundle.iterdir()}
    faulty = ("import runpy; from mlx_audio.tts.models.kokoro import istftnet; real = istftnet.istft; "
              "istftnet.istft = lambda *a, **kw: real(*a, **{**kw, 'normalized': False}); "
              "runpy.run_path('repro.py', run_name='__main__')")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([sys.executable, "-c", faulty], cwd=bundle, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 1 and "REPRODUCED" in done.stdout, done.stdout + done.stderr[-2000:]
    clean = run_repro(bundle, timeout=900)
    assert clean["exit_code"] == 0, clean["repro_output"]


@needs_mlx
@pytest.mark.slow
def test_a_nan_in_one_adain_is_named_at_that_adain(tiny, monkeypatch):
    import mlx.core as mx
    from mlx_audio.tts.models.kokoro import istftnet

    from harness.rewrite.mlx_call import counterpart

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
    block = "decoder.generator.resblocks.1"
    rec = run_rewrite_item(tiny, item_for(tiny, lambda p: p == block or p.startswith(block + ".adain"), adapter))
    failing = [r["stage"] for r in rec.stages if not r["local_ok"]]
    # the other five AdaINs are within, and so are the six InstanceNorms inside them: the NaN comes after the norm
    assert len(rec.stages) == 13 and failing == [target, block], failing
    assert f"{target}.norm" in {r["stage"] for r in rec.stages}
    assert rec.reason.startswith(f"first module whose local error leaves its floor: {target!r} (NaN"), rec.reason
    assert rec.verdict.value == "fail"


@needs_mlx
@pytest.mark.slow
def test_a_one_frame_padding_shift_in_a_transposed_convolution_is_named_there_as_a_shift(tiny, monkeypatch):
    """The decoder's upsampling transposed convolution computed with torch's padding (MLX cuts one
    frame from each end) and the missing frame put back as a zero on the left: its output is the
    reference's one frame late; the block around it fails too, its other modules stay within."""
    import mlx.core as mx
    from mlx_audio.tts.models.kokoro import istftnet

    from harness.rewrite.mlx_call import counterpart

    block = "decoder.decode.3"
    target = f"{block}.pool"
    adapter = modules_only()
    real_load, real_call, victim = adapter.load, istftnet.ConvWeighted.__call__, []

    def load(kmodel):
        model = real_load(kmodel)
        victim.append(counterpart(model, target))
        return model

    def padded(self, x, conv):
        if not (victim and self is victim[0]):
            return real_call(self, x, conv)
        self.padding = 1  # 2T - 1 frames; the zero frame, then the one frame AdainResBlk1d cuts
        try:
            return mx.pad(real_call(self, x, conv), [(0, 0), (2, 0), (0, 0)])
        finally:
            self.padding = 0

    monkeypatch.setattr(adapter, "load", load)
    monkeypatch.setattr(istftnet.ConvWeighted, "__call__", padded)
    rec = run_rewrite_item(tiny, item_for(tiny, lambda p: p == block or p.startswith(block + "."), adapter))
    failing = [r["stage"] for r in rec.stages if not r["local_ok"]]
    assert failing == [target, block] and len(rec.stages) == 4, failing  # its two AdaINs are within
    assert rec.reason.startswith(f"first module whose local error leaves its floor: {target!r} (shift by +1 "), rec.reason
    chained = {r["stage"]: r["outputs"]["out"]["chained"] for r in rec.stages}
    assert chained[target]["kind"].startswith("shift by +1 "), chained[target]  # mlx-audio's own chain: the same
