"""The interface a rewrite of Kokoro implements to be judged module by module.

A rewrite (Kokoro written again in another framework: MLX, JAX, ...) has no exported graph to cut:
the harness can only call its modules. An adapter says, for each Kokoro module path it maps
(`modules`: a path, or a pattern with `*` for one part of it, -> a calling convention of the adapter's
own), how to call the rewrite's counterpart on Kokoro's tensors and bring the result back in
Kokoro's layout (`run`), and how to build the rewrite's model from a given Kokoro checkpoint
(`load`: through the rewrite's own weight conversion, so a bug there shows). The harness feeds
each mapped module the float64 reference's captured inputs at its boundary (cast to float32) and
judges its output against the float64 reference with torch float32's own error as the floor.

Where a module is a composition, the adapter may map its sub-callables too (`calls`: a Kokoro
module path and one of its methods, such as the generator's inverse STFT
`decoder.generator.stft.inverse`): each is judged like a module, and the module that fails is
named with the sub-callable inside it that leaves its floor.

A user's adapter is a Python file defining `ADAPTER` (an `Adapter` instance); its `modules` and
`calls` are checked against Kokoro's module paths before anything runs (`resolve_modules`).
"""
from __future__ import annotations

import contextlib
import difflib
import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from ..plumbing.errors import UsageError


class RewriteError(UsageError):
    """A rewrite adapter that cannot be used: one message naming the file and the field."""


@dataclass(frozen=True)
class Mapped:
    """One Kokoro module the rewrite maps: its path and the adapter's calling convention for it;
    `inside`: for a sub-callable (`module.method`), the module path that holds it."""

    path: str
    convention: str
    inside: str | None = None


class Adapter:
    """Subclass it; `modules`, `load` and `run` are what the harness needs.

    - `modules`: {Kokoro module path or pattern: convention}; the conventions are the adapter's
      own names (the mlx-audio adapter's: `call`, `conv`, `weighted_conv`, ...).
    - `calls`: {Kokoro module path + "." + method: convention}: sub-callables, called by `run`
      with that path like modules (not in `chained`'s conventions).
    - `missing()`: why the rewrite cannot run here (its package is absent), or None.
    - `load(kmodel)`: the rewrite's model holding the weights of kokoro's `KModel` `kmodel`.
    - `run(model, path, convention, args, kwargs)`: call the counterpart of Kokoro's module
      `path` on Kokoro's inputs (torch float32 tensors, as Kokoro's forward receives them) and
      return its (first) output as a torch tensor in Kokoro's layout.
    - `noise(values)`: a context in which the rewrite draws these numbers instead of its own
      random ones (`rand_ini`, `sine_noise`, `source_noise`, Kokoro's layout), so that a module
      holding the vocoder's noise source can be judged sample by sample.
    - `synthesize(model, phonemes, ref_s, speed)`: the rewrite's own tokens -> audio (its own
      noise), returning (audio [samples], durations [tokens]) or None when it has no such entry.
    - `chained(model, phonemes, ref_s, speed, noise, conventions, save)`: optional; run the
      rewrite's own tokens -> audio once, drawing Kokoro's `noise`, and hand each mapped module's
      output (Kokoro's layout, numpy) to `save(path, value)`; False when it has no such entry.
    - `repro(model, path, convention, out_dir)`: optional; write into `out_dir` what a standalone
      run of module `path` needs (its weights, a runner file defining `run_saved(here, meta, args,
      kwargs, noise)` -> numpy output in Kokoro's layout) and return {"runner": module name,
      "packages": [...], "built": how the module is built}; None: the bundle's repro.py exits 2.
    """

    name: str = "rewrite"
    modules: dict[str, str] = {}
    calls: dict[str, str] = {}

    def missing(self) -> str | None:
        return None

    def load(self, kmodel: torch.nn.Module) -> Any:
        raise NotImplementedError

    def run(self, model: Any, path: str, convention: str, args: tuple, kwargs: dict) -> torch.Tensor:
        raise NotImplementedError

    @contextlib.contextmanager
    def noise(self, values: dict[str, torch.Tensor]) -> Iterator[None]:
        yield

    def synthesize(self, model: Any, phonemes: str, ref_s: torch.Tensor, speed: float):
        return None

    def repro(self, model: Any, path: str, convention: str, out_dir: Path) -> dict | None:
        return None

    def chained(self, model: Any, phonemes: str, ref_s: torch.Tensor, speed: float, noise: dict[str, torch.Tensor],
                conventions: dict[str, str], save) -> bool:
        return False


def resolve_modules(adapter: Adapter, paths: tuple[str, ...], source: str) -> list[Mapped]:
    """The adapter's `modules` expanded over Kokoro's module paths (`paths`, in Kokoro's order):
    a key that names no module is one RewriteError naming `source`, the field and the nearest
    valid paths."""
    if not isinstance(adapter.modules, dict) or not adapter.modules:
        raise RewriteError(f"{source}: field 'modules': a non-empty dict of Kokoro module path -> convention")
    found: dict[str, str] = {}
    for key, convention in adapter.modules.items():
        hits = [p for p in paths if matches(p, key)]
        if not hits:
            near = difflib.get_close_matches(key.replace("*", "0"), paths, n=4, cutoff=0.6)
            raise RewriteError(f"{source}: field 'modules': Kokoro has no module {key!r}"
                               + (f"; nearest: {', '.join(near)}" if near else
                                  "; top-level modules: bert, bert_encoder, predictor, text_encoder, decoder"))
        for p in hits:
            found.setdefault(p, convention)
    mapped = [Mapped(p, found[p]) for p in paths if p in found]
    return mapped + resolve_calls(adapter, paths, source)


def resolve_calls(adapter: Adapter, paths: tuple[str, ...], source: str) -> list[Mapped]:
    """The adapter's `calls`: each a method of a Kokoro module (`decoder.generator.stft.inverse`);
    a module path Kokoro does not have is one RewriteError naming `source`, the field and the
    nearest module paths (whether the method exists is checked where the reference calls it)."""
    if not isinstance(adapter.calls, dict):
        raise RewriteError(f"{source}: field 'calls': a dict of Kokoro module path + '.' + method -> convention")
    out = []
    for key, convention in adapter.calls.items():
        module, _, method = str(key).rpartition(".")
        if module not in paths or not method.isidentifier():
            near = difflib.get_close_matches(module, paths, n=4, cutoff=0.6)
            raise RewriteError(f"{source}: field 'calls': {key!r} is not a Kokoro module path and one of its "
                               f"methods" + (f"; nearest modules: {', '.join(near)}" if near else ""))
        out.append(Mapped(key, convention, inside=module))
    return out


def matches(path: str, pattern: str) -> bool:
    """A module path against a key of `modules`, part by part: `*` stands for one part (an
    index, a name), never for a subtree, so `decoder.decode.*` is the four blocks, not their
    convolutions."""
    parts, want = path.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatch.fnmatchcase(p, w) for p, w in zip(parts, want))
