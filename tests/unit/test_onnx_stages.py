"""Localization inside a whole-model ONNX (the one ONNX localizer: harness/port/onnx_steps.py
localize_modules, its ONNX side harness/port/onnx_stages.py) on the random model's tiny
case: a whole-model ONNX exported here with the module names of the packaged int8 export
(`/encoder/predictor/lstm/...`, `/decoder/decoder/generator/m_source/...`), cut as that export cuts
the harmonic source (the voiced mask computed outside it: a tensor no reference has), with three
independent defects: one in the source, one on the inverse STFT after it, and one in no stage (an
unnamed Mul on the generator's own ops). Every defect is named, ranked by what taking it out alone
does to the audio, and the source is judged locally."""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

SOURCE_GAIN, ISTFT_GAIN = 1.3, 1.5
BETWEEN = "/decoder/decoder/generator/Div_output_0"  # the generator's own `xs / num_kernels`, before ups.1
BETWEEN_GAIN = 1.3


class _Duration(nn.Module):
    """`predictor`'s duration part, called as one module (`/encoder/predictor/lstm/...`)."""

    def __init__(self, p):
        super().__init__()
        self.text_encoder, self.lstm, self.duration_proj = p.text_encoder, p.lstm, p.duration_proj

    def forward(self, d_en, s, input_lengths, text_mask):
        d = self.text_encoder(d_en, s, input_lengths, text_mask)
        x, _ = self.lstm(d)
        return d, self.duration_proj(x)


class _Encoder(nn.Module):
    """KModel.forward_with_tokens up to the decoder, its alignment built from the rounded durations
    in the graph (Round, Clip: found by position)."""

    def __init__(self, km):
        super().__init__()
        self.bert, self.bert_encoder, self.text_encoder = km.bert, km.bert_encoder, km.text_encoder
        self.predictor = _Duration(km.predictor)
        p = km.predictor
        self.shared, self.F0, self.N, self.F0_proj, self.N_proj = p.shared, p.F0, p.N, p.F0_proj, p.N_proj

    def forward(self, input_ids, ref_s, speed):
        n = input_ids.shape[-1]
        lengths, mask = torch.full((1,), n, dtype=torch.long), torch.zeros(1, n, dtype=torch.bool)
        d_en = self.bert_encoder(self.bert(input_ids, attention_mask=(~mask).int())).transpose(-1, -2)
        s = ref_s[:, 128:]
        d, duration = self.predictor(d_en, s, lengths, mask)
        pred_dur = torch.round(torch.sigmoid(duration).sum(-1) / speed).clamp(min=1).long().squeeze()
        ends = torch.cumsum(pred_dur, 0)
        frames = torch.arange(ends[-1])
        aln = ((frames[None] >= (ends - pred_dur)[:, None]) & (frames[None] < ends[:, None])).float()[None]
        x, _ = self.shared((d.transpose(-1, -2) @ aln).transpose(-1, -2))
        F0, N = x.transpose(-1, -2), x.transpose(-1, -2)
        for block in self.F0:
            F0 = block(F0, s)
        for block in self.N:
            N = block(N, s)
        asr = self.text_encoder(input_ids, lengths, mask) @ aln
        return asr, self.F0_proj(F0).squeeze(1), self.N_proj(N).squeeze(1)


class _Decoder(nn.Module):
    def __init__(self, km):
        super().__init__()
        self.decoder = km.decoder

    def forward(self, asr, F0, N, ref_s):
        return self.decoder(asr, F0, N, ref_s[:, :128]).squeeze()


class _Whole(nn.Module):
    def __init__(self, km):
        super().__init__()
        self.encoder, self.decoder = _Encoder(km), _Decoder(km)

    def forward(self, tokens, style, speed):
        return self.decoder(*self.encoder(tokens, style, speed), style)


class _ISTFT(nn.Module):
    """The generator's STFT (of the source) and inverse STFT as one module called `istft`, as
    the packaged export names it; exact (harness.port.splits.ExactSTFT); `gain` on the inverse."""

    def __init__(self, exact, gain: float):
        super().__init__()
        self.exact, self.gain = exact, gain

    def forward(self, a, b=None):
        return self.exact.transform(a) if b is None else self.exact.inverse(a, b) * self.gain


def _generator_forward(self, x, s, f0):
    """kokoro's Generator.forward, the voiced mask computed before the source (outside its scope)."""
    up = self.f0_upsamp(f0[:, None])
    uv = self.m_source.l_sin_gen._f02uv(up).transpose(1, 2)
    har = self.m_source(up.transpose(1, 2), uv)[0].transpose(1, 2).squeeze(1)
    har = torch.cat(self.istft(har), dim=1)
    for i in range(self.num_upsamples):
        x = F.leaky_relu(x, negative_slope=0.1)
        x_source = self.noise_res[i](self.noise_convs[i](har), s)
        x = self.ups[i](x)
        if i == self.num_upsamples - 1:
            x = self.reflection_pad(x)
        x = x + x_source
        xs = sum(self.resblocks[i * self.num_kernels + j](x, s) for j in range(self.num_kernels))
        x = xs / self.num_kernels
    x = self.conv_post(F.leaky_relu(x))
    half = self.post_n_fft // 2 + 1
    return self.istft(torch.exp(x[:, :half]), torch.sin(x[:, half:]))


def _source_forward(self, x, uv, gain: float = 1.0):
    """SourceModuleHnNSF given the voiced mask (equal to its own): SineGen's sine masked by it, its
    noise where unvoiced kept (`sine * uv` alone would drop it: the source of an all-unvoiced case
    a constant, which only its envelope cannot tell from Kokoro's)."""
    sine, _, noise = self.l_sin_gen(x)
    return self.l_tanh(self.l_linear(sine * uv + noise * (1 - uv))) * gain, uv


def export_whole(model, traces, path: Path, source_gain: float = 1.0, istft_gain: float = 1.0) -> Path:
    """The tiny case's whole model (tokens, style, speed -> audio) to ONNX by the TorchScript
    exporter, drawing its own noise as Kokoro does (RandomUniform, RandomNormalLike): with every
    noise zero, the random model's source is a constant whose STFT phase is rounding noise, and
    its vocoder makes float32 and float64 disagree by 76 % (no floor to judge anything by)."""
    import copy

    from harness.patches import apply_patches
    from harness.port import splits
    from harness.port.tensors import reference

    patches = [p for p in splits.EXPORT_PATCHES if p != "noise_as_input"]
    km = copy.deepcopy(apply_patches(model.kmodel, patches))
    gen = km.decoder.generator
    gen.istft = _ISTFT(splits.ExactSTFT(gen.post_n_fft, gen.stft.hop_length), istft_gain)
    gen.forward = types.MethodType(_generator_forward, gen)
    gen.m_source.forward = types.MethodType(lambda self, x, uv: _source_forward(self, x, uv, source_gain),
                                            gen.m_source)
    chain = traces.chain
    args = (chain["input_ids"], reference("ref_s", traces), chain["speed"].reshape(1).float())
    with torch.no_grad():
        torch.onnx.export(_Whole(km).eval(), args, str(path), dynamo=False, opset_version=splits.OPSET,
                          input_names=["tokens", "style", "speed"], output_names=["audio"])
    return path


@pytest.fixture(scope="module")
def localized(tmp_path_factory):
    """The three-defect artifact localized once (shared by the tests below); its verdict (the noise
    band's, `test_port.py`) is not what these tests are about: a failing record stands for it."""
    from harness.port.chain import port_items
    from harness.port.chain_localize import localize_item
    from harness.record import Record
    from harness.verdict import Verdict
    from tests.unit.conftest import tiny_session_at

    root = tmp_path_factory.mktemp("onnx_stages")
    with tiny_session_at(root, run_s=300) as s:
        two = export_whole(s.model, s.traces("tiny"), root / "two.onnx", SOURCE_GAIN, ISTFT_GAIN)
        path = scaled(two, root / "three.onnx", BETWEEN, BETWEEN_GAIN)
        (item,) = port_items(s, [f"e2e={path}"])
        rec = Record(item.case, item.step, item.backend, item.mode, Verdict.FAIL, "audio outside its noise band")
        lines = []
        localize_item(s, item, rec, log=lines.append)
        yield rec, "\n".join(lines)


def _gain(kind: str) -> float:
    found = re.match(r"constant gain x([0-9.]+) ", kind)
    assert found, kind
    return float(found.group(1))


@pytest.mark.slow
def test_three_independent_defects_are_each_named_and_ranked_by_their_audio_effect(localized):
    rec, text = localized
    print(text)
    b = rec.bisect
    assert b["kind"] == "onnx-stages" and b["noise"] == "draws its own", b
    defects = {d["stage"]: d for d in b["defects"]}
    assert set(defects) == {"decoder.generator.m_source", "decoder.generator.istft",
                            "decoder.generator.ups.1:input"}, text
    assert _gain(defects["decoder.generator.istft"]["kind"]) == pytest.approx(ISTFT_GAIN, abs=0.01), text
    assert _gain(defects["decoder.generator.m_source"]["kind"]) == pytest.approx(SOURCE_GAIN, abs=0.03), text
    # the inverse STFT's gain taken out is the audio x1.5 against x1 (SNR 6.02 dB); the source's
    # gain (on the tiny case's unvoiced source: its noise and DC) moves the random model's audio less
    assert abs(defects["decoder.generator.istft"]["moves_audio_snr_db"] - 6.02) < 0.05, text
    assert defects["decoder.generator.m_source"]["moves_audio_snr_db"] > 10, text
    assert b["defects"][0]["stage"] == "decoder.generator.istft", text
    assert [d["rank"] for d in b["defects"]] == [1, 2, 3]
    assert "3 defects: decoder.generator.istft (constant gain x1.4" in rec.reason, rec.reason
    assert rec.reason.index("istft (") < rec.reason.index("m_source (constant gain x1.3"), rec.reason
    assert "3 defects (ranked by their effect on the audio, each taken out alone):" in text


@pytest.mark.slow
def test_the_source_fed_a_tensor_no_reference_has_is_judged_locally(localized):
    rec, text = localized
    row = next(e for e in rec.bisect["stages"] if e["stage"] == "decoder.generator.m_source")
    assert row["mapped"] and "local" in row, row
    assert not row["local"]["ok"] and _gain(row["local"]["kind"]) == pytest.approx(SOURCE_GAIN, abs=0.03), row
    assert any("voiced mask" in how for how in row["fed"].values()), row
    assert row["local"]["judged_by"] == "own noise", row  # it draws its own noise
    assert not row["local"]["measures"]["envelope"]["ok"] and row["local"]["kind"].endswith("(envelope)"), row
    before = [e for e in rec.bisect["stages"][:rec.bisect["stages"].index(row)] if e["mapped"]]
    assert before and all(e["local"]["ok"] for e in before if "local" in e), text


@pytest.mark.slow
def test_every_module_the_names_reach_is_a_stage_of_the_whole_file(localized):
    """The whole file goes through the one ONNX localizer (onnx_steps.localize_modules), as a
    chain's stage does: beside the fixed list it had (bert ... decoder.decode.3, the source,
    conv_post, the tail), the F0 and N blocks, the decoder's other decode blocks and the
    generator's upsamplers, resblocks and noise convolutions are stages, each mapped and judged
    locally within its floor (the two defects are elsewhere); the durations are a row."""
    rec, text = localized
    rows = {e["stage"]: e for e in rec.bisect["stages"]}
    for path in ("predictor.F0.0", "predictor.F0.1.conv1", "predictor.N.2", "decoder.decode.0",
                 "decoder.generator.ups.0", "decoder.generator.resblocks.0", "decoder.generator.noise_convs.0",
                 "decoder.generator.noise_res.0"):
        row = rows.get(path)
        assert row and row["mapped"] and row["local"]["ok"], (path, row, text)
    assert sum(e["mapped"] for e in rows.values()) > 40, text
    assert rows["pred_dur"]["mapped"] and "audio" in rows, text
    # the modules holding the two (the generator, the decoder) are stages too, not named: the innermost are
    assert rows["decoder.generator"]["mapped"] and rows["decoder"]["mapped"], text
    assert {d["stage"] for d in rec.bisect["defects"]} == {"decoder.generator.m_source", "decoder.generator.istft",
                                                         "decoder.generator.ups.1:input"}


def scaled(src: Path, dst: Path, tensor: str, factor: float, name: str = "") -> Path:
    """`src` with `tensor` multiplied by `factor` wherever it is read, by a Mul named `name` (none:
    what a hand edit or an optimizer may leave, in no module's scope)."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    out = f"{tensor}_scaled"
    for node in model.graph.node:
        node.input[:] = [out if x == tensor else x for x in node.input]
    at = next(i for i, node in enumerate(model.graph.node) if tensor in node.output)
    model.graph.initializer.append(numpy_helper.from_array(np.array(factor, np.float32), f"{out}_factor"))
    model.graph.node.insert(at + 1, helper.make_node("Mul", [tensor, f"{out}_factor"], [out], name=name))
    onnx.save(model, str(dst))
    return dst


@pytest.mark.slow
def test_a_defect_between_stages_in_a_node_no_scope_names_is_named_at_the_input_it_computes(localized):
    """The unnamed Mul lies in no stage (placed in the generator, whose own ops sit between its
    children): it is named as the input of the stage it feeds, with its kind, and every other
    input row holds."""
    rec, text = localized
    defects = {d["stage"]: d for d in rec.bisect["defects"]}
    assert _gain(defects["decoder.generator.ups.1:input"]["kind"]) == pytest.approx(BETWEEN_GAIN, abs=0.01), text
    rows = {e["stage"]: e for e in rec.bisect["stages"]}
    inputs = [p for p in rows if p.endswith(":input")]
    assert "decoder.generator.resblocks.0:input" in inputs and len(inputs) > 3, text  # x + x_source, and others
    assert all(rows[p]["local"]["ok"] for p in inputs if p != "decoder.generator.ups.1:input" and "local" in rows[p])
    assert "LeakyRelu" in rows["decoder.generator.ups.1:input"]["what"], rows["decoder.generator.ups.1:input"]
    assert "decoder.generator" not in defects, text  # the parent holding it is not named


def test_stages_are_counted_from_the_models_top_and_a_one_module_file_is_its_inside():
    """choose_stages on a hooked run's shape (no model): a whole model's stages reach the
    generator's resblocks (level 3) and its F0 blocks (level 1, no module around them runs); a
    file of the decoder alone has the same stages inside the decoder, the decoder not one."""
    from harness.port.onnx_steps import choose_stages, reached

    order = ["bert.embeddings", "bert", "predictor.F0.0.conv1", "predictor.F0.0", "decoder.encode.conv1",
             "decoder.encode", "decoder.generator.m_source", "decoder.generator.resblocks.0.convs1.0",
             "decoder.generator.resblocks.0", "decoder.generator.conv_post", "decoder.generator", "decoder",
             "predictor.shared"]
    ran = {"order": order, "calls": {p: 1 for p in order} | {"predictor.shared": 2}, "params": set(order),
           "types": {p: "M" for p in order}, "tensor_in": set(order), "tensor_out": set(order), "paths": order}
    stages, skipped = choose_stages(ran)
    assert stages == [p for p in order if p not in ("decoder.generator.resblocks.0.convs1.0", "predictor.shared")]
    assert list(skipped) == ["predictor.shared"] and "called 2 times" in skipped["predictor.shared"]
    vocoder, _ = choose_stages(reached(ran, [p for p in order if p.startswith("decoder")]))
    assert vocoder == [p for p in stages if p.startswith("decoder.")]


# ---- a NaN never passes (pure functions: no model, no artifact) ---------------------------------

@pytest.mark.parametrize("noisy", [False, True])
@pytest.mark.parametrize("role", ["local", "chained"])
def test_a_nan_stage_output_fails_locally_and_chained_under_every_noise_rule(noisy, role):
    import math

    from harness.port.onnx_stages import judge_row
    from harness.verdict import Tolerance, comparator

    ref = torch.randn(1, 4000, generator=torch.Generator().manual_seed(0))
    value = ref.clone()
    value[0, :10] = math.nan
    entry = judge_row({}, {role: value.numpy()}, ref, ref.double(), comparator(Tolerance()),
                      stochastic=lambda r: noisy)  # noise-dependent: the band would judge it
    assert entry[role]["ok"] is False and entry[role]["why"] == "NaN: 10 of 4000 values non-finite", entry


def test_a_nan_in_the_forced_audio_or_a_band_metric_fails_and_is_said_first():
    import math

    import numpy as np

    from harness.port.noise import DIRECTIONS
    from harness.port.onnx_stages import judge_band
    from harness.verdict import Tolerance

    bands = {m: [0.0, 1.0] for m in DIRECTIONS}
    am = {m: 0.5 for m in DIRECTIONS}
    assert all(v["ok"] for v in judge_band(np.zeros(100), am, bands, Tolerance()).values())
    audio = np.zeros(100)
    audio[3] = math.nan
    out = judge_band(audio, {**am, "pesq": math.nan}, bands, Tolerance())
    assert next(iter(out.values()))["why"] == "audio: NaN: 1 of 100 values non-finite"
    assert not out["pesq"]["ok"] and out["pesq"]["why"].startswith("NaN: pesq is non-finite")
    out = judge_band(np.zeros(100), {**am, "mrstft": math.inf}, bands, Tolerance())
    assert not out["mrstft"]["ok"] and "nonfinite" not in out


def test_the_report_names_every_defect_in_rank_order():
    from harness.port.onnx_stages import defects_reason, stage_lines

    import math

    defects = [{"stage": "decoder.generator.istft", "kind": "constant gain x1.5 (+3.52 dB)", "rank": 1,
                "moves_audio_snr_db": 6.02, "audio_effect": {"logmel_mad_db": {"with": 3.5, "without": 0.25}}},
               {"stage": "decoder.generator.m_source", "kind": "NaN/Inf (3 values)", "rank": 2,
                "moves_audio_snr_db": math.nan, "audio_effect": {}}]
    reason = defects_reason(defects)
    assert reason == ("2 defects: decoder.generator.istft (constant gain x1.5 (+3.52 dB); moves the audio by SNR "
                      "6.02 dB (log-mel distance to the reference 3.5 -> 0.25 dB without it)); "
                      "decoder.generator.m_source (NaN/Inf (3 values); audio effect not measured)"), reason
    lines = stage_lines({"artifact": "m.onnx", "noise": "none drawn", "stages": [], "defects": defects,
                         "first_stage": "decoder.generator.m_source"})
    at = lines.index("2 defects (ranked by their effect on the audio, each taken out alone):")
    assert lines[at + 1].startswith("  1. decoder.generator.istft: constant gain") and "2. decoder" in lines[at + 2]


def test_a_phase_dependent_row_outside_its_floor_reads_band_not_ok():
    """After the harmonic source, the chained values follow the source's phase: a row outside its
    floor there is not judged (the audio band is), and its table word says so instead of "ok"; a
    NaN there still fails."""
    import torch

    from harness.port.onnx_stages import judge_row, stage_lines
    from harness.verdict import Tolerance, comparator

    ref = torch.linspace(-1, 1, 64).double()
    check = comparator(Tolerance(rel_l2=1e-3, floor_multiplier=4.0))
    entry = judge_row({"stage": "decoder.generator.conv_post", "mapped": True},
                      {"chained": (-ref).float().numpy(), "local": ref.float().numpy()}, ref.float(), ref, check,
                      stochastic=lambda role: role == "chained")
    assert entry["chained"]["ok"] and entry["chained"]["by_band"] and "by_band" not in entry["local"]
    b = {"artifact": "m.onnx", "noise": "none drawn", "stages": [entry]}
    row, legend = stage_lines(b)[1], "\n".join(stage_lines(b))
    assert " band " in row and row.split("chained")[1].split()[1] == "band", row
    assert "band: outside the floor sample by sample" in legend
    nan = ref.clone()
    nan[3] = float("nan")
    entry = judge_row({"stage": "x", "mapped": True}, {"chained": nan.float().numpy()}, ref.float(), ref, check,
                      stochastic=lambda role: True)
    assert not entry["chained"]["ok"] and "by_band" not in entry["chained"]


def test_a_nan_in_a_local_cut_is_never_excused_as_fed_otherwise():
    """A local error under a chained value that holds is the cut's (no defect), but not a NaN:
    that row stays a defect whatever its chained value says."""
    from harness.port.onnx_steps import defect_rows, fed_otherwise

    held = {"ok": True, "rel_l2": 1e-7}
    off = fed_otherwise({"stage": "a", "mapped": True, "chained": held, "local": {"ok": False, "rel_l2": 0.3}})
    nan = fed_otherwise({"stage": "b", "mapped": True, "chained": held,
                         "local": {"ok": False, "rel_l2": float("nan"), "nonfinite": True}})
    assert "fed otherwise" in off["note"] and "note" not in nan
    assert [e["stage"] for e in defect_rows([off, nan])] == ["b"]


# ---- a source that draws its own noise: judged by what its phase does not hide -------------------

@pytest.fixture(scope="module")
def source_draws(random_model):
    """Kokoro's own harmonic source (the random model's, its noise as input) on one second of an
    F0 gliding 120 -> 250 Hz, unvoiced at both ends: `draw(seed, f0)`, the reference's F0 and check
    (the default tolerance), and another draw of the reference (onnx_stages.other_draw: the floor)."""
    from harness.patches import apply_patches, provide_noise, sample_noise
    from harness.port.onnx_stages import other_draw
    from harness.verdict import Tolerance, comparator

    km = apply_patches(random_model.kmodel, ["noise_as_input"])
    f0 = torch.linspace(120, 250, 80)[None]
    f0[:, :10] = f0[:, -10:] = 0
    up = km.decoder.generator.f0_upsamp(f0[:, None]).transpose(1, 2)  # [1, 24000, 1], as the source takes it

    def draw(seed: int, f0=up) -> torch.Tensor:
        with torch.no_grad(), provide_noise(sample_noise(seed, f0.shape[1])):
            return km.decoder.generator.m_source(f0)[0]
    with torch.no_grad():
        return types.SimpleNamespace(draw=draw, up=up, ref=draw(0), other=other_draw(km, up),
                                     check=comparator(Tolerance()), km=km)


def test_another_draw_of_the_source_passes_by_each_measure_and_a_gain_fails_by_its_envelope(source_draws):
    from harness.port.onnx_stages import judge_own_noise

    d = source_draws
    third = d.draw(7)
    assert (third - d.ref).norm() > 0.3 * (d.ref - d.ref.mean()).norm()  # sample by sample, another signal
    row = judge_own_noise(third.numpy(), d.ref, d.other, d.check)
    assert row["ok"] and row["judged_by"] == "own noise", row
    assert set(row["measures"]) == {"envelope", "instantaneous frequency", "harmonic magnitudes"}, row
    assert all(m["ok"] and m["floor_rel_l2"] > 0 for m in row["measures"].values()), row
    gain = judge_own_noise((third * SOURCE_GAIN).numpy(), d.ref, d.other, d.check)
    assert not gain["ok"] and _gain(gain["kind"]) == pytest.approx(SOURCE_GAIN, abs=0.03), gain
    assert gain["kind"].endswith("(envelope)") and gain["measures"]["instantaneous frequency"]["ok"], gain


def test_the_source_on_a_doubled_f0_keeps_its_envelope_but_fails_by_its_instantaneous_frequency(source_draws):
    """Kokoro's own source on twice the F0, with the reference's noise: its frame RMS is the
    reference's (what judging by the envelope alone let through), its frequency is not."""
    from harness.port.onnx_stages import judge_own_noise

    d = source_draws
    row = judge_own_noise(d.draw(0, 2 * d.up).numpy(), d.ref, d.other, d.check)
    assert row["measures"]["envelope"]["ok"], row
    assert not row["ok"] and not row["measures"]["instantaneous frequency"]["ok"], row
    assert row["kind"].startswith("frequency x2 (+1.00 octave) in ") and row["kind"].endswith(
        "(instantaneous frequency)"), row
    assert row["why"].startswith("outside its floor by instantaneous frequency"), row


def test_a_nan_in_the_sources_output_fails_and_is_said_first(source_draws):
    import math

    from harness.port.onnx_stages import judge_own_noise

    d = source_draws
    value = d.draw(7).clone()
    value.reshape(-1)[100:103] = math.nan
    row = judge_own_noise(value.numpy(), d.ref, d.other, d.check)
    assert not row["ok"] and row["why"] == "NaN: 3 of 24000 values non-finite", row
