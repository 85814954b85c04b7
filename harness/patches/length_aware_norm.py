"""Length-aware synthesizer forwards: on a padded frame bucket, compute what Kokoro computes on the
exact frames, with static shapes only (the `length_aware_norm` patch).

Kokoro's synthesizer is not padding-invariant, for three kinds of reasons:

* InstanceNorm (in every AdaIN1d) averages over the whole frame axis, padding included. Here the
  mean and the biased variance run over each sequence's valid frames only (same eps, same affine).
* A convolution near the end of the valid region reads past it: the dynamic run reads its zero
  padding, the static one reads whatever the padded frames hold (a norm's beta, a bias). Here every
  tensor that a convolution (or transposed convolution) reads is zero past its valid length, and
  each valid length is carried through every stride and upsampling (frames, frames2 = 2x in the
  upsampling blocks, the generator's 20x and 120x + 1 STFT frames, 600x samples).
* The vocoder's signal edges: SineGen's phase interpolation replicates its last value at the end
  (a zero F0 past the length gives the same, exactly), torch.stft pads the harmonic source by
  reflection at its end (here the samples past the length are that reflection, or a replication
  for CustomSTFT's replicate padding), and torch.istft divides by the window envelope of *all*
  frames (here the last samples are rescaled to the envelope of the valid frames).

Lengths reach the modules through `provide_frame_lengths` (a context that F0NStep and
SynthesizerStep open with their `frame_lengths` input, like `provide_noise`). Without it (the
standalone decoder and generator steps, or the unpatched model) every forward is Kokoro's own.
Masks are `arange(T) < lengths` and `torch.where`, so torch.export keeps T static and the lengths a
runtime input.
"""
from __future__ import annotations

import contextlib
import types
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..architecture import import_kokoro

_lengths_stack: list[torch.Tensor] = []


@contextlib.contextmanager
def provide_frame_lengths(frame_lengths: torch.Tensor) -> Iterator[None]:
    """Make `frame_lengths` [B] (alignment frames per sequence) what the patched modules read."""
    _lengths_stack.append(frame_lengths)
    try:
        yield
    finally:
        _lengths_stack.pop()


def current_frame_lengths() -> torch.Tensor | None:
    return _lengths_stack[-1] if _lengths_stack else None


# ---- masks and lengths --------------------------------------------------------------------------

def valid_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """Bool [B, 1, T], True at t < lengths[b]."""
    t = torch.arange(T, device=lengths.device)
    return (t.unsqueeze(0) < lengths.to(torch.int64).unsqueeze(1)).unsqueeze(1)


def zero_after(x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] with the frames at t >= lengths[b] set to zero (what a dynamic conv pads with)."""
    return torch.where(valid_mask(lengths, x.shape[-1]), x, torch.zeros((), dtype=x.dtype))


def conv_length(conv: nn.Module, lengths: torch.Tensor) -> torch.Tensor:
    """The output length a (transposed) 1-D convolution gives on an input of `lengths` frames."""
    k, s, p, d = conv.kernel_size[0], conv.stride[0], conv.padding[0], conv.dilation[0]
    if isinstance(conv, nn.ConvTranspose1d):
        return (lengths - 1) * s - 2 * p + d * (k - 1) + conv.output_padding[0] + 1
    return torch.div(lengths + 2 * p - d * (k - 1) - 1, s, rounding_mode="floor") + 1


# ---- AdaIN --------------------------------------------------------------------------------------

def masked_instance_norm(norm: nn.InstanceNorm1d, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """InstanceNorm1d (biased variance, eval without running stats) over the valid frames only."""
    mask = valid_mask(lengths, x.shape[-1])
    n = lengths.to(x.dtype).clamp(min=1).view(-1, 1, 1)
    zero = torch.zeros((), dtype=x.dtype)
    mean = torch.where(mask, x, zero).sum(-1, keepdim=True) / n
    centered = torch.where(mask, x - mean, zero)
    var = (centered * centered).sum(-1, keepdim=True) / n
    y = (x - mean) * torch.rsqrt(var + norm.eps)
    if norm.affine:
        y = y * norm.weight.view(1, -1, 1) + norm.bias.view(1, -1, 1)
    return y


def adain(module: nn.Module, x: torch.Tensor, s: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """kokoro.istftnet.AdaIN1d.forward with the masked InstanceNorm."""
    h = module.fc(s)
    h = h.view(h.size(0), h.size(1), 1)
    gamma, beta = torch.chunk(h, chunks=2, dim=1)
    return (1 + gamma) * masked_instance_norm(module.norm, x, lengths) + beta


# ---- blocks -------------------------------------------------------------------------------------

def _adain_res_blk_forward(self, x, s, lengths=None):
    """AdainResBlk1d (predictor F0/N, decoder encode/decode) on `lengths` input frames; returns
    zeros past the output length (2x lengths in an upsampling block)."""
    if lengths is None:
        frames = current_frame_lengths()
        scale = getattr(self, "_parity_length_scale", None)
        if frames is None or scale is None:
            return self._parity_exact_forward(x, s)
        lengths = frames * scale
    r = self.actv(adain(self.norm1, x, s, lengths))
    r = self.pool(zero_after(r, lengths))
    out_lengths = conv_length(self.pool, lengths) if isinstance(self.pool, nn.ConvTranspose1d) else lengths
    r = self.conv1(self.dropout(zero_after(r, out_lengths)))
    r = self.actv(adain(self.norm2, r, s, out_lengths))
    r = self.conv2(self.dropout(zero_after(r, out_lengths)))
    out = (r + self._shortcut(x)) * torch.rsqrt(torch.tensor(2.0))  # = rsqrt(tensor(2)) in float32
    return zero_after(out, out_lengths)


def _adain_resblock1_forward(self, x, s, lengths=None):
    """AdaINResBlock1 (generator) on `lengths` frames; every conv reads zeros past the length."""
    if lengths is None:
        return self._parity_exact_forward(x, s)
    for c1, c2, n1, n2, a1, a2 in zip(self.convs1, self.convs2, self.adain1, self.adain2, self.alpha1, self.alpha2):
        xt = adain(n1, x, s, lengths)
        xt = xt + (1 / a1) * (torch.sin(a1 * xt) ** 2)  # Snake1D
        xt = c1(zero_after(xt, lengths))
        xt = adain(n2, xt, s, lengths)
        xt = xt + (1 / a2) * (torch.sin(a2 * xt) ** 2)  # Snake1D
        xt = c2(zero_after(xt, lengths))
        x = xt + x
    return zero_after(x, lengths)


def _masked_output_forward(self, x):
    """A pointwise projection (F0_proj, N_proj) whose padded outputs are zero, not its bias."""
    out = self._parity_exact_forward(x)
    frames = current_frame_lengths()
    if frames is None:
        return out
    return zero_after(out, frames * self._parity_length_scale)


# ---- decoder ------------------------------------------------------------------------------------

def _decoder_forward(self, asr, F0_curve, N, s):
    """kokoro.istftnet.Decoder.forward on the valid frames of each sequence."""
    frames = current_frame_lengths()
    if frames is None:
        return self._parity_exact_forward(asr, F0_curve, N, s)
    frames2 = 2 * frames
    F0_curve = zero_after(F0_curve.unsqueeze(1), frames2).squeeze(1)
    N = zero_after(N.unsqueeze(1), frames2).squeeze(1)
    asr = zero_after(asr, frames)
    F0 = zero_after(self.F0_conv(F0_curve.unsqueeze(1)), conv_length(self.F0_conv, frames2))
    N = zero_after(self.N_conv(N.unsqueeze(1)), conv_length(self.N_conv, frames2))
    x = self.encode(torch.cat([asr, F0, N], axis=1), s, frames)
    asr_res = self.asr_res(asr)
    lengths, res = frames, True
    for block in self.decode:
        if res:
            x = torch.cat([x, asr_res, F0, N], axis=1)
        x = block(x, s, lengths)
        if block.upsample_type != "none":
            res = False
            lengths = conv_length(block.pool, lengths)
    return self.generator(x, s, F0_curve, lengths)


# ---- generator ----------------------------------------------------------------------------------

def _stft_center_pad_index(n_total: int, lengths: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, n_total] index that keeps t < L and, past L, points where the STFT's center padding of
    the exact-length signal reads: reflect (torch.stft) or replicate (CustomSTFT)."""
    t = torch.arange(n_total, device=lengths.device).unsqueeze(0)
    L = lengths.to(torch.int64).unsqueeze(1)
    past = (2 * (L - 1) - t).clamp(min=0) if mode == "reflect" else L - 1
    return torch.where(t < L, t, past)  # [B, n_total]


def sine_phase_edge_like_exact(f0: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """f0 [B, frames2] with zeros past the length. SineGen's phase is a cumsum downsampled to
    frames2 and linearly upsampled again; at the exact end that upsampling replicates the last
    phase. A zero F0 adds exactly zero phase, so the static upsampling does the same."""
    return zero_after(f0.unsqueeze(1), lengths).squeeze(1)


def stft_edge_like_exact(stft: nn.Module, signal: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """signal [B, S] whose samples past `lengths` are what the exact run's center padding holds."""
    mode = getattr(stft, "pad_mode", "reflect")
    if mode == "constant":
        return zero_after(signal.unsqueeze(1), lengths).squeeze(1)
    return torch.gather(signal, 1, _stft_center_pad_index(signal.shape[-1], lengths, mode))


def istft_envelope_like_exact(stft: nn.Module, audio: torch.Tensor, frame_lengths: torch.Tensor) -> torch.Tensor:
    """torch.istft divides by the window envelope of all frames; the exact run's last samples
    (those the first padded frame overlaps) have only the valid frames'. Rescale them; the other
    samples are left bit for bit. CustomSTFT's inverse has no envelope: nothing to do."""
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    TorchSTFT = import_kokoro("istftnet").TorchSTFT

    if not isinstance(stft, TorchSTFT):
        return audio
    hop, n_fft, n_frames = stft.hop_length, stft.filter_length, audio.shape[-1] // stft.hop_length + 1
    w2 = (stft.window.to(audio.dtype) ** 2).view(1, 1, -1)

    def envelope(frames_on):
        env = F.conv_transpose1d(frames_on.to(audio.dtype), w2, stride=hop)
        return env[..., n_fft // 2: n_fft // 2 + audio.shape[-1]]

    full = envelope(torch.ones(1, 1, n_frames, dtype=audio.dtype))
    valid = envelope(valid_mask(frame_lengths, n_frames))
    safe = torch.where(valid > 1e-11, valid, torch.ones((), dtype=audio.dtype))
    return torch.where(valid == full, audio, audio * full / safe)


def _istft_valid_frames(stft: nn.Module, spec: torch.Tensor, phase: torch.Tensor,
                        frame_lengths: torch.Tensor, sample_lengths: torch.Tensor) -> torch.Tensor:
    """stft.inverse on the valid STFT frames only: zero magnitude past the length contributes
    nothing to the overlap-add, and the envelope is that of the valid frames."""
    audio = stft.inverse(zero_after(spec, frame_lengths), phase)  # [B, 1, S]
    return zero_after(istft_envelope_like_exact(stft, audio, frame_lengths), sample_lengths)


def _generator_forward(self, x, s, f0, lengths=None):
    """kokoro.istftnet.Generator.forward on `lengths` frames2 (x's and f0's valid length)."""
    if lengths is None:
        return self._parity_exact_forward(x, s, f0)
    with torch.no_grad():
        f0 = sine_phase_edge_like_exact(f0, lengths)
        samples = lengths * int(self.f0_upsamp.scale_factor)
        f0 = self.f0_upsamp(f0.unsqueeze(1)).transpose(1, 2)
        har_source, noi_source, uv = self.m_source(f0)
        har_source = stft_edge_like_exact(self.stft, har_source.transpose(1, 2).squeeze(1), samples)
        har_spec, har_phase = self.stft.transform(har_source)
        stft_frames = torch.div(samples, self.stft.hop_length, rounding_mode="floor") + 1  # center=True
        har = zero_after(torch.cat([har_spec, har_phase], dim=1), stft_frames)
    for i in range(self.num_upsamples):
        x = zero_after(F.leaky_relu(x, negative_slope=0.1), lengths)
        source_lengths = conv_length(self.noise_convs[i], stft_frames)
        x_source = self.noise_res[i](zero_after(self.noise_convs[i](har), source_lengths), s, source_lengths)
        x = self.ups[i](x)
        lengths = conv_length(self.ups[i], lengths)
        if i == self.num_upsamples - 1:
            x = self.reflection_pad(x)
            lengths = lengths + self.reflection_pad.padding[0] + self.reflection_pad.padding[1]
        x = zero_after(x, lengths) + x_source
        xs = None
        for j in range(self.num_kernels):
            y = self.resblocks[i * self.num_kernels + j](x, s, lengths)
            xs = y if xs is None else xs + y
        x = xs / self.num_kernels
    x = self.conv_post(zero_after(F.leaky_relu(x), lengths))
    spec = torch.exp(x[:, :self.post_n_fft // 2 + 1, :])
    phase = torch.sin(x[:, self.post_n_fft // 2 + 1:, :])
    return _istft_valid_frames(self.stft, spec, phase, lengths, samples)


# ---- the patch ----------------------------------------------------------------------------------

def _bind(module: nn.Module, forward) -> None:
    """Bind `forward`, keeping the forward it replaces (Kokoro's, or an earlier patch's) for the
    calls without lengths."""
    module._parity_exact_forward = module.forward
    module.forward = types.MethodType(forward, module)


def apply_length_aware_norm(model: nn.Module) -> None:
    """Bind the length-aware forwards on `model` (a KModel copy); parameters are untouched."""
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    istftnet = import_kokoro("istftnet")
    AdainResBlk1d, AdaINResBlock1 = istftnet.AdainResBlk1d, istftnet.AdaINResBlock1

    for m in model.modules():
        if isinstance(m, AdainResBlk1d):
            _bind(m, _adain_res_blk_forward)
            for norm in (m.norm1.norm, m.norm2.norm):
                if norm.track_running_stats:
                    raise ValueError("length_aware_norm: InstanceNorm1d with running stats is not supported")
        elif isinstance(m, AdaINResBlock1):
            _bind(m, _adain_resblock1_forward)
    # F0NStep calls the predictor's blocks itself: each reads the step's frame lengths at its scale.
    p = model.predictor
    for blocks in (p.F0, p.N):
        scale = 1
        for block in blocks:
            block._parity_length_scale = scale
            if block.upsample_type != "none":
                scale *= 2
    for proj in (p.F0_proj, p.N_proj):
        proj._parity_length_scale = scale
        _bind(proj, _masked_output_forward)
    _bind(model.decoder, _decoder_forward)
    _bind(model.decoder.generator, _generator_forward)
