"""Patches for frontend gaps and kernel defects of particular backends (TVM Relax, ONNX, Core ML, ExecuTorch).

Each rewrites a spot of Kokoro that a converter mistranslates into an equivalent the converter
takes, so that the failure is recorded as the backend's known gap with its fix, not as the
user's. Registered into `harness.patches.PATCHES` (imported at the end of harness/patches/__init__.py), so
they come after the foundation's patches in the canonical order and see their rewrites.
"""
from __future__ import annotations

import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..architecture import import_kokoro
from . import LSTM_STEPS, patch, run_length_aware, run_padded, set_lstm_strategy, swap_lstms

# ---- CustomSTFT phase correction: boolean-mask index_put -> torch.where ----------------------
# kokoro.custom_stft.CustomSTFT.transform writes `phase[mask] = pi`, an aten.index_put with a
# boolean index. TVM Relax 0.27 rejects it: "IndexPut requires each index tensor to have integer
# dtype. However, index tensor 0 has dtype=T.bool". Its `&` of two masks is `aten.__and__`, which
# coremltools 9 has no MIL lowering for ("Unsupported fx node and_1, kind __and__").

def _custom_stft_transform(self, waveform: torch.Tensor):
    """CustomSTFT.transform with the phase correction as a select instead of a masked store."""
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
       "torch.where and logical_and compute the same", same_function=True)
def _stft_phase_where(model: nn.Module) -> None:
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    CustomSTFT = import_kokoro("custom_stft").CustomSTFT

    stft = model.decoder.generator.stft
    if isinstance(stft, CustomSTFT):
        stft.transform = types.MethodType(_custom_stft_transform, stft)


# ---- AdainResBlk1d's 1/sqrt(2) of an integer tensor ------------------------------------------
# kokoro.istftnet.AdainResBlk1d scales by `torch.rsqrt(torch.tensor(2))`: an int64 constant that
# torch promotes to float. coremltools 9 keeps it int32 and fails: 'Op "rsqrt" ... expects tensor
# or scalar of dtype from type domain ['fp16', 'fp32'] but got tensor[int32]'.

def _adain_resblk_forward(self, x, s):
    """istftnet.AdainResBlk1d.forward with a float constant under rsqrt (same float32 value)."""
    out = self._residual(x, s)
    return (out + self._shortcut(x)) * torch.rsqrt(torch.tensor(2.0))


@patch("rsqrt_float_const", True, "the decoder's `rsqrt(torch.tensor(2))` is an int constant that "
       "coremltools does not promote (rsqrt of int32 fails); rsqrt(tensor(2.0)) is the same value", same_function=True)
def _rsqrt_float_const(model: nn.Module) -> None:
    # slow: kokoro's import takes seconds (transformers); only when a model is built
    AdainResBlk1d = import_kokoro("istftnet").AdainResBlk1d

    for m in model.modules():
        if isinstance(m, AdainResBlk1d):
            m.forward = types.MethodType(_adain_resblk_forward, m)


# ---- aten.lstm, written out ------------------------------------------------------------------
# coremltools 9's EXIR frontend has no MIL lowering for `aten.lstm.input` ("Unsupported fx node
# lstm, kind lstm.input"), and TVM's Relax ONNX frontend has no converter for the ONNX `LSTM`
# node. The cell written out step by step (LengthAwareLSTM, impl="unrolled": matmuls, sigmoid,
# tanh, mul, add) is what every converter takes. T is static in every export of the harness.

def run_full_length(lstm: nn.Module, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """no_packing's semantics (every step read, padding included) through a LengthAwareLSTM."""
    return lstm(x, torch.full((x.shape[0],), x.shape[1], dtype=torch.int64))


@patch("unrolled_lstm", True, "coremltools has no MIL lowering for aten.lstm and TVM's ONNX frontend "
       "no LSTM converter; the same LSTM cell written out per time step (matmul, sigmoid, tanh) keeps "
       "whatever packing semantics the other patches chose", affects=LSTM_STEPS,
       uses=("length_aware_lstm",), same_function=True)
def _unrolled_lstm(model: nn.Module) -> None:
    swap_lstms(model, impl="unrolled")
    current = getattr(model, "_parity_run_lstm", None)
    if current is not run_length_aware:  # padded (no_packing) stays padded; packing becomes length-aware
        set_lstm_strategy(model, run_full_length if current is run_padded else run_length_aware)


# ---- InstanceNorm statistics in float64: ExecuTorch's one-pass variance ----------------------------
# ExecuTorch 1.5.1's portable `_native_batch_norm_legit.no_stats_out` (what nn.InstanceNorm1d lowers
# to; XNNPACK leaves it outside the delegate) sums x and x*x per channel sequentially in float and
# takes var = E[x^2] - E[x]^2 (kernels/portable/cpu/op_native_batch_norm.cpp, vec_ops.h): on a long
# channel whose mean is large against its spread the difference cancels, goes negative, and
# 1/sqrt(var + eps) is NaN. Kokoro's generator meets it on en_long (resblocks.4.adain2.2: one channel
# of 184,321 samples, mean 2.25, std 0.054) and the whole audio turns NaN. Here the mean and then
# the variance of the centered values are sums with float64 accumulators (`sum(dtype=float64)`):
# the tensors stay float32 (XNNPACK takes the elementwise ops), only the two [B, C, 1] statistics
# are float64. Casting x to float64 instead was 10x slower (the portable cast kernel).

def _instance_norm_float64_stats(self, x: torch.Tensor) -> torch.Tensor:
    """nn.InstanceNorm1d's eval forward (no running stats), its sums accumulated in float64."""
    n = x.shape[-1]
    mean = (x.sum(-1, keepdim=True, dtype=torch.float64) / n).to(x.dtype)
    centered = x - mean
    var = (centered * centered).sum(-1, keepdim=True, dtype=torch.float64) / n
    y = centered * torch.rsqrt(var + self.eps).to(x.dtype)
    if self.affine:
        y = y * self.weight.view(1, -1, 1) + self.bias.view(1, -1, 1)
    return y


@patch("instance_norm_float64_stats", True, "ExecuTorch's portable InstanceNorm takes a one-pass float32 "
       "variance that goes negative (NaN) on long channels; float64 two-pass statistics compute the same",
       affects=("f0n", "decoder", "generator", "synthesizer"), same_function=True)
def _instance_norm_f64(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.InstanceNorm1d) and not m.track_running_stats:
            m.forward = types.MethodType(_instance_norm_float64_stats, m)
