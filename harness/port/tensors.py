"""The Kokoro tensor vocabulary: the names a port file maps its artifacts' inputs and outputs to.

Each name says how the reference gets it (a key of the reference chain, `reference.run_chain`, or a
value derived from it, or a forward hook on a module path `decoder.generator.m_source:out`), its
axes and their units, its dtype and the names ports commonly give it (used to guess mappings).
"""
from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass, field

import torch

from ..steps import STEPS
from ..model import build_empty_kmodel
from ..plumbing.errors import UnknownName


@dataclass(frozen=True)
class KTensor:
    name: str
    shape: str  # documentation: axes with their units
    dtype: str
    doc: str
    aliases: tuple[str, ...] = ()
    axes: dict[int, str] = field(default_factory=dict)  # axis -> unit (tokens, frames, frames2, samples)
    stochastic: bool = False  # depends on the vocoder's random noise


T = KTensor
VOCAB: dict[str, KTensor] = {t.name: t for t in (
    T("input_ids", "[1, tokens]", "int64", "token ids with Kokoro's pad id 0 at both ends",
      ("tokens", "ids", "token_ids", "phonemes", "input", "x"), {1: "tokens"}),
    T("input_lengths", "[1]", "int64", "the number of tokens (pads included)", ("lengths", "text_lengths")),
    T("text_mask", "[1, tokens]", "bool", "True on padding", ("mask",), {1: "tokens"}),
    T("attention_mask", "[1, tokens]", "int32", "1 on valid tokens", (), {1: "tokens"}),
    T("ref_s", "[1, 256]", "float32", "the voice pack's style row for the token count: [s_dec | s_pred]",
      ("style", "voice", "ref_s", "s", "speaker")),
    T("s_pred", "[1, 128]", "float32", "the prosody half of the style (ref_s[:, 128:])"),
    T("s_dec", "[1, 128]", "float32", "the decoder half of the style (ref_s[:, :128])"),
    T("speed", "[1]", "float32", "speaking rate (durations are divided by it)", ("rate",)),
    T("bert_dur", "[1, tokens, 768]", "float32", "ALBERT's last hidden state", (), {1: "tokens"}),
    T("d_en", "[1, 512, tokens]", "float32", "bert_encoder output, channels first", (), {2: "tokens"}),
    T("d", "[1, tokens, 640]", "float32", "the duration encoder's output (predictor.text_encoder)", (), {1: "tokens"}),
    T("duration", "[1, tokens]", "float32", "the durations before rounding (sigmoid sum / speed)",
      ("durations_float",), {1: "tokens"}),
    T("pred_dur", "[tokens]", "int64", "frames per token: round(duration) clamped at 1 (host glue)",
      ("durations", "duration", "dur", "pred_dur"), {0: "tokens"}),
    T("aln", "[1, tokens, frames]", "float32", "one-hot alignment built on the host from pred_dur",
      ("alignment", "pred_aln_trg"), {1: "tokens", 2: "frames"}),
    T("en", "[1, 640, frames]", "float32", "d aligned to frames (d^T @ aln)", (), {2: "frames"}),
    T("F0_pred", "[1, frames2]", "float32", "pitch curve (2 per frame)", ("f0", "F0"), {1: "frames2"}),
    T("N_pred", "[1, frames2]", "float32", "energy curve (2 per frame)", ("n", "N"), {1: "frames2"}),
    T("t_en", "[1, 512, tokens]", "float32", "the text encoder's output", (), {2: "tokens"}),
    T("asr", "[1, 512, frames]", "float32", "t_en aligned to frames", (), {2: "frames"}),
    T("frame_lengths", "[1]", "int64", "the number of valid frames (a static bucket's valid length)"),
    T("rand_ini", "[1, 9]", "float32", "SineGen's initial phases (harmonic 0 is 0)", (), {}, True),
    T("sine_noise", "[1, samples, 9]", "float32", "SineGen's additive noise", (), {1: "samples"}, True),
    T("source_noise", "[1, samples, 1]", "float32", "the NSF source's noise", (), {1: "samples"}, True),
    T("gen_x", "[1, 512, frames2]", "float32", "the generator's input (decoder before the vocoder)", (),
      {2: "frames2"}),
    T("audio", "[1, samples]", "float32", "the waveform at 24 kHz", ("waveform", "wav", "audio", "output", "y"),
      {1: "samples"}, True),
)}
NOISE = ("rand_ini", "sine_noise", "source_noise")
MODULE_REF = re.compile(r"^(?P<path>[A-Za-z_][\w.]*):(?P<which>out|in)$")


def _producers() -> dict[str, tuple[str, str]]:
    """tensor -> (step, output name): where its fp64 twin is (teacher-forced, `reference.compute_traces`)."""
    out = {}
    for step in STEPS:
        for t in step.outputs:
            out.setdefault(t.name, (step.name, t.name))
    return out


PRODUCERS = _producers()


def known(name: str) -> bool:
    """A vocabulary name or a module reference `path:out` / `path:in`."""
    return name in VOCAB or MODULE_REF.match(name) is not None


def module_refs(names) -> tuple[str, ...]:
    """The module references among `names`."""
    return tuple(sorted({n for n in names if MODULE_REF.match(n)}))


@functools.lru_cache(maxsize=1)
def module_paths() -> tuple[str, ...]:
    """Every module path of Kokoro's KModel (the architecture, default-initialised: no weights)."""
    return tuple(p for p, _ in build_empty_kmodel().named_modules() if p)


def unknown_module(name: str) -> str | None:
    """Why a module reference names no module of Kokoro (with the nearest valid paths), or None."""
    path = MODULE_REF.match(name)["path"]
    paths = module_paths()
    if path in paths:
        return None
    near = difflib.get_close_matches(path, paths, n=4, cutoff=0.6)
    parent = path.rsplit(".", 1)[0] if "." in path else ""
    children = [p for p in paths if p.startswith(parent + ".") and "." not in p[len(parent) + 1:]] if parent else []
    near = list(dict.fromkeys([*near, *children[:4]]))[:6]
    return (f"Kokoro has no module {path!r}" + (f"; nearest: {', '.join(near)}" if near else
                                                "; top-level modules: bert, bert_encoder, predictor, text_encoder, decoder"))


def describe(name: str) -> str:
    if name in VOCAB:
        t = VOCAB[name]
        return f"{t.name} {t.shape} {t.dtype}"
    return f"{name} (a forward hook on a module)"


def reference(name: str, traces, dtype: str = "float32") -> torch.Tensor:
    """The reference value of a vocabulary tensor for one case (exact lengths, the case's noise).
    float64: the teacher-forced float64 output of the step producing it (`en`, `asr`: the host glue
    over those), a module reference's float64 capture, else the fp32 value cast."""
    chain = traces.chain
    if MODULE_REF.match(name):
        if (name, dtype) not in traces.captures:
            raise UnknownName(f"no reference for module reference {name!r}: not captured "
                           f"(harness.reference.module_captures)")
        return traces.captures[(name, dtype)]
    if dtype == "float64" and name in ("en", "asr"):  # host glue over float64 outputs: a real floor
        aln = chain["aln"].double()
        if name == "en":
            return reference("d", traces, "float64").transpose(-1, -2) @ aln
        return reference("t_en", traces, "float64") @ aln
    if name == "ref_s":
        value = torch.cat([chain["s_dec"], chain["s_pred"]], dim=1)
    elif name == "pred_dur":
        value = torch.tensor(traces.pred_dur, dtype=torch.long)
    elif name in chain:
        value = chain[name]
    else:
        raise UnknownName(f"no reference for tensor {name!r}")
    if dtype == "float64" and name in PRODUCERS:
        step, out = PRODUCERS[name]
        key = (step, "dynamic", "float64")
        if key in traces.io:
            return traces.io[key][1][out]
    return value.double() if dtype == "float64" and value.is_floating_point() else value


def guess(port_name: str | None, rank: int | None, dtype: str | None, candidates=None) -> str | None:
    """The vocabulary tensor a declared input or output most likely is, by name (exact, alias,
    loose), else None. `candidates` limits the choice (e.g. a stage's inputs)."""
    pool = [VOCAB[n] for n in (candidates or VOCAB)]
    if port_name:
        loose = re.sub(r"[^a-z0-9]", "", port_name.lower())
        for t in pool:
            if port_name == t.name:
                return t.name
        for t in pool:
            if loose in {re.sub(r"[^a-z0-9]", "", a.lower()) for a in (t.name, *t.aliases)}:
                if t.name == "pred_dur" and dtype and dtype.startswith("float"):
                    return "duration"
                return t.name
    return None


def to_artifact(value: torch.Tensor, port, dtype: str | None) -> torch.Tensor:
    """A Kokoro tensor in the artifact's convention: its declared rank and dtype."""
    if port is not None and port.rank is not None:
        while value.dim() > port.rank and value.shape[0] == 1:
            value = value[0]
        while value.dim() < port.rank:
            value = value.unsqueeze(0)
    want = dtype or (port.dtype if port is not None else None)
    if want:
        if want == "int16" and value.is_floating_point():
            value = (value * 32767).round().clamp(-32768, 32767)
        value = value.to(getattr(torch, {"bool": "bool"}.get(want, want)))
    return value.contiguous()
