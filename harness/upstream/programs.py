"""The minimal programs of the upstream bundles: each stands for one spot of Kokoro (or of the
ALBERT it runs) where the matrix met a runtime defect, small enough to paste into a bug report.

Pasted into REPORT.md with inspect.getsource: a method imports what it needs (torch's scan) itself.
`PROGRAMS` names each (module, inputs) maker for the catalog (catalog.yaml's `program`).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan


class AlbertPositions(nn.Module):
    """ALBERT's embeddings: `self.position_ids[:, :seq_length]` with seq_length the whole table."""

    def __init__(self, positions: int = 16, dim: int = 8):
        super().__init__()
        self.register_buffer("position_ids", torch.arange(positions).expand((1, -1)), persistent=False)
        self.word = nn.Embedding(32, dim)
        self.position = nn.Embedding(positions, dim)

    def forward(self, input_ids):
        position_ids = self.position_ids[:, :input_ids.shape[1]]  # the whole table: an identity aten.alias
        return self.word(input_ids) + self.position(position_ids)


class MaskAnd(nn.Module):
    """Two boolean masks joined with `&` (aten.__and__): CustomSTFT's phase correction mask."""

    def forward(self, real, imag):
        correction_mask = (imag == 0) & (real < 0)
        return torch.where(correction_mask, torch.full_like(real, torch.pi), torch.atan2(imag, real))


class NewOnes(nn.Module):
    """`x.new_ones(shape)` (transformers' mask construction for ALBERT)."""

    def forward(self, x):
        return x * x.new_ones(x.shape)


class RsqrtIntConstant(nn.Module):
    """AdainResBlk1d's `(out + shortcut) * torch.rsqrt(torch.tensor(2))`: rsqrt of an int64 constant."""

    def forward(self, out, shortcut):
        return (out + shortcut) * torch.rsqrt(torch.tensor(2))


class BiLSTM(nn.Module):
    """Kokoro's LSTMs: one layer, bidirectional, batch first (here 8 -> 2 x 4 features)."""

    def __init__(self, features: int = 8, hidden: int = 4):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, 1, batch_first=True, bidirectional=True)

    def forward(self, x):
        return self.lstm(x)[0]


class ScanLSTMCell(nn.Module):
    """Kokoro's LSTM cell as the body of torch's `scan` over the time steps, as kokoro-parity's
    LengthAwareLSTM(impl="scan") writes it: per step x_t W_ih^T + h W_hh^T, the four gates, and the
    state frozen after the sequence's length (m = 1 at a valid step, keep = 1 - m). 8 -> 4 features,
    time major: x [T, B, 8], valid [T, B, 1]."""

    def __init__(self, features: int = 8, hidden: int = 4):
        super().__init__()
        self.ih = nn.Linear(features, 4 * hidden)
        self.hh = nn.Linear(hidden, 4 * hidden)
        self.hidden = hidden

    def forward(self, x, valid):
        H = self.hidden

        def step(carry, inputs):
            h, c = carry
            x_t, m, keep = inputs
            g = self.ih(x_t) + self.hh(h)
            i, f, gg, o = (g[:, k * H:(k + 1) * H] for k in range(4))
            c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
            h_new = torch.sigmoid(o) * torch.tanh(c_new)
            return (h_new * m + h * keep, c_new * m + c * keep), h_new * m

        zeros = x.new_zeros(x.shape[1], H)
        (h, c), ys = scan(step, (zeros.clone(), zeros.clone()), (x, valid, 1 - valid))
        return ys


def _steps_and_mask(steps: int = 6, length: int = 5):
    """x [T, 1, 8] and the valid-step mask [T, 1, 1] of one sequence of `length` steps."""
    valid = (torch.arange(steps) < length).float().reshape(steps, 1, 1)
    return torch.randn(steps, 1, 8, generator=_gen()), valid


class LinearDownsample(nn.Module):
    """SineGen's `F.interpolate(rad_values.transpose(1, 2), scale_factor=1/upsample_scale, mode="linear")`;
    torch's decomposition clamps int64 indices with one bound: `(i + 1).clamp(max=n - 1)`."""

    def forward(self, rad_values):
        return F.interpolate(rad_values, scale_factor=1 / 4, mode="linear")


class MaskedPhase(nn.Module):
    """CustomSTFT.transform's phase correction: `phase[mask] = pi`, a boolean-mask index_put."""

    def forward(self, real, imag):
        phase = torch.atan2(imag, real)
        correction_mask = (imag == 0) & (real < 0)
        phase[correction_mask] = torch.pi
        return phase


class ConvInstanceNorm(nn.Module):
    """A convolution then AdaIN1d's `nn.InstanceNorm1d(num_features, affine=True)`."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=1)
        self.norm = nn.InstanceNorm1d(channels, affine=True)

    def forward(self, x):
        return self.norm(self.conv(x))


class SinePhase(nn.Module):
    """SineGen._f02sine (flag_for_pulse False, no initial phase noise) on the 9th harmonic: the
    phase is a running sum over the whole utterance, times 2 pi, times the upsample scale."""

    sampling_rate, upsample_scale = 24000, 300

    def forward(self, f0_values):
        rad_values = (f0_values / self.sampling_rate) % 1
        rad_values = F.interpolate(rad_values.transpose(1, 2), scale_factor=1 / self.upsample_scale,
                                   mode="linear").transpose(1, 2)
        phase = torch.cumsum(rad_values, dim=1) * 2 * torch.pi
        phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, scale_factor=self.upsample_scale,
                              mode="linear").transpose(1, 2)
        return torch.sin(phase)


class BroadcastMul(nn.Module):
    """SineGen's harmonics: a [1, N, 1] phase times the [1, 1, 9] harmonic numbers."""

    def forward(self, phase, harmonics):
        return phase * harmonics


class PhaseCumsum(nn.Module):
    """SineGen's phase: the running sum of the per-frame phase increments of 9 harmonics."""

    def forward(self, rad_values):
        return torch.cumsum(rad_values, dim=1)

class InstanceNorm(nn.Module):
    """AdaIN1d's normalization: `nn.InstanceNorm1d(channels, affine=True)` at its initial affine."""

    def __init__(self, channels: int = 1):
        super().__init__()
        self.norm = nn.InstanceNorm1d(channels, affine=True)

    def forward(self, x):
        return self.norm(x)


def _long_channel():
    """One channel of 4,096 samples, mean 100, std 0.01 (its float32 one-pass variance: -0.03)."""
    return (100 + 0.01 * torch.randn(1, 1, 4096, generator=_gen()),)


def _transposed_phase():
    """The [1, N, 1] operand as SineGen's graph hands it over: a transposed view, strides (N, 1, N)."""
    phase = torch.randn(1, 1, 2000, generator=_gen()).transpose(1, 2)
    return phase, torch.arange(1, 10, dtype=torch.float32).reshape(1, 1, 9)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _phase_increments(frames: int = 290):
    """(f0 x harmonic / 24 kHz) % 1 at frame rate, f0 120-250 Hz: en_short's 290 frames x 9 harmonics."""
    f0 = 120 + 130 * torch.rand(1, frames, 1, generator=_gen())
    return (((f0 * torch.arange(1, 10).reshape(1, 1, 9)) / 24000) % 1,)

def _stft_like():
    g = _gen()
    real, imag = torch.randn(1, 5, 12, generator=g), torch.randn(1, 5, 12, generator=g)
    imag[0, :, ::3] = 0  # zero imaginary parts with a negative real part: the corrected bins
    real[0, :, ::3] = -real[0, :, ::3].abs()
    return real, imag


PROGRAMS = {
    "albert_positions": lambda: (AlbertPositions(), (torch.randint(0, 32, (1, 16), generator=_gen()),)),
    "mask_and": lambda: (MaskAnd(), _stft_like()),
    "new_ones": lambda: (NewOnes(), (torch.randn(2, 6, generator=_gen()),)),
    "rsqrt_int_constant": lambda: (RsqrtIntConstant(), (torch.randn(1, 4, 6, generator=_gen()),
                                                        torch.randn(1, 4, 6, generator=_gen(1)))),
    "bilstm": lambda: (BiLSTM(), (torch.randn(1, 6, 8, generator=_gen()),)),
    "bilstm_8_steps": lambda: (BiLSTM(), (torch.randn(1, 8, 8, generator=_gen()),)),
    "linear_downsample": lambda: (LinearDownsample(), (torch.rand(1, 9, 40, generator=_gen()),)),
    "masked_phase": lambda: (MaskedPhase(), _stft_like()),
    "instance_norm_long_channel": lambda: (InstanceNorm(), _long_channel()),
    "conv_instance_norm": lambda: (ConvInstanceNorm(), (torch.randn(1, 8, 32, generator=_gen()),)),
    "scan_lstm_cell": lambda: (ScanLSTMCell(), _steps_and_mask()),
    "broadcast_mul": lambda: (BroadcastMul(), _transposed_phase()),
    "phase_cumsum": lambda: (PhaseCumsum(), _phase_increments()),
    "sine_phase_7s": lambda: (SinePhase(), (torch.full((1, 24000 * 7, 1), 9 * 200.0),)),
}
