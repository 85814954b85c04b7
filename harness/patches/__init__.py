"""Named, composable rewrites of a copy of Kokoro, each saying whether it preserves semantics.

A patch is what an export needs and the original model does not do: noise that a runtime cannot
draw, weight_norm hooks that keep convolutions out of a delegate, PackedSequence that torch.export
cannot trace. Semantics-preserving patches are tested against eager (1e-6 relative); the others
(`no_packing`, `custom_stft`) have their drift measured and reported, never hidden.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import remove_weight_norm

from ..architecture import import_kokoro
from .length_aware_lstm import LengthAwareLSTM
from .length_aware_norm import apply_length_aware_norm
from .stft_islands import apply_stft_islands
from ..plumbing.errors import UnknownName


@dataclass(frozen=True)
class Patch:
    name: str
    preserves_semantics: bool
    apply: Callable[[nn.Module], None]
    why: str
    affects: tuple[str, ...] | None = None  # the steps whose function it can change (None: any)
    sources: tuple[str, ...] = ()  # files under harness/ that decide what it computes
    same_function: bool = False  # the same function written with other ops: in float64 it changes only rounding


PATCHES: dict[str, Patch] = {}
LSTM_STEPS = ("duration_encoder", "duration", "f0n", "text_encoder", "duration_stage", "synthesizer")
VOCODER_STEPS = ("decoder", "generator", "synthesizer")  # the e2e stages contain the steps they join


def patch(name: str, preserves_semantics: bool, why: str, affects: tuple[str, ...] | None = None,
          uses: tuple[str, ...] = (), same_function: bool = False):
    """Register a patch. `uses`: the modules of harness/patches/ it imports, besides its own file.
    `same_function`: it rewrites ops, not what they compute (not so a patch that changes padding,
    packing or lengths: `preserves_semantics` is relative to Kokoro, this to the unpatched model),
    so a float64 reference need not carry it (harness.reference.variant_output)."""
    def register(fn: Callable[[nn.Module], None]) -> Callable[[nn.Module], None]:
        own = fn.__module__.split(".", 1)[1].replace(".", "/")  # harness.patches.frontends -> patches/frontends
        own = own + ("/__init__.py" if own == "patches" else ".py")
        sources = tuple(dict.fromkeys((own, *(f"patches/{u}.py" for u in uses))))
        PATCHES[name] = Patch(name, preserves_semantics, fn, why, affects, sources, same_function)
        return fn

    return register


def affecting(names, step: str) -> tuple[str, ...]:
    """The patches among `names` that can change `step` (the others leave its reference as is)."""
    return tuple(n for n in names if PATCHES[n].affects is None or step in PATCHES[n].affects)


def apply_patches(kmodel: nn.Module, names: tuple[str, ...] | list[str]) -> nn.Module:
    """A deep copy of `kmodel` with the patches applied in the canonical (registry) order."""
    unknown = [n for n in names if n not in PATCHES]
    if unknown:
        raise UnknownName(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}")
    model = copy.deepcopy(kmodel)
    for name in PATCHES:
        if name in names:
            PATCHES[name].apply(model)
    model.eval()
    model._parity_patches = tuple(n for n in PATCHES if n in names)
    return model


def canonical(names) -> tuple[str, ...]:
    return tuple(n for n in PATCHES if n in set(names))


# The sources that decide what a patched step computes: the steps, the registry (which also holds
# the LSTM strategies every LSTM step goes through), and the files of the patches applied. Cached
# programs and patched references are keyed by this digest as well as by patch names, so editing a
# patch invalidates exactly the entries made with it (a Core ML frontend patch edited leaves the
# XNNPACK programs cached).
BASE_SOURCES = ("steps.py", "patches/__init__.py")


@functools.lru_cache(maxsize=64)
def graph_code_digest(names: tuple[str, ...]) -> str:
    """Digest of BASE_SOURCES and the sources of the patches `names`."""
    here = Path(__file__).resolve().parent.parent  # harness/
    files = dict.fromkeys((*BASE_SOURCES, *(f for n in canonical(names) for f in PATCHES[n].sources)))
    h = hashlib.sha256()
    for name in files:
        path = here / name
        h.update(name.encode() + b"\0" + (path.read_bytes() if path.exists() else b"") + b"\0")
    return h.hexdigest()[:16]


# ---- noise as input -----------------------------------------------------------------------
# SineGen draws torch.rand (initial phases) and torch.randn_like (additive noise); the NSF source
# draws torch.randn_like. A runtime has no RNG of torch's, so both sides must see the same numbers:
# the numbers become inputs of the steps that synthesize audio, sampled once per case.

NOISE_INPUTS = ("rand_ini", "sine_noise", "source_noise")
HARMONICS = 9  # SineGen.dim: harmonic_num (8) + 1
_noise_stack: list[dict[str, torch.Tensor]] = []


@contextlib.contextmanager
def provide_noise(noise: dict[str, torch.Tensor]) -> Iterator[None]:
    """Make `noise` the numbers that the patched SineGen / NSF source read during one forward."""
    _noise_stack.append(noise)
    try:
        yield
    finally:
        _noise_stack.pop()


def _noise(name: str) -> torch.Tensor:
    if not _noise_stack:
        raise RuntimeError("noise_as_input: the generator ran without noise inputs (use provide_noise)")
    return _noise_stack[-1][name]


def sample_noise(seed: int, n_samples: int, batch: int = 1, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Kokoro's own draws, in Kokoro's order, from a seeded generator: with the same seed and length
    the patched model reproduces the unpatched one under torch.manual_seed(seed) exactly."""
    g = torch.Generator().manual_seed(seed)
    rand_ini = torch.rand(batch, HARMONICS, generator=g)
    rand_ini[:, 0] = 0
    # randn_like(x) is empty_like(x).normal_(): draw on tensors laid out as Kokoro's (SineGen's
    # sine_waves is a transposed [B, 9, L] view), or the numbers land on other samples than Kokoro's.
    sine_noise = torch.empty(batch, HARMONICS, n_samples).transpose(1, 2).normal_(generator=g).contiguous()
    source_noise = torch.empty(batch, n_samples, 1).normal_(generator=g)
    return {k: v.to(dtype) for k, v in
            dict(rand_ini=rand_ini, sine_noise=sine_noise, source_noise=source_noise).items()}


def _sine_gen_forward(self, f0):
    """SineGen.forward with its random numbers read from the step's noise inputs."""
    fn = f0 * torch.arange(1, self.harmonic_num + 2, dtype=torch.float32).reshape(1, 1, -1)
    rad_values = (fn / self.sampling_rate) % 1
    rand_ini = _noise("rand_ini").to(rad_values.dtype)
    rad_values = torch.cat([rad_values[:, :1, :] + rand_ini[:, None, :], rad_values[:, 1:, :]], dim=1)
    rad_values = F.interpolate(rad_values.transpose(1, 2), scale_factor=1 / self.upsample_scale,
                               mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi
    phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale,
                          mode="linear").transpose(1, 2)
    sine_waves = torch.sin(phase) * self.sine_amp
    uv = (f0 > self.voiced_threshold).type(torch.float32)
    noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
    noise = noise_amp * _noise("sine_noise").to(sine_waves.dtype)
    return sine_waves * uv + noise, uv, noise


def _nsf_source_forward(self, x):
    """SourceModuleHnNSF.forward with its random numbers read from the step's noise inputs."""
    sine_wavs, uv, _ = self.l_sin_gen(x)
    sine_merge = self.l_tanh(self.l_linear(sine_wavs))
    noise = _noise("source_noise").to(uv.dtype) * self.sine_amp / 3
    return sine_merge, noise, uv


@patch("noise_as_input", True, "runtimes have no torch RNG; reference and backend must share the noise",
       affects=VOCODER_STEPS)
def _noise_as_input(model: nn.Module) -> None:
    src = model.decoder.generator.m_source
    src.forward = types.MethodType(_nsf_source_forward, src)
    src.l_sin_gen.forward = types.MethodType(_sine_gen_forward, src.l_sin_gen)


# ---- dropout ------------------------------------------------------------------------------

@patch("dropout_identity", True, "eval-mode dropout is the identity; removing it keeps it out of the graph")
def _dropout_identity(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Dropout):
                setattr(parent, name, nn.Identity())


# ---- weight norm --------------------------------------------------------------------------

@patch("fold_weight_norm", True, "weight_norm computes weights at run time and keeps convolutions "
       "out of the XNNPACK delegate (70 of 76 in the decoder)")
def _fold_weight_norm(model: nn.Module) -> None:
    for m in model.modules():
        if hasattr(m, "weight_g") and hasattr(m, "weight_v"):
            remove_weight_norm(m)


# ---- LSTM packing -------------------------------------------------------------------------
# TextEncoder and DurationEncoder run their LSTMs on pack_padded_sequence, which torch.export
# cannot trace. The rewritten forwards below are kokoro's, with the LSTM call made a strategy.

def run_packed(lstm: nn.LSTM, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Kokoro's own semantics: padding never enters the recurrence."""
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
    out, _ = lstm(packed)
    out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
    return out


def run_padded(lstm: nn.LSTM, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """What a static export without packing computes: the LSTM reads the padding."""
    out, _ = lstm(x)
    return out


def _text_encoder_forward(self, x, input_lengths, m):
    x = self.embedding(x).transpose(1, 2)
    m = m.unsqueeze(1)
    x = x.masked_fill(m, 0.0)
    for c in self.cnn:
        x = c(x).masked_fill(m, 0.0)
    x = self._parity_run_lstm(self.lstm, x.transpose(1, 2), input_lengths).transpose(-1, -2)
    return x.masked_fill(m, 0.0)


def _duration_encoder_forward(self, x, style, text_lengths, m):
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    AdaLayerNorm = import_kokoro("modules").AdaLayerNorm

    x = x.permute(2, 0, 1)
    s = style.expand(x.shape[0], x.shape[1], -1)
    x = torch.cat([x, s], axis=-1)
    x = x.masked_fill(m.unsqueeze(-1).transpose(0, 1), 0.0)
    x = x.transpose(0, 1).transpose(-1, -2)
    for block in self.lstms:
        if isinstance(block, AdaLayerNorm):
            x = block(x.transpose(-1, -2), style).transpose(-1, -2)
            x = torch.cat([x, s.permute(1, 2, 0)], axis=1)
            x = x.masked_fill(m.unsqueeze(-1).transpose(-1, -2), 0.0)
        else:
            x = self._parity_run_lstm(block, x.transpose(-1, -2), text_lengths).transpose(-1, -2)
    return x.transpose(-1, -2)


def set_lstm_strategy(model: nn.Module, run_lstm: Callable) -> None:
    """Route the packed LSTMs of TextEncoder and DurationEncoder, and the two LSTMs kokoro runs
    unpacked on exact lengths (predictor.lstm, predictor.shared; see steps.DurationStep and
    steps.F0NStep), through `run_lstm(lstm, x, lengths)`."""
    for module, forward in ((model.text_encoder, _text_encoder_forward),
                            (model.predictor.text_encoder, _duration_encoder_forward)):
        module._parity_run_lstm = run_lstm
        module.forward = types.MethodType(forward, module)
    model._parity_run_lstm = run_lstm


def run_length_aware(lstm: nn.Module, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Packed semantics with static shapes: `lstm` is a LengthAwareLSTM swapped in by the patch."""
    return lstm(x, lengths)


@patch("no_packing", False, "torch.export cannot trace PackedSequence; a static export runs the "
       "LSTMs over the padding (its drift is the rewrite drift of the static reference)", affects=LSTM_STEPS)
def _no_packing(model: nn.Module) -> None:
    set_lstm_strategy(model, run_padded)


@patch("length_aware_lstm", True, "a static export that keeps packed semantics: each LSTM takes the "
       "sequence lengths, the reverse direction starts at each sequence's last valid step", affects=LSTM_STEPS,
       uses=("length_aware_lstm",))
def _length_aware_lstm(model: nn.Module) -> None:
    swap_lstms(model)
    set_lstm_strategy(model, run_length_aware)


def swap_lstms(model: nn.Module, impl: str | None = None) -> None:
    """Every nn.LSTM becomes a LengthAwareLSTM (the module itself is swapped: same Parameter objects,
    same state-dict keys, so export sees the weights as the model's parameters); `impl` given, every
    LengthAwareLSTM, swapped now or before, uses it."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.LSTM:
                setattr(parent, name, LengthAwareLSTM(child, **({"impl": impl} if impl else {})))
            elif impl and isinstance(child, LengthAwareLSTM):
                child.impl = impl


# ---- STFT ---------------------------------------------------------------------------------

@patch("custom_stft", False, "torch.stft/istft are complex and outside the Core ATen set; kokoro's "
       "CustomSTFT does them with convolutions (replicate padding instead of reflect)", affects=VOCODER_STEPS)
def _custom_stft(model: nn.Module) -> None:
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    CustomSTFT = import_kokoro("custom_stft").CustomSTFT

    gen = model.decoder.generator
    old = gen.stft
    gen.stft = CustomSTFT(filter_length=old.filter_length, hop_length=old.hop_length, win_length=old.win_length)


def to_float64(model: nn.Module) -> nn.Module:
    """`.double()` plus what kokoro keeps in float32 outside its parameters: TorchSTFT's window,
    and the `torch.zeros` (float32) that TextEncoder/DurationEncoder pad into, which would round
    the float64 reference back to float32. Their rewritten forwards (with packing, tested equal
    to kokoro's) allocate nothing."""
    model = model.double()
    if not hasattr(model, "_parity_run_lstm"):
        set_lstm_strategy(model, run_packed)
    for m in model.modules():
        if isinstance(getattr(m, "window", None), torch.Tensor):
            m.window = m.window.double()
    return float64_convolutions_by_taps(model)


def float64_convolutions_by_taps(model: nn.Module) -> nn.Module:
    """Each plain Conv1d of `model` (stride 1, no groups, zero padding) computes float64 by taps."""
    for m in model.modules():
        if type(m) is nn.Conv1d and m.groups == 1 and m.stride == (1,) and m.padding_mode == "zeros" \
                and not isinstance(m.padding, str):
            m._conv_forward = types.MethodType(_conv1d_by_taps, m)
    return model


TAPS_MIN_FRAMES = 2000  # below this output length torch's own conv is as fast (a (512, 400) x 3 conv: faster)


def _conv1d_by_taps(conv: nn.Conv1d, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A float64 Conv1d as one matrix product per kernel tap, summed: torch has no fast float64
    convolution on the CPU (no oneDNN kernel; `slow_conv2d`/`slow_conv_dilated2d` were 77 % of a
    float64 decoder run), and the taps go through BLAS's dgemm, about twice as fast on the
    vocoder's long convolutions. The same sum in another order: 2e-15 relative to torch's."""
    (dilation,), (padding,) = conv.dilation, conv.padding
    taps = weight.shape[-1]
    frames = x.shape[-1] + 2 * padding - dilation * (taps - 1)
    if x.dtype != torch.float64 or x.shape[0] != 1 or frames < TAPS_MIN_FRAMES:
        return F.conv1d(x, weight, bias, 1, padding, dilation, 1)
    padded = F.pad(x[0], (padding, padding))
    y = weight[:, :, 0] @ padded[:, :frames]
    for k in range(1, taps):
        y.addmm_(weight[:, :, k], padded[:, k * dilation:k * dilation + frames])
    if bias is not None:
        y += bias[:, None]
    return y[None]


from . import frontends  # noqa: E402 - registers the backends' frontend-gap patches after these


@patch("length_aware_norm", True, "a static synthesizer that keeps the exact-length semantics: AdaIN's "
       "InstanceNorm over each sequence's valid frames, zeros past the length wherever a conv reads, "
       "the vocoder's STFT edges as on the exact length", affects=("f0n", "synthesizer"), uses=("length_aware_norm",))
def _length_aware_norm(model: nn.Module) -> None:
    apply_length_aware_norm(model)


@patch("scan_lstm", True, "the LSTM cell once, as the body of torch's scan over the time steps: the graph, "
       "its lowering time and memory do not grow with T as unrolled_lstm's do; keeps whatever packing "
       "semantics the other patches chose (registered last: with unrolled_lstm also applied, scan wins)",
       affects=LSTM_STEPS, uses=("length_aware_lstm", "frontends"), same_function=True)
def _scan_lstm(model: nn.Module) -> None:
    swap_lstms(model, impl="scan")
    current = getattr(model, "_parity_run_lstm", None)
    if current is run_padded:  # no_packing stays padded (every step read)
        set_lstm_strategy(model, frontends.run_full_length)
    elif current not in (run_length_aware, frontends.run_full_length):  # packing becomes length-aware
        set_lstm_strategy(model, run_length_aware)


@patch("stft_islands", True, "the vocoder's STFT and iSTFT as submodules (stft.analysis, stft.synthesis), so that "
       "a float16 port can keep them in float32 (kokoro-parity precision)", affects=VOCODER_STEPS,
       uses=("stft_islands",), same_function=True)
def _stft_islands(model: nn.Module) -> None:
    apply_stft_islands(model)
