"""Patches for frontend gaps of particular backends (TVM Relax, ONNX, Core ML).

Each rewrites a spot of Kokoro that a converter mistranslates into an equivalent the converter
takes, so that the failure is recorded as the backend's known gap with its fix, not as the
user's. Registered into `harness.patches.PATCHES` (imported at the end of harness/patches.py), so
they come after the foundation's patches in the canonical order and see their rewrites.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn

from .patches import _noise, patch


# ---- CustomSTFT phase correction: boolean-mask index_put -> torch.where ----------------------
# kokoro.custom_stft.CustomSTFT.transform writes `phase[mask] = pi`, an aten.index_put with a
# boolean index. TVM Relax 0.27 rejects it: "IndexPut requires each index tensor to have integer
# dtype. However, index tensor 0 has dtype=T.bool". Its `&` of two masks is `aten.__and__`, which
# coremltools 9 has no MIL lowering for ("Unsupported fx node and_1, kind __and__").

def _custom_stft_transform(self, waveform: torch.Tensor):
    """CustomSTFT.transform with the phase correction as a select instead of a masked store."""
    import torch.nn.functional as F

    if self.center:
        pad_len = self.n_fft // 2
        waveform = F.pad(waveform, (pad_len, pad_len), mode=self.pad_mode)
    x = waveform.unsqueeze(1)
    real_out = F.conv1d(x, self.weight_forward_real, bias=None, stride=self.hop_length, padding=0)
    imag_out = F.conv1d(x, self.weight_forward_imag, bias=None, stride=self.hop_length, padding=0)
    magnitude = torch.sqrt(real_out**2 + imag_out**2 + 1e-14)
    phase = torch.atan2(imag_out, real_out)
    correction_mask = torch.logical_and(imag_out == 0, real_out < 0)
    phase = torch.where(correction_mask, torch.full_like(phase, torch.pi), phase)
    return magnitude, phase


@patch("stft_phase_where", True, "CustomSTFT's `phase[mask] = pi` is a boolean index_put that TVM "
       "Relax rejects (index tensor dtype bool), and its `&` an op coremltools cannot lower; "
       "torch.where and logical_and compute the same")
def _stft_phase_where(model: nn.Module) -> None:
    from kokoro.custom_stft import CustomSTFT

    stft = model.decoder.generator.stft
    if isinstance(stft, CustomSTFT):
        stft.transform = types.MethodType(_custom_stft_transform, stft)


# ---- SineGen linear interpolation without one-sided integer clamps ---------------------------
# torch decomposes F.interpolate(mode="linear") into index arithmetic with
# `(x + 1).clamp(max=n - 1)` on int64. TVM Relax 0.27 converts the missing bound to -inf and its
# legalization of clip on int64 fails: "Cannot convert infinity to BigInt".

def interp_linear(x: torch.Tensor, scale_factor: float) -> torch.Tensor:
    """F.interpolate(x, scale_factor=..., mode="linear") on the last axis (align_corners=False),
    with torch's own decomposition arithmetic but two-sided clamps and index_select gathers."""
    n_in = x.shape[-1]
    n_out = int(n_in * scale_factor)
    i = torch.arange(n_out, device=x.device).to(x.dtype)
    src = ((1.0 / scale_factor) * (i + 0.5) - 0.5).clamp(min=0.0)
    i0 = src.to(torch.int64).clamp(0, n_in - 1)
    i1 = (i0 + 1).clamp(0, n_in - 1)
    lam = (src - i0.to(x.dtype)).clamp(0.0, 1.0)
    v0 = torch.index_select(x, -1, i0)
    v1 = torch.index_select(x, -1, i1)
    return v0 + (v1 - v0) * lam


def _sine_gen_forward(self, f0):
    """harness.patches' noise-as-input SineGen.forward with `interp_linear` for F.interpolate."""
    fn = f0 * torch.arange(1, self.harmonic_num + 2, dtype=torch.float32).reshape(1, 1, -1)
    rad_values = (fn / self.sampling_rate) % 1
    rand_ini = _noise("rand_ini").to(rad_values.dtype)
    rad_values = torch.cat([rad_values[:, :1, :] + rand_ini[:, None, :], rad_values[:, 1:, :]], dim=1)
    rad_values = interp_linear(rad_values.transpose(1, 2), 1 / self.upsample_scale).transpose(1, 2)
    phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi
    phase = interp_linear(phase.transpose(1, 2) * self.upsample_scale, self.upsample_scale).transpose(1, 2)
    sine_waves = torch.sin(phase) * self.sine_amp
    uv = (f0 > self.voiced_threshold).type(torch.float32)
    noise_amp = uv * self.noise_std + (1 - uv) * self.sine_amp / 3
    noise = noise_amp * _noise("sine_noise").to(sine_waves.dtype)
    return sine_waves * uv + noise, uv, noise


@patch("sine_interp_gather", True, "torch's linear-interpolation decomposition clamps int64 indices "
       "on one side only, which TVM Relax lowers to clip(-inf) and fails ('Cannot convert infinity "
       "to BigInt'); the same arithmetic with two-sided clamps")
def _sine_interp_gather(model: nn.Module) -> None:
    gen = model.decoder.generator.m_source.l_sin_gen
    if "forward" not in gen.__dict__:
        raise RuntimeError("sine_interp_gather rewrites the noise_as_input SineGen: apply noise_as_input too")
    gen.forward = types.MethodType(_sine_gen_forward, gen)
