"""What a mapped module is judged on: its float64 inputs and output in Kokoro's reference, and
torch float32's own output on the same inputs (the module's noise floor).

Forward hooks (every positional and keyword input, the first output) on one teacher-forced float64
run of each harness step that reaches the modules (`reference.step_of_module`, the traces' own
dynamic inputs, the case's noise). Each module is handed on (judged) from inside that run as soon
as its forward pass ends, and its captures dropped: memory holds the inputs of the mapped modules
still running and one module's output, not every module's of the step. The floor is local too:
the float32 module run alone on those float64 inputs cast to float32, so a module's floor is its
own rounding, not the error the chain accumulated before it. Modules come back in the order their
forward passes *end* (children before their parent), so the first row that leaves its floor is the
innermost module with the defect.
A PackedSequence (Kokoro packs its LSTMs' inputs) is unpacked: at batch 1 on exact lengths it is
the whole sequence. A sub-callable (`decoder.generator.stft.inverse`: a method, which no forward
hook sees) is captured by wrapping that method on the module for the run.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..patches import NOISE_INPUTS, apply_patches, provide_noise, to_float64
from ..plumbing.hooks import registered
from ..reference import MODULE_STEPS, REFERENCE_PATCHES, step_of_module
from ..steps import STEPS, get_step
from ..plumbing.errors import UsageError


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


# Steps that run only part of the module their prefix in MODULE_STEPS names: `f0n` runs the
# predictor's shared LSTM, F0 and N blocks and projections, never its duration path.
PARTIAL_STEPS = frozenset({"f0n"})


def steps_for(paths: list[str]) -> dict[str, str]:
    """The step each module is captured in: the outermost step that runs it among those the
    modules need, so that a module and its parent come from one run (the decoder's modules and
    the generator's inside it: the generator ends before the decoder). An outer step counts only
    where it runs its prefix's module whole: `predictor.lstm` stays in `duration`, though `f0n`'s
    prefix is `predictor`."""
    primary = {}
    for path in paths:
        primary[path] = step_of_module(path)
        if primary[path] is None:
            raise UsageError(f"module {path!r}: no step of the harness runs it")
    needed = set(primary.values())

    def reaching(path: str) -> list[str]:  # innermost first, as MODULE_STEPS lists them
        return [s for prefix, s in MODULE_STEPS if (path == prefix or path.startswith(prefix + "."))
                and (s == primary[path] or s not in PARTIAL_STEPS)]
    return {path: [s for s in reaching(path) if s in needed][-1] for path in paths}


def nbytes(value) -> int:
    """Bytes of the tensors in a captured value (a tensor, or a tuple/list/dict of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(map(nbytes, value))
    if isinstance(value, dict):
        return sum(map(nbytes, value.values()))
    return 0


def callable_at(model: torch.nn.Module, path: str):
    """The module at `path`, or the bound method a sub-callable's path names (`module.method`)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        owner_path, _, method = path.rpartition(".")
        owner = model.get_submodule(owner_path)
        found = getattr(owner, method, None)
        if not callable(found):
            raise UsageError(f"sub-callable {path!r}: Kokoro's {type(owner).__name__} at {owner_path!r} has no "
                             f"method {method!r}") from None
        return found


class _MethodHook:
    """`before` and `after` around one method of one module (an instance attribute over its
    class's method), with the `remove()` of a hook handle."""

    def __init__(self, owner: torch.nn.Module, method: str, before, after):
        real = getattr(owner, method)

        def wrapped(*args, **kwargs):
            before(owner, args, kwargs)
            out = real(*args, **kwargs)
            after(owner, args, kwargs, out)
            return out
        self.owner, self.method = owner, method
        setattr(owner, method, wrapped)

    def remove(self) -> None:
        delattr(self.owner, self.method)


def module_io(km32, km64, traces, paths: list[str], consume: Callable[[ModuleIO], None]) -> int:
    """Call `consume` on each of `paths` with its float64 inputs and output and its float32 floor
    output, in the order their forward passes end, from inside the forward pass that captured
    them: a module's captures are dropped once it is consumed, so memory holds the inputs of the
    modules still running (its mapped ancestors) and one module's output, never a whole step's.
    Returns the peak bytes the captures held at once."""
    by_step: dict[str, list[str]] = {}
    for path, step in steps_for(paths).items():
        by_step.setdefault(step, []).append(path)
    peak = 0
    for step in (s.name for s in STEPS if s.name in by_step):
        inputs = traces.inputs(step, "dynamic", "float64")
        noise = {k: v for k, v in inputs.items() if k in NOISE_INPUTS}
        held: dict[str, tuple] = {}  # path -> (args, kwargs) of the mapped modules running now
        done: set[str] = set()  # a module run twice (ALBERT's shared layer) is captured once

        def hooks(path, sub):
            def before(m, args, kwargs):
                if path not in done and path not in held:
                    held[path] = (tuple(plain(a) for a in args), {k: plain(v) for k, v in kwargs.items()})

            def after(m, args, kwargs, out):
                nonlocal peak
                if path in done or path not in held:
                    return
                done.add(path)
                io = floor_of(km32, path, *held[path], first(out), noise)
                peak = max(peak, nbytes(held) + nbytes((io.out64, io.out32)))
                del held[path]
                consume(io)
            if not isinstance(sub, torch.nn.Module):  # a sub-callable: its method wrapped
                return [_MethodHook(sub.__self__, path.rpartition('.')[2], before, after)]
            return [sub.register_forward_pre_hook(before, with_kwargs=True),
                    sub.register_forward_hook(after, with_kwargs=True)]

        with registered(h for p in by_step[step] for h in hooks(p, callable_at(km64, p))), torch.no_grad():
            get_step(step).module(km64)(*inputs.values())
        never = [p for p in by_step[step] if p not in done]
        if never:  # a mapped module with no row would be a module never judged, and nobody told
            raise RuntimeError(f"step {step!r} never ran mapped module(s) {', '.join(never)} (captures.steps_for)")
    return peak


def floor_of(km32, path: str, args: tuple, kwargs: dict, out64: torch.Tensor, noise: dict) -> ModuleIO:
    """The module's captures with torch float32's own output on them cast (its floor)."""
    with torch.no_grad(), provide_noise({k: v.float() for k, v in noise.items()}):
        out32 = first(callable_at(km32, path)(*map(cast32, args), **{k: cast32(v) for k, v in kwargs.items()}))
    return ModuleIO(path, args, kwargs, out64, out32, noise)
