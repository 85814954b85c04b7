"""The vocoder's two STFTs as modules of their own, so that a float16 port can keep them in float32.

The Generator calls `self.stft.transform` (the STFT of the harmonic source) and `self.stft.inverse`
(the iSTFT that makes the audio) as methods of one module whose `forward` never runs, so they are
not modules in an exported graph's `nn_module_stack`, and a keep-list (harness.precision), the
`fp16` backend's float32 islands and Core ML's `op_selector` cannot name them. This patch makes them
called submodules, `decoder.generator.stft.analysis` and `decoder.generator.stft.synthesis`, each
holding the buffers it reads (so an island's DFT weights are its own float32 ones). They compute
exactly what the methods computed (same functions, same buffers): semantics are preserved bit for
bit, and every generator forward that calls `stft.transform` / `stft.inverse` (Kokoro's, the
length-aware one) goes through them.

Why it matters: CustomSTFT's imaginary DFT row of the Nyquist bin is -sin(pi n) * window, about
1e-16 in float32; in float16 it is 0, so the harmonic source's Nyquist phase `atan2(imag, real)` is
exactly pi where float32 gives +-pi by the sign of a rounding residue, and the generator reads that
phase as a feature (docs/precision.md).
"""
from __future__ import annotations

import copy
import functools
import types

import torch.nn as nn

ANALYSIS_BUFFERS = ("weight_forward_real", "weight_forward_imag")
SYNTHESIS_BUFFERS = ("weight_backward_real", "weight_backward_imag")


def _half(stft: nn.Module, method: str, drop: tuple[str, ...]) -> nn.Module:
    """A copy of `stft` (its attributes and the buffers `method` reads) whose forward is `method`,
    taken from the instance if an earlier patch rebound it (stft_phase_where), else from its class."""
    bound = stft.__dict__.get(method)
    fn = bound.__func__ if isinstance(bound, types.MethodType) else getattr(type(stft), method)
    half = copy.deepcopy(stft)
    for name in drop:
        if name in half._buffers:
            del half._buffers[name]
    half.__dict__.pop(method, None)
    half.forward = types.MethodType(fn, half)
    return half


def split_stft(stft: nn.Module) -> None:
    """Make `stft.transform` and `stft.inverse` calls of the submodules `analysis` and `synthesis`
    (CustomSTFT or kokoro's TorchSTFT); the parent keeps its plain attributes, not the moved buffers."""
    if "analysis" in stft._modules:
        return
    analysis = _half(stft, "transform", SYNTHESIS_BUFFERS)
    synthesis = _half(stft, "inverse", ANALYSIS_BUFFERS)
    for name in (*ANALYSIS_BUFFERS, *SYNTHESIS_BUFFERS):
        stft._buffers.pop(name, None)
    stft.analysis, stft.synthesis = analysis, synthesis
    for method in ("transform", "inverse"):  # an earlier patch's instance method would hide the class's
        stft.__dict__.pop(method, None)
    stft.__class__ = _routing_class(type(stft))


@functools.lru_cache(maxsize=None)
def _routing_class(base: type) -> type:
    """`base` whose transform / inverse call the submodules. Class methods, not instance attributes:
    torch.export names a submodule by the attribute path it was reached through, and an instance
    method bound to the real module reaches `analysis` outside that path (it was recorded as a
    top-level `analysis`)."""

    def transform(self, *args, **kwargs):
        return self.analysis(*args, **kwargs)

    def inverse(self, *args, **kwargs):
        return self.synthesis(*args, **kwargs)

    return type(f"Split{base.__name__}", (base,), {"transform": transform, "inverse": inverse,
                                                   "__module__": __name__})


def apply_stft_islands(model: nn.Module) -> None:
    split_stft(model.decoder.generator.stft)
