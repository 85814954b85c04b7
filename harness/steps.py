"""The pipeline: `KModel.forward_with_tokens` cut into named steps, each an `nn.Module` with named
inputs and outputs, and the unit of each axis that varies (tokens, frames, ...).

Units are what make static buckets and valid regions mechanical: an input is padded to the bucket
along its unit axes, and an output is compared on the valid region along the same axes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from .patches import provide_noise, run_padded
from .patches.length_aware_norm import provide_frame_lengths
from .plumbing.errors import UnknownName

# Unit -> how many of it per token / alignment frame. `samples` = 600 per frame (24 kHz).
FRAME_UNITS = {"frames": 1, "frames2": 2, "samples": 600}


@dataclass(frozen=True)
class Tensor:
    """A named step input or output; `axes` maps an axis index to its unit."""

    name: str
    axes: dict[int, str] = field(default_factory=dict)
    pad_value: float = 0.0


@dataclass(frozen=True)
class Step:
    name: str
    build: Callable[[nn.Module], nn.Module]
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    stage: str  # "duration" (tokens) or "synthesizer" (frames): what a bucketed port compiles
    lstm: bool = False  # holds a packed (or padded) LSTM: the steps that static exports change
    module_path: str = ""  # where the step sits in KModel, for reports and bisection
    doc: str = ""

    def module(self, kmodel: nn.Module) -> nn.Module:
        return self.build(kmodel).eval()

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]


class _StepModule(nn.Module):
    def __init__(self, kmodel: nn.Module):
        super().__init__()
        self.kmodel = kmodel


class BertStep(_StepModule):
    def forward(self, input_ids, attention_mask):
        return self.kmodel.bert(input_ids, attention_mask=attention_mask)


class BertEncoderStep(_StepModule):
    def forward(self, bert_dur):
        return self.kmodel.bert_encoder(bert_dur).transpose(-1, -2)


class DurationEncoderStep(_StepModule):
    def forward(self, d_en, s_pred, input_lengths, text_mask):
        return self.kmodel.predictor.text_encoder(d_en, s_pred, input_lengths, text_mask)


class DurationStep(_StepModule):
    """predictor.lstm + duration_proj. Kokoro runs this LSTM unpacked on the exact length (at
    batch 1 the same as packed); patched models route it through their LSTM strategy."""

    def forward(self, d, input_lengths, speed):
        run = getattr(self.kmodel, "_parity_run_lstm", run_padded)  # kokoro's own call
        x = run(self.kmodel.predictor.lstm, d, input_lengths)
        duration = self.kmodel.predictor.duration_proj(x)
        return torch.sigmoid(duration).sum(axis=-1) / speed


class F0NStep(_StepModule):
    """predictor.F0Ntrain, with its `shared` LSTM routed like DurationStep's: kokoro runs it
    unpacked on the exact frames; on a frame bucket only a length-aware LSTM keeps that."""

    def forward(self, en, s_pred, frame_lengths):
        with provide_frame_lengths(frame_lengths):  # read only by the length_aware_norm patch
            return self._forward(en, s_pred, frame_lengths)

    def _forward(self, en, s_pred, frame_lengths):
        p = self.kmodel.predictor
        run = getattr(self.kmodel, "_parity_run_lstm", run_padded)  # kokoro's own call
        x = run(p.shared, en.transpose(-1, -2), frame_lengths).transpose(-1, -2)
        F0, N = x, x
        for block in p.F0:
            F0 = block(F0, s_pred)
        for block in p.N:
            N = block(N, s_pred)
        return p.F0_proj(F0).squeeze(1), p.N_proj(N).squeeze(1)


class TextEncoderStep(_StepModule):
    def forward(self, input_ids, input_lengths, text_mask):
        return self.kmodel.text_encoder(input_ids, input_lengths, text_mask)


class DecoderStep(_StepModule):
    def forward(self, asr, F0_pred, N_pred, s_dec, rand_ini, sine_noise, source_noise):
        with provide_noise(dict(rand_ini=rand_ini, sine_noise=sine_noise, source_noise=source_noise)):
            return self.kmodel.decoder(asr, F0_pred, N_pred, s_dec).squeeze(1)


class GeneratorStep(_StepModule):
    def forward(self, x, s_dec, F0_pred, rand_ini, sine_noise, source_noise):
        with provide_noise(dict(rand_ini=rand_ini, sine_noise=sine_noise, source_noise=source_noise)):
            return self.kmodel.decoder.generator(x, s_dec, F0_pred).squeeze(1)


class DurationStageStep(_StepModule):
    """The first half of a two-stage port: tokens to durations (and `d`, which the second needs)."""

    def __init__(self, kmodel):
        super().__init__(kmodel)
        self.bert, self.bert_encoder = BertStep(kmodel), BertEncoderStep(kmodel)
        self.duration_encoder, self.duration = DurationEncoderStep(kmodel), DurationStep(kmodel)

    def forward(self, input_ids, attention_mask, s_pred, input_lengths, text_mask, speed):
        d = self.duration_encoder(self.bert_encoder(self.bert(input_ids, attention_mask)), s_pred, input_lengths,
                                  text_mask)
        return self.duration(d, input_lengths, speed), d


class SynthesizerStep(_StepModule):
    """The second half, compiled per frame bucket: the alignment is built on the host."""

    def __init__(self, kmodel):
        super().__init__(kmodel)
        self.f0n, self.text_encoder, self.decoder = F0NStep(kmodel), TextEncoderStep(kmodel), DecoderStep(kmodel)

    def forward(self, d, aln, input_ids, input_lengths, text_mask, s_pred, s_dec, frame_lengths,
                rand_ini, sine_noise, source_noise):
        with provide_frame_lengths(frame_lengths):  # read only by the length_aware_norm patch
            return self._forward(d, aln, input_ids, input_lengths, text_mask, s_pred, s_dec, frame_lengths,
                                 rand_ini, sine_noise, source_noise)

    def _forward(self, d, aln, input_ids, input_lengths, text_mask, s_pred, s_dec, frame_lengths,
                 rand_ini, sine_noise, source_noise):
        F0, N = self.f0n(d.transpose(-1, -2) @ aln, s_pred, frame_lengths)
        asr = self.text_encoder(input_ids, input_lengths, text_mask) @ aln
        return self.decoder(asr, F0, N, s_dec, rand_ini, sine_noise, source_noise)


T = Tensor
_TOK = {1: "tokens"}
_NOISE = (T("rand_ini"), T("sine_noise", {1: "samples"}), T("source_noise", {1: "samples"}))

STEPS: tuple[Step, ...] = (
    Step("bert", BertStep, (T("input_ids", _TOK), T("attention_mask", _TOK)), (T("bert_dur", _TOK),),
         "duration", module_path="bert", doc="ALBERT over the tokens"),
    Step("bert_encoder", BertEncoderStep, (T("bert_dur", _TOK),), (T("d_en", {2: "tokens"}),),
         "duration", module_path="bert_encoder"),
    Step("duration_encoder", DurationEncoderStep,
         (T("d_en", {2: "tokens"}), T("s_pred"), T("input_lengths"), T("text_mask", _TOK, pad_value=1)),
         (T("d", _TOK),), "duration", lstm=True, module_path="predictor.text_encoder"),
    Step("duration", DurationStep, (T("d", _TOK), T("input_lengths"), T("speed")), (T("duration", _TOK),),
         "duration", lstm=True, module_path="predictor.lstm+duration_proj"),
    Step("f0n", F0NStep, (T("en", {2: "frames"}), T("s_pred"), T("frame_lengths")),
         (T("F0_pred", {1: "frames2"}), T("N_pred", {1: "frames2"})),
         "synthesizer", lstm=True, module_path="predictor.F0Ntrain"),
    Step("text_encoder", TextEncoderStep,
         (T("input_ids", _TOK), T("input_lengths"), T("text_mask", _TOK, pad_value=1)),
         (T("t_en", {2: "tokens"}),), "synthesizer", lstm=True, module_path="text_encoder"),
    Step("decoder", DecoderStep,
         (T("asr", {2: "frames"}), T("F0_pred", {1: "frames2"}), T("N_pred", {1: "frames2"}), T("s_dec"), *_NOISE),
         (T("audio", {1: "samples"}),), "synthesizer", module_path="decoder"),
    Step("generator", GeneratorStep,
         (T("gen_x", {2: "frames2"}), T("s_dec"), T("F0_pred", {1: "frames2"}), *_NOISE),
         (T("gen_audio", {1: "samples"}),), "synthesizer", module_path="decoder.generator"),
)
# The two programs of the `e2e` item (harness.e2e), as ports run Kokoro: not items of their own.
STAGES: tuple[Step, ...] = (
    Step("duration_stage", DurationStageStep,
         (T("input_ids", _TOK), T("attention_mask", _TOK), T("s_pred"), T("input_lengths"),
          T("text_mask", _TOK, pad_value=1), T("speed")),
         (T("duration", _TOK), T("d", _TOK)), "duration", lstm=True, module_path="bert..predictor.duration_proj"),
    Step("synthesizer", SynthesizerStep,
         (T("d", _TOK), T("aln", {1: "tokens", 2: "frames"}), T("input_ids", _TOK), T("input_lengths"),
          T("text_mask", _TOK, pad_value=1), T("s_pred"), T("s_dec"), T("frame_lengths"), *_NOISE),
         (T("audio", {1: "samples"}),), "synthesizer", lstm=True, module_path="predictor.F0Ntrain+text_encoder+decoder"),
)
STEP_NAMES = tuple(s.name for s in STEPS)
ITEM_STEPS = (*STEP_NAMES, "e2e")  # what the matrix runs
# The pipeline in order, for reports: `alignment` is host code, `e2e` the two-stage composition.
PIPELINE_STEP_NAMES = (*STEP_NAMES[:4], "alignment", *STEP_NAMES[4:], "e2e")


def get_step(name: str) -> Step:
    for s in (*STEPS, *STAGES):
        if s.name == name:
            return s
    raise UnknownName(f"unknown step {name!r}; steps: {', '.join(STEP_NAMES)}")


def round_durations(duration: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """Kokoro's host-side rule: the valid tokens' durations rounded, at least one frame each."""
    return torch.round(duration[0, :n_tokens]).clamp(min=1).long()


def build_alignment(duration: torch.Tensor, n_tokens: int, n_frames_total: int | None = None):
    """Host side, as in kokoro: round the durations of the valid tokens, clamp at 1, and build the
    one-hot alignment [1, tokens, frames]; extra frames (a bucket) are zero columns."""
    pred_dur = round_durations(duration, n_tokens)
    n_frames = int(pred_dur.sum())
    total = n_frames if n_frames_total is None else n_frames_total
    if total < n_frames:
        raise ValueError(f"{n_frames} predicted frames do not fit the bucket of {total} frames")
    indices = torch.repeat_interleave(torch.arange(n_tokens), pred_dur)
    aln = torch.zeros(1, duration.shape[1], total, dtype=duration.dtype)
    aln[0, indices, torch.arange(n_frames)] = 1
    return pred_dur, aln, n_frames
