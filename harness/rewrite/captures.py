"""What a mapped module is judged on: its float64 inputs and output in Kokoro's reference, and
torch float32's own output on the same inputs (the module's noise floor).

Forward hooks (every positional and keyword input, the first output) on one teacher-forced float64
run of each harness step that reaches the modules (`reference.step_of_module`, the traces' own
dynamic inputs, the case's noise). The floor is local too: the float32 module run alone on those
float64 inputs cast to float32, so a module's floor is its own rounding, not the error the chain
accumulated before it. Modules come back in the order their forward passes *end* (children before
their parent), so the first row that leaves its floor is the innermost module with the defect.
A PackedSequence (Kokoro packs its LSTMs' inputs) is unpacked: at batch 1 on exact lengths it is
the whole sequence.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..patches import NOISE_INPUTS, apply_patches, provide_noise, to_float64
from ..plumbing.hooks import registered
from ..reference import MODULE_STEPS, REFERENCE_PATCHES, step_of_module
from ..steps import STEPS, get_step


@dataclass
class ModuleIO:
    path: str
    args: tuple  # float64 inputs (tensors as Kokoro's forward receives them, sequences unpacked)
    kwargs: dict
    out64: torch.Tensor
    out32: torch.Tensor  # torch float32 on the same inputs cast: the floor
    noise: dict[str, torch.Tensor]  # the step's noise inputs (float64); empty before the vocoder


def plain(value):
    """A captured value without PackedSequence, detached and cloned (Generator adds to a
    resblock's output in place after its hook ran)."""
    if isinstance(value, PackedSequence):
        return pad_packed_sequence(value, batch_first=True)[0].detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def cast32(value):
    return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def first(out):
    return plain(out[0] if isinstance(out, (tuple, list)) else out)


def reference_models(kmodel: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Kokoro with the reference's patches (noise as input, dropout as identity), float32 and float64."""
    km32 = apply_patches(kmodel, REFERENCE_PATCHES["dynamic"])
    return km32, to_float64(copy.deepcopy(km32))


def steps_for(paths: list[str]) -> dict[str, str]:
    """The step each module is captured in: the outermost step that reaches it among those the
    modules need, so that a module and its parent come from one run (the decoder's modules and
    the generator's inside it: the generator ends before the decoder)."""
    primary = {}
    for path in paths:
        primary[path] = step_of_module(path)
        if primary[path] is None:
            raise ValueError(f"module {path!r}: no step of the harness runs it")
    needed = set(primary.values())
    def reaching(path: str) -> list[str]:  # innermost first, as MODULE_STEPS lists them
        return [s for prefix, s in MODULE_STEPS if path == prefix or path.startswith(prefix + ".")]
    return {path: [s for s in reaching(path) if s in needed][-1] for path in paths}


def module_io(km32, km64, traces, paths: list[str]) -> Iterator[ModuleIO]:
    """Each of `paths` with its float64 inputs and output and its float32 floor output, one step
    at a time (memory holds one step's captures), in the order their forward passes end."""
    by_step: dict[str, list[str]] = {}
    for path, step in steps_for(paths).items():
        by_step.setdefault(step, []).append(path)
    for step in (s.name for s in STEPS if s.name in by_step):
        inputs = traces.inputs(step, "dynamic", "float64")
        noise = {k: v for k, v in inputs.items() if k in NOISE_INPUTS}
        seen: dict[str, list] = {}
        order: list[str] = []

        def hooks(path, sub):
            def before(m, args, kwargs):
                seen.setdefault(path, [tuple(plain(a) for a in args), {k: plain(v) for k, v in kwargs.items()}])

            def after(m, args, kwargs, out):
                if len(seen[path]) == 2:
                    seen[path].append(first(out))
                    order.append(path)
            return [sub.register_forward_pre_hook(before, with_kwargs=True),
                    sub.register_forward_hook(after, with_kwargs=True)]

        with registered(h for p in by_step[step] for h in hooks(p, km64.get_submodule(p))), torch.no_grad():
            get_step(step).module(km64)(*inputs.values())
        for path in order:
            args, kwargs, out64 = seen.pop(path)
            with torch.no_grad(), provide_noise({k: v.float() for k, v in noise.items()}):
                out32 = first(km32.get_submodule(path)(*map(cast32, args),
                                                       **{k: cast32(v) for k, v in kwargs.items()}))
            yield ModuleIO(path, args, kwargs, out64, out32, noise)
