"""The example splits of Kokoro that shipped ports use: the 3-stage split (duration |
alignment on the host | prosody | decoder) and the 7-stage one (Albert | PostAlbert | Alignment |
Prosody | Noise | Vocoder up to `conv_post` | Tail), each stage a small torch module around the
model's own submodules, exported to ONNX with its port file (examples/kokoro-3stage,
examples/kokoro-7stage), or converted to Core ML (harness/port/coreml_splits.py).

Kokoro's TorchSTFT calls torch.stft/istft, which have no ONNX form; kokoro's own CustomSTFT
replicates instead of reflecting and approximates the inverse (it moves the audio by 47-50 %). `ExactSTFT` is torch.stft/istft (center, reflect, Hann, onesided) written with
convolutions, equal to them within float32 rounding, so a clean split is judged clean.

A stage can carry a known defect, which the chain must name (tests/unit/test_port_examples.py):
its outputs times a constant (`Defect`: gain 1.1, or -1 for a sign flip); in a stage with the
harmonic source's STFT, the ONNX exporter's own atan2 (-pi where torch gives pi: the defect of a
public Core ML port's noise stage, heard as clicks); and the trace mistakes the public ports'
authors found by hand: dropout left active (`dropout`), weight_norm left unnormalized
(`weight_norm`: the raw direction `weight_v` as the weight), float inputs rounded to float16
inside a stage the chain declares float32 (`fp16_inputs`).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import onnx
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..backends.prebuilt import describe
from ..model import build_empty_kmodel
from ..patches import apply_patches, provide_noise
from ..plumbing.errors import UsageError
from ..plumbing.files import atomic_write_text
from ..steps import BertStep, DurationStageStep, F0NStep, TextEncoderStep
from . import tensors

# The patches every exported stage needs: noise as inputs, no dropout, weight_norm folded, the
# LSTMs unpacked (exact at batch 1 on exact lengths).
EXPORT_PATCHES = ("noise_as_input", "dropout_identity", "fold_weight_norm", "no_packing")
HAR = "decoder.generator.noise_convs.0:in"  # the harmonic source's STFT (magnitude | phase)
CONV_POST = "decoder.generator.conv_post:out"  # the vocoder before exp, sin and the inverse STFT
OPSET = 17


class ExactSTFT(nn.Module):
    """torch.stft / torch.istft of kokoro's TorchSTFT (center=True, reflect padding, periodic Hann,
    onesided) with 1-D convolutions: exportable to ONNX, equal within float32 rounding."""

    def __init__(self, n_fft: int, hop: int, raw_atan2: bool = False):
        super().__init__()
        self.n_fft, self.hop, self.raw_atan2 = n_fft, hop, raw_atan2
        bins = n_fft // 2 + 1
        n = torch.arange(n_fft, dtype=torch.float64)
        k = torch.arange(bins, dtype=torch.float64)[:, None]
        window = torch.hann_window(n_fft, periodic=True, dtype=torch.float64)
        angle = 2 * math.pi * k * n / n_fft
        sin = torch.sin(angle)
        sin[0], sin[-1] = 0.0, 0.0  # DC and Nyquist: exactly real, as the FFT gives them
        # forward: X[k] = sum_n w[n] x[n] e^{-j 2 pi k n / N}
        self.register_buffer("fwd", torch.cat([torch.cos(angle) * window, -sin * window])[:, None].float())
        # inverse: irfft (bins 1..N/2-1 counted twice), windowed, overlap-added
        scale = torch.full((bins, 1), 2.0 / n_fft, dtype=torch.float64)
        scale[0], scale[-1] = 1.0 / n_fft, 1.0 / n_fft
        self.register_buffer("inv", torch.cat([torch.cos(angle) * scale * window,
                                               -sin * scale * window])[:, None].float())
        self.register_buffer("window_sq", (window ** 2)[None, None].float())

    def transform(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, samples] -> magnitude, phase [B, N/2+1, frames]."""
        pad = self.n_fft // 2
        x = F.pad(x[:, None], (pad, pad), mode="reflect")
        re, im = F.conv1d(x, self.fwd, stride=self.hop).chunk(2, dim=1)
        return torch.sqrt(re * re + im * im), self.angle(im, re)

    def angle(self, im: torch.Tensor, re: torch.Tensor) -> torch.Tensor:
        """torch.atan2 where ONNX's does not agree: the exporter's atan2 (Atan of the quotient
        and Where on the signs) gives -pi for im = 0, re < 0 (torch: pi; the DC and Nyquist bins
        of every frame whose sum is negative) and NaN for 0 / 0 (torch: 0)."""
        phase = torch.atan2(im, re)
        if self.raw_atan2:
            return phase
        real = im == 0
        return torch.where(real & (re < 0), torch.full_like(phase, math.pi),
                           torch.where(real & (re == 0), torch.zeros_like(phase), phase))

    def inverse(self, magnitude: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """magnitude, phase [B, N/2+1, frames] -> [B, hop * (frames - 1)] (torch.istft's length)."""
        spec = torch.cat([magnitude * torch.cos(phase), magnitude * torch.sin(phase)], dim=1)
        y = F.conv_transpose1d(spec, self.inv, stride=self.hop)
        ones = torch.ones_like(magnitude[:, :1])
        envelope = F.conv_transpose1d(ones, self.window_sq, stride=self.hop)
        pad = self.n_fft // 2
        return (y / envelope)[:, 0, pad: y.shape[-1] - pad]


def _stft(gen: nn.Module, raw_atan2: bool = False) -> ExactSTFT:
    return ExactSTFT(gen.post_n_fft, gen.stft.hop_length, raw_atan2)


def harmonic_source(gen: nn.Module, stft: ExactSTFT, F0_pred, rand_ini, sine_noise) -> torch.Tensor:
    """Generator.forward's no-grad head: F0 upsampled to samples, the NSF harmonic source (its
    noise read from the inputs: the noise_as_input patch), and its STFT `har` [B, N+2, frames]."""
    f0 = gen.f0_upsamp(F0_pred[:, None]).transpose(1, 2)
    with provide_noise(dict(rand_ini=rand_ini, sine_noise=sine_noise)):
        sine, _uv, _noise = gen.m_source.l_sin_gen(f0)
    source = gen.m_source.l_tanh(gen.m_source.l_linear(sine)).transpose(1, 2).squeeze(1)
    spec, phase = stft.transform(source)
    return torch.cat([spec, phase], dim=1)


def decoder_front(dec: nn.Module, asr, F0_pred, N_pred, s_dec) -> torch.Tensor:
    """Decoder.forward up to the generator: the generator's input x."""
    F0 = dec.F0_conv(F0_pred.unsqueeze(1))
    N = dec.N_conv(N_pred.unsqueeze(1))
    x = dec.encode(torch.cat([asr, F0, N], dim=1), s_dec)
    asr_res = dec.asr_res(asr)
    res = True
    for block in dec.decode:
        if res:
            x = torch.cat([x, asr_res, F0, N], dim=1)
        x = block(x, s_dec)
        if block.upsample_type != "none":
            res = False
    return x


def generator_body(gen: nn.Module, x, s_dec, har) -> torch.Tensor:
    """Generator.forward's loop over the upsamplings, up to and including conv_post."""
    for i in range(gen.num_upsamples):
        x = F.leaky_relu(x, negative_slope=0.1)
        x_source = gen.noise_res[i](gen.noise_convs[i](har), s_dec)
        x = gen.ups[i](x)
        if i == gen.num_upsamples - 1:
            x = gen.reflection_pad(x)
        x = x + x_source
        xs = None
        for j in range(gen.num_kernels):
            y = gen.resblocks[i * gen.num_kernels + j](x, s_dec)
            xs = y if xs is None else xs + y
        x = xs / gen.num_kernels
    return gen.conv_post(F.leaky_relu(x))


def generator_tail(gen: nn.Module, stft: ExactSTFT, x) -> torch.Tensor:
    """exp, sin and the inverse STFT: conv_post's output -> audio [B, samples]."""
    half = gen.post_n_fft // 2 + 1
    return stft.inverse(torch.exp(x[:, :half]), torch.sin(x[:, half:]))


class _Stage(nn.Module):
    # the Kokoro modules the stage runs (where the `dropout` and `weight_norm` defects apply)
    kokoro_modules: tuple[str, ...] = ()

    def __init__(self, km: nn.Module, raw_atan2: bool = False):
        super().__init__()
        self.km, self.raw_atan2 = km, raw_atan2  # raw_atan2: the exporter's own atan2 (a known defect)


_POST_ALBERT = ("bert_encoder", "predictor.text_encoder", "predictor.lstm", "predictor.duration_proj")
_PROSODY = ("predictor.shared", "predictor.F0", "predictor.N", "predictor.F0_proj", "predictor.N_proj", "text_encoder")
_NOISE = ("decoder.generator.f0_upsamp", "decoder.generator.m_source")
_VOCODER = ("decoder.F0_conv", "decoder.N_conv", "decoder.encode", "decoder.asr_res", "decoder.decode",
            "decoder.generator.noise_convs", "decoder.generator.noise_res", "decoder.generator.ups",
            "decoder.generator.resblocks", "decoder.generator.conv_post")


class Albert(_Stage):
    kokoro_modules = ("bert",)

    def forward(self, input_ids, attention_mask):
        return BertStep(self.km)(input_ids, attention_mask)


class PostAlbert(_Stage):
    """bert_encoder, the duration encoder, the duration LSTM and projection: durations and d."""
    kokoro_modules = _POST_ALBERT

    def forward(self, bert_dur, s_pred, input_lengths, text_mask, speed):
        stage = DurationStageStep(self.km)
        d = stage.duration_encoder(stage.bert_encoder(bert_dur), s_pred, input_lengths, text_mask)
        return stage.duration(d, input_lengths, speed), d


class Duration(_Stage):
    kokoro_modules = ("bert", *_POST_ALBERT)

    def forward(self, input_ids, attention_mask, s_pred, input_lengths, text_mask, speed):
        return DurationStageStep(self.km)(input_ids, attention_mask, s_pred, input_lengths, text_mask, speed)


class Prosody(_Stage):
    """F0 and energy from the aligned `d`, and the text encoder aligned to frames (`asr`); the
    alignment comes from the host."""
    kokoro_modules = _PROSODY

    def forward(self, d, aln, s_pred, input_ids, input_lengths, text_mask):
        F0, N = F0NStep(self.km)._forward(d.transpose(-1, -2) @ aln, s_pred, None)
        asr = TextEncoderStep(self.km)(input_ids, input_lengths, text_mask) @ aln
        return F0, N, asr


class Noise(_Stage):
    kokoro_modules = _NOISE

    def forward(self, F0_pred, rand_ini, sine_noise):
        gen = self.km.decoder.generator
        return harmonic_source(gen, _stft(gen, self.raw_atan2), F0_pred, rand_ini, sine_noise)


class Vocoder(_Stage):
    kokoro_modules = _VOCODER

    def forward(self, asr, F0_pred, N_pred, s_dec, har):
        dec = self.km.decoder
        return generator_body(dec.generator, decoder_front(dec, asr, F0_pred, N_pred, s_dec), s_dec, har)


class Tail(_Stage):
    def forward(self, x):
        gen = self.km.decoder.generator
        return generator_tail(gen, _stft(gen), x)


class Decoder(_Stage):
    kokoro_modules = (*_NOISE, *_VOCODER)

    def forward(self, asr, F0_pred, N_pred, s_dec, rand_ini, sine_noise):
        dec = self.km.decoder
        gen, stft = dec.generator, _stft(dec.generator, self.raw_atan2)
        har = harmonic_source(gen, stft, F0_pred, rand_ini, sine_noise)
        return generator_tail(gen, stft, generator_body(gen, decoder_front(dec, asr, F0_pred, N_pred, s_dec),
                                                          s_dec, har))


class Defect(nn.Module):
    """A stage with a known defect: every float output times `gain` (1.1: +0.83 dB; -1: a sign flip)."""

    def __init__(self, stage: nn.Module, gain: float):
        super().__init__()
        self.stage, self.gain = stage, gain

    def forward(self, *args):
        out = self.stage(*args)
        scale = lambda t: t * self.gain if t.is_floating_point() else t  # noqa: E731
        return tuple(scale(t) for t in out) if isinstance(out, tuple) else scale(out)


class HalfInputs(nn.Module):
    """A stage whose float inputs are rounded to float16 inside it (a Cast to float16 and back in
    the graph) while the chain declares them float32: a port converting too early."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args):
        return self.stage(*(a.half().float() if a.is_floating_point() else a for a in args))


class ActiveDropout(nn.Module):
    """nn.Dropout as a trace in train mode records it: a random mask (RandomUniformLike in ONNX,
    seeded after export), the kept values scaled by 1 / (1 - p). ONNX's own Dropout op would not
    do: onnxruntime's graph optimizer removes it even with training_mode set."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        return x * (torch.rand_like(x) >= self.p).to(x.dtype) / (1 - self.p)


@functools.lru_cache(maxsize=1)
def _empty_kmodel() -> nn.Module:
    return build_empty_kmodel()


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + ".") for r in roots)


def active_dropouts(km: nn.Module, roots: tuple[str, ...]) -> list[str]:
    """The stage's dropout modules that drop anything (p > 0); kokoro's functional dropouts are
    called with training=False and never drop."""
    return [n for n, m in km.named_modules() if _under(n, roots) and isinstance(m, nn.Dropout) and m.p > 0]


def weight_normed(km: nn.Module, roots: tuple[str, ...]) -> list[str]:
    """The stage's weight_norm-ed modules (the old API's weight_v, or parametrizations' original1)."""
    return [n for n, m in km.named_modules() if _under(n, roots) and _raw_direction(m) is not None]


def _raw_direction(m: nn.Module) -> torch.Tensor | None:
    if hasattr(m, "weight_v"):
        return m.weight_v
    param = getattr(getattr(m, "parametrizations", None), "weight", None)
    return getattr(param, "original1", None)


def unnormalize_weight_norm(km: nn.Module, original: nn.Module, roots: tuple[str, ...]) -> list[str]:
    """The `weight_norm` defect: each of the stage's folded weight_norm convolutions in `km` takes
    the raw direction v of `original` as its weight instead of g * v / ||v||."""
    done = []
    for name in weight_normed(original, roots):
        km.get_submodule(name).weight.data.copy_(_raw_direction(original.get_submodule(name)))
        done.append(name)
    return done


@dataclass(frozen=True)
class StageDef:
    """One stage of a split: its module, its ONNX inputs and outputs as Kokoro tensors (the ONNX
    names are the vocabulary's, or short names for module references), its noise."""

    name: str
    module: type
    inputs: tuple[str, ...]
    outputs: dict[str, str]  # ONNX output name -> Kokoro tensor
    noise: str = "none"  # the port file's `noise:` (inputs: the vocoder's noise is an input)


SPLITS: dict[str, tuple[StageDef, ...]] = {
    "kokoro-3stage": (
        StageDef("duration", Duration, ("input_ids", "attention_mask", "s_pred", "input_lengths", "text_mask", "speed"),
                 {"duration": "duration", "d": "d"}),
        StageDef("prosody", Prosody, ("d", "aln", "s_pred", "input_ids", "input_lengths", "text_mask"),
                 {"F0_pred": "F0_pred", "N_pred": "N_pred", "asr": "asr"}),
        StageDef("decoder", Decoder, ("asr", "F0_pred", "N_pred", "s_dec", "rand_ini", "sine_noise"),
                 {"audio": "audio"}, noise="inputs"),
    ),
    "kokoro-7stage": (
        StageDef("albert", Albert, ("input_ids", "attention_mask"), {"bert_dur": "bert_dur"}),
        StageDef("post_albert", PostAlbert, ("bert_dur", "s_pred", "input_lengths", "text_mask", "speed"),
                 {"duration": "duration", "d": "d"}),
        # Alignment: host glue (the harness's own: duration -> pred_dur -> aln), between the stages
        StageDef("prosody", Prosody, ("d", "aln", "s_pred", "input_ids", "input_lengths", "text_mask"),
                 {"F0_pred": "F0_pred", "N_pred": "N_pred", "asr": "asr"}),
        StageDef("noise", Noise, ("F0_pred", "rand_ini", "sine_noise"), {"har": HAR}, noise="inputs"),
        StageDef("vocoder", Vocoder, ("asr", "F0_pred", "N_pred", "s_dec", "har"), {"x": CONV_POST}),
        StageDef("tail", Tail, ("x",), {"audio": "audio"}),
    ),
}
# what an ONNX input named like this is, when it is not a vocabulary name
INPUT_TENSORS = {"har": HAR, "x": CONV_POST}
# axes that vary with the case (ONNX dynamic axes): tensor -> {axis: name}
DYNAMIC = {"input_ids": {1: "tokens"}, "attention_mask": {1: "tokens"}, "text_mask": {1: "tokens"},
           "bert_dur": {1: "tokens"}, "d": {1: "tokens"}, "duration": {1: "tokens"},
           "aln": {1: "tokens", 2: "frames"}, "asr": {2: "frames"}, "F0_pred": {1: "frames2"},
           "N_pred": {1: "frames2"}, "sine_noise": {1: "samples"}, "har": {2: "stft_frames"},
           "x": {2: "stft_frames"}, "audio": {1: "samples"}}


DEFECT_KINDS = "STAGE=gain:FACTOR, STAGE=sign, STAGE=atan2, STAGE=dropout, STAGE=weight_norm or STAGE=fp16_inputs"
DROPOUT_SEED = 0.0  # the masks' RandomUniformLike `seed`: the same mask in every run of the stage


@dataclass(frozen=True)
class DefectSpec:
    stage: str
    kind: str  # gain | atan2 | dropout | weight_norm | fp16_inputs
    gain: float = 1.0

    def __str__(self) -> str:
        return {"atan2": f"{self.stage}: the exporter's atan2", "dropout": f"{self.stage}: dropout active",
                "weight_norm": f"{self.stage}: weight_norm unnormalized",
                "fp16_inputs": f"{self.stage}: float inputs rounded to float16"}.get(self.kind,
                                                                                   f"{self.stage} x{self.gain:g}")


def parse_defect(text: str | None, split: str) -> DefectSpec | None:
    """`STAGE=gain:1.1`, `sign`, `atan2`, `dropout`, `weight_norm` or `fp16_inputs` -> a DefectSpec;
    a clear error otherwise, also when the kind cannot apply to that stage (no dropout there)."""
    if not text:
        return None
    stage, _, what = text.partition("=")
    names = [s.name for s in SPLITS[split]]
    if stage not in names:
        raise UsageError(f"--defect {text!r}: no stage {stage!r} in {split}; stages: {', '.join(names)}")
    kind, _, value = what.partition(":")
    sdef = next(s for s in SPLITS[split] if s.name == stage)

    def where(has) -> str:
        return ", ".join(s.name for s in SPLITS[split] if has(s)) or "no stage"

    if kind == "sign" and not value:
        return DefectSpec(stage, "gain", -1.0)
    if kind == "atan2" and not value:
        if sdef.module not in (Noise, Decoder):
            raise UsageError(f"--defect {text!r}: stage {stage!r} computes no STFT (atan2 is in "
                             f"{where(lambda s: s.module in (Noise, Decoder))})")
        return DefectSpec(stage, "atan2")
    if kind == "dropout" and not value:
        if not active_dropouts(_empty_kmodel(), sdef.module.kokoro_modules):
            raise UsageError(f"--defect {text!r}: stage {stage!r} has no dropout that drops anything (Kokoro's "
                             f"nn.Dropout with p > 0 are in {where(lambda s: active_dropouts(_empty_kmodel(), s.module.kokoro_modules))})")
        return DefectSpec(stage, "dropout")
    if kind == "weight_norm" and not value:
        if not weight_normed(_empty_kmodel(), sdef.module.kokoro_modules):
            raise UsageError(f"--defect {text!r}: stage {stage!r} has no weight_norm-ed convolution (they are in "
                             f"{where(lambda s: weight_normed(_empty_kmodel(), s.module.kokoro_modules))})")
        return DefectSpec(stage, "weight_norm")
    if kind == "fp16_inputs" and not value:
        if not any(_is_float_input(n) for n in sdef.inputs):
            raise UsageError(f"--defect {text!r}: stage {stage!r} has no float input ({', '.join(sdef.inputs)})")
        return DefectSpec(stage, "fp16_inputs")
    if kind == "gain":
        try:
            return DefectSpec(stage, "gain", float(value))
        except ValueError:
            pass
    raise UsageError(f"--defect {text!r}: expected {DEFECT_KINDS}")


def _is_float_input(name: str) -> bool:
    t = tensors.VOCAB.get(INPUT_TENSORS.get(name, name))
    return t is None or t.dtype.startswith("float")  # module references are float activations


def defect_module(stage: StageDef, model, km: nn.Module, defect: DefectSpec | None,
                  patches: tuple[str, ...] = EXPORT_PATCHES) -> nn.Module:
    """The stage's module, with `defect` when it is this stage's. `km` is the model with `patches`
    (the export's); the dropout and weight_norm defects take their own copy of it."""
    ours = defect is not None and defect.stage == stage.name
    kind = defect.kind if ours else None
    if kind == "dropout":
        km = apply_patches(model.kmodel, tuple(p for p in patches if p != "dropout_identity"))
        for name in active_dropouts(km, stage.module.kokoro_modules):
            parent, _, child = name.rpartition(".")
            setattr(km.get_submodule(parent), child, ActiveDropout(km.get_submodule(name).p))
    elif kind == "weight_norm":
        km = apply_patches(model.kmodel, patches)
        unnormalize_weight_norm(km, model.kmodel, stage.module.kokoro_modules)
    module = stage.module(km, raw_atan2=kind == "atan2").eval()
    if kind == "gain":
        module = Defect(module, defect.gain)
    if kind == "fp16_inputs":
        module = HalfInputs(module)
    return module


def stage_inputs(traces, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
    """A stage's example inputs: the reference's tensors at its boundary (exact lengths)."""
    return tuple(tensors.reference(INPUT_TENSORS.get(n, n), traces, "float32") for n in names)


def export_split(split: str, model, traces, out_dir: Path, defect: DefectSpec | None = None,
                 log=print, only: set[str] | None = None) -> Path:
    """Export every stage of `split` to `<out_dir>/<stage>.onnx` (TorchScript exporter, opset 17,
    the case's lengths as dynamic axes) and write `<out_dir>/port.yaml`; returns the port file.
    `only`: re-export just these stages (the others' files are already there). `traces` must hold
    the module captures of HAR and CONV_POST (`reference.module_captures`)."""
    km = None
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [f"# {split}, exported from {model.name} for case {traces.case_id!r} by "
             f"examples/{split}/export.py" + (f" with the defect {defect}" if defect else ""),
             f"name: {split}", "stages:"]
    for stage in SPLITS[split]:
        if stage.name == "prosody" and split == "kokoro-7stage":
            lines.append("  # Alignment (host glue, the harness's own): duration -> pred_dur -> aln")
        path = out_dir / f"{stage.name}.onnx"
        if only is None or stage.name in only:
            km = km if km is not None else apply_patches(model.kmodel, EXPORT_PATCHES)
            module = defect_module(stage, model, km, defect)
            export_stage(module, stage, stage_inputs(traces, stage.inputs), path)
        declared = _declared_inputs(path)
        if only is None or stage.name in only:
            log(f"{path}: {', '.join(n for n in stage.inputs if n in declared)} -> {', '.join(stage.outputs)}")
        lines += [f"  - name: {stage.name}", f"    artifact: {path.name}", f"    noise: {stage.noise}",
                  "    inputs:", *(f"      {n}: {INPUT_TENSORS.get(n, n)}" for n in stage.inputs if n in declared),
                  "    outputs:", *(f"      {n}: {t}" for n, t in stage.outputs.items())]
    port = out_dir / "port.yaml"
    atomic_write_text(port, "\n".join(lines) + "\n")
    return port


def export_stage(module: nn.Module, stage: StageDef, args: tuple, path: Path) -> Path:
    """One stage to ONNX, written atomically: the vocabulary's names, the varying axes dynamic. A
    module with active dropouts (the `dropout` defect) gets its masks' random ops seeded
    (DROPOUT_SEED) so that every run of the stage drops the same values."""
    tmp = path.parent / f".{path.name}.tmp"
    dropping = any(isinstance(m, ActiveDropout) for m in module.modules())
    try:
        with torch.no_grad():
            torch.onnx.export(module, args, str(tmp), dynamo=False, opset_version=OPSET,
                              input_names=list(stage.inputs), output_names=list(stage.outputs),
                              dynamic_axes={n: DYNAMIC[n] for n in (*stage.inputs, *stage.outputs) if n in DYNAMIC})
        if dropping:
            _seed_dropouts(tmp)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _seed_dropouts(path: Path) -> None:
    model = onnx.load(str(path))
    masks = [n for n in model.graph.node if n.op_type == "RandomUniformLike"]
    if not masks:
        raise ValueError(f"{path.name}: exported with dropout active, but the graph draws no random mask")
    for node in masks:
        node.attribute.append(onnx.helper.make_attribute("seed", DROPOUT_SEED))
    onnx.save(model, str(path))


def _declared_inputs(path: Path) -> set[str]:
    """The exporter drops inputs the graph does not read: the port maps only the declared ones."""
    return {p.name for p in describe(path)[0]}
