"""`kokoro-parity port init ARTIFACT...`: a port file proposed from the artifacts, in the order given,
every proposal marked `# guess: confirm` and every input or output it could not place marked
`# unknown: map me`. `kokoro-parity port check` then validates it whole.

By value (the default): each stage runs on one case, the first on the case's inputs, each next one
on the earlier stages' outputs (an input named like an earlier output takes that output) plus the
case's inputs and the harness's host glue over them (`chain.glue`: durations -> alignment). Each
output is proposed as the Kokoro tensor whose float32 reference on that case (the values `port
check --run` judges against) it is nearest to in relative L2, in any axis order (past THRESHOLD:
noise-dependent audio by its envelope, a float tensor up to a constant gain); an input is the
tensor that fed it, chosen among those its declared shape and dtype take by whose outputs come
nearest the reference. An export's own names (`/encoder/MatMul_1_output_0`) carry nothing, so
names and ranks cannot tell F0 from N; values can.
By name (`--no-run`, no runtime installed, or a stage that cannot run): the declared name, then
rank and dtype (`tensors.guess`, `matching.by_shape`), the comment saying why.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from . import tensors
from ..backends.prebuilt import PrebuiltBackend, describe, run_artifact
from ..model import SAMPLES_PER_FRAME
from ..reference import CASE_INPUTS
from ..steps import FRAME_UNITS
from .chain import from_artifact, glue, to_artifact
from .matching import best_layout, by_shape, is_int8, rel_l2
from .defects import envelope
from ..plumbing.files import atomic_write

# Relative L2 above which an output is no Kokoro tensor: left `FIXME` with its nearest. A clean
# float32 stage is ~1e-6 off, an int8 one a few 1e-2; an unrelated tensor of the same shape ~1.
THRESHOLD = 0.5
# Frames by which an artifact's output may be longer or shorter than the reference (an int8 front
# rounds a duration one frame longer): such an output is compared over the common prefix.
SLACK_FRAMES = 2
INIT_CASE = "en_short"  # the case the stages run on unless --case names another
MAX_RUNS = 40  # runs per stage while choosing among the inputs' candidates


@dataclass
class Guess:
    tensor: str | None
    why: str  # the comment after `# guess: confirm` (or the nearest, for an unknown)
    distance: float = float("nan")


@dataclass
class Values:
    """The case a stage runs on: its id, its traces, each Kokoro tensor's float32 reference."""
    case: str
    traces: object
    refs: dict


def case_values(traces) -> Values:
    """The float32 reference of every vocabulary tensor the case has (`tensors.reference`)."""
    refs = {}
    for name in tensors.VOCAB:
        try:
            refs[name] = tensors.reference(name, traces, "float32")
        except KeyError:
            continue
    return Values(traces.case_id, traces, refs)


# ---- distances ------------------------------------------------------------------------------------

def _kind(dtype) -> str:
    name = str(dtype).replace("torch.", "")
    return "float" if name.startswith(("float", "half", "double", "bfloat")) else "int"


def distance(value, name: str, ref: torch.Tensor) -> tuple[float, str] | None:
    """Relative L2 of an artifact's value against Kokoro's `name` in any axis order (size-1 axes
    squeezed; `matching.rel_l2`), with a note, or None when no layout has its shape. Integer
    values are compared rounded; a frame axis a few frames off is compared over the common prefix."""
    a = np.asarray(value)
    if _kind(a.dtype) != _kind(ref.dtype):
        return None
    if _kind(a.dtype) == "int":
        a = np.round(a.astype(np.float64)).astype(np.int64)
    if _same_dims(a.shape, ref.shape):
        d, note = _compare(a, name, ref)
        return d, note + _duration_note(a, name, ref)
    best = None
    for axis, unit in tensors.VOCAB[name].axes.items() if name in tensors.VOCAB else ():
        n, slack = ref.shape[axis], SLACK_FRAMES * FRAME_UNITS.get(unit, 0)
        for ax, size in enumerate(a.shape):
            if size == n or abs(size - n) > slack:
                continue
            m = min(size, n)
            cut, r = np.take(a, range(m), axis=ax), ref.narrow(axis, 0, m)
            if _same_dims(cut.shape, r.shape):
                d, note = _compare(cut, name, r)
                if best is None or d < best[0]:
                    best = (d, f"; compared over the common {m} {unit}: the artifact has {size}, the reference "
                               f"{n}{note}")
    return best


def _compare(a: np.ndarray, name: str, ref: torch.Tensor) -> tuple[float, str]:
    """`rel_l2`, and when that is past THRESHOLD: a tensor that depends on the vocoder's noise (the
    audio) by its amplitude envelope (`onnx_stages.envelope`: a stage drawing its own noise shares
    no sample with the case's draw); a float tensor up to a constant gain (a port with a gain or a
    sign flip still maps, the comment saying so)."""
    d, note = rel_l2(a, ref), ""
    t = tensors.VOCAB.get(name)
    if d > THRESHOLD and t is not None and t.stochastic and a.size >= 2 * SAMPLES_PER_FRAME:
        ea, er = envelope(a).numpy(), envelope(ref.numpy())
        env = rel_l2(ea, er)
        if env < d:
            note = f"; by its amplitude envelope (frame RMS; sample by sample {d:.2g}): it depends on the noise"
            d, a, ref = env, ea, er
    if d > THRESHOLD and _kind(a.dtype) == "float":
        x, y = best_layout(a, ref).astype(np.float64).reshape(-1), ref.double().numpy().reshape(-1)
        k = float(x @ y / (y @ y)) if (y @ y) > 0 else 0.0
        fitted = float(np.linalg.norm(x - k * y) / (abs(k) * np.linalg.norm(y))) if k else float("inf")
        if fitted < d:
            note += f"; after a constant gain x{k:.3g} (as it is {d:.2g})"
            d = fitted
    return d, note


def _same_dims(a, b) -> bool:
    return sorted(d for d in a if d != 1) == sorted(d for d in b if d != 1)


def _duration_note(a: np.ndarray, name: str, ref: torch.Tensor) -> str:
    if name != "pred_dur":
        return ""
    diff = np.abs(a.reshape(-1) - ref.numpy().reshape(-1))
    if not diff.any():
        return "; durations equal"
    return f"; {int((diff > 0).sum())} of {diff.size} durations differ (by at most {int(diff.max())} frame(s))"


def nearest(value, refs: dict) -> list[tuple[float, str, str]]:
    """(distance, Kokoro tensor, note) for every reference the value's shape fits, nearest first."""
    found = []
    for name, ref in refs.items():
        d = distance(value, name, ref)
        if d is not None:
            found.append((d[0], name, d[1]))
    return sorted(found, key=lambda f: f[0])


def output_guesses(outs: list, values: Values) -> list[Guess]:
    """Each output's nearest Kokoro tensor, assigned nearest pair first (no tensor twice)."""
    pairs = sorted((d, i, t, note) for i, v in enumerate(outs) for d, t, note in nearest(v, values.refs))
    guesses: list[Guess | None] = [None] * len(outs)
    taken: set[str] = set()
    for d, i, t, note in pairs:
        if guesses[i] is None and t not in taken and d <= THRESHOLD:
            guesses[i] = Guess(t, f"by value: rel. L2 {d:.1e} against Kokoro's {t} on case {values.case}{note}", d)
            taken.add(t)
    for i, v in enumerate(outs):
        if guesses[i] is None:
            near = nearest(v, values.refs)
            why = (f"nearest: {near[0][1]} at distance {near[0][0]:.2g} on case {values.case}" if near
                   else f"no Kokoro tensor on case {values.case} has its shape {list(np.shape(v))}")
            guesses[i] = Guess(None, why, near[0][0] if near else float("inf"))
    return guesses


# ---- running the stages ---------------------------------------------------------------------------

def _fits(p, value: torch.Tensor) -> bool:
    """The value in the declared rank (leading size-1 axes added or dropped, as `port check` feeds
    it) has the declared static sizes, as many axes that are not 1, and the declared kind."""
    if p.dtype and (_kind(p.dtype) == "float") != value.is_floating_point():
        return False
    if p.shape is None:
        return True
    if sum(d != 1 for d in value.shape) != sum(s != 1 for s in p.shape):
        return False
    v = to_artifact(value, p, str(value.dtype).replace("torch.", ""))
    return v.dim() == len(p.shape) and all(not isinstance(s, int) or s <= 0 or s == v.shape[i]
                                           for i, s in enumerate(p.shape))


def input_options(p, values: Values, chained: dict, produced: dict) -> list[tuple[str, torch.Tensor, str]]:
    """(Kokoro tensor, value fed, how) for one input, most likely first: an earlier stage's output of
    the same name alone; else the tensors the declared shape and dtype take, the earlier stages'
    outputs first, then a name guess, the case's inputs, the rest (`chain.glue`: as `port check`
    feeds them, the host glue over the earlier outputs included)."""
    if p.name in produced:
        stage, tensor, raw = produced[p.name]
        return [(tensor, torch.as_tensor(np.asarray(raw)), f"stage {stage}'s output {p.name!r}")]
    named = tensors.guess(p.name, p.rank, p.dtype)
    order = [*chained, *([named] if named else []), *CASE_INPUTS, "ref_s", *tensors.VOCAB]
    options = []
    for t in dict.fromkeys(order):
        try:
            value = glue(t, chained, values.traces)
        except (KeyError, RuntimeError, ValueError):
            continue
        if _fits(p, value):
            ref = values.refs.get(t)
            how = ("an earlier stage's output" if t in chained else "Kokoro's" if ref is not None and
                   ref.shape == value.shape and torch.equal(ref, value) else "the host glue's")
            options.append((t, value, how))
    return options


def _score(outs, values: Values) -> float:
    return sum(min((nearest(v, values.refs)[:1] or [(1.0,)])[0][0], 1.0) for v in outs)


def _run(path: Path, ins: list, choice: list) -> list:
    feed = [to_artifact(v, p, None) for p, (_, v, _) in zip(ins, choice)]
    return [np.asarray(o) for o in run_artifact(path, feed)]


def choose_inputs(path: Path, ins: list, options: list[list], values: Values) -> tuple[list, list, int]:
    """The inputs' candidates settled one input at a time (each alternative run, the others held),
    again while a pass changes anything (a wrong later input can keep an earlier one from running):
    the choice whose outputs come nearest Kokoro's references. Returns (choice, outputs, runs)."""
    state = {"choice": [o[0] for o in options], "outs": None, "best": float("inf"), "runs": 0, "error": None}

    def attempt(cand: list) -> bool:
        state["runs"] += 1
        try:
            got = _run(path, ins, cand)
        except Exception as e:  # noqa: BLE001 - a wrong candidate may not run: the others are tried
            state["error"] = e
            return False
        score = _score(got, values)
        if score < state["best"]:
            state.update(choice=cand, outs=got, best=score)
            return True
        return False

    with _quiet_runtime():
        _settle(options, state, attempt)
    if state["outs"] is None:
        e = state["error"]
        raise RuntimeError(f"no choice of inputs runs: {type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200] if str(e) else ''}")
    return state["choice"], state["outs"], state["runs"]


def _settle(options: list[list], state: dict, attempt) -> None:
    """Each input's alternatives tried with the others as chosen so far; again while a pass changes
    anything, within MAX_RUNS (a stage of the real model runs for seconds)."""
    attempt(state["choice"])
    for _pass in range(3):
        changed = False
        for i, opts in enumerate(options):
            for alt in opts:
                if alt is not state["choice"][i] and state["runs"] < MAX_RUNS:
                    changed |= attempt([*state["choice"][:i], alt, *state["choice"][i + 1:]])
        if not changed:
            break


@contextlib.contextmanager
def _quiet_runtime():
    """onnxruntime logs every failed run as an error: a wrong candidate's run is expected to fail."""
    try:
        import onnxruntime as ort  # runtime: its logger, where it is installed
    except ImportError:
        yield
        return
    ort.set_default_logger_severity(4)
    try:
        yield
    finally:
        ort.set_default_logger_severity(2)


def stage_by_value(path: Path, values: Values, chained: dict, produced: dict):
    """One stage run on the case: ([Guess per input], [Guess per output]), or why it cannot run.
    Its mapped outputs join `chained` (Kokoro convention) and `produced` (as the artifact gave them)."""
    backend = PrebuiltBackend(path)
    for ok, why in (backend.available(), backend.runnable()):
        if not ok:
            return why
    ins, outs = describe(path)
    if outs is None:
        return f"a {backend.kind} artifact does not declare its outputs"
    options = [input_options(p, values, chained, produced) for p in ins]
    for p, opts in zip(ins, options):
        if not opts:
            shape = f"{p.dtype or '?'} {list(p.shape) if p.shape is not None else '?'}"
            return f"input {p.name!r}: no Kokoro tensor on case {values.case} fits its declared {shape}"
    try:
        choice, got, _runs = choose_inputs(path, ins, options, values)
    except RuntimeError as e:
        return f"cannot run on case {values.case}: {e}"
    if len(got) != len(outs):
        return f"it returned {len(got)} outputs, its file declares {len(outs)}"
    in_guesses = [_input_guess(c, opts, values) for c, opts in zip(choice, options)]
    out_guesses = output_guesses(got, values)
    for p, g, raw in zip(outs, out_guesses, got):
        if g.tensor is not None and p.name is not None:
            produced[p.name] = (path.stem, g.tensor, raw)
        if g.tensor is not None:
            chained[g.tensor] = from_artifact(torch.as_tensor(raw), g.tensor, None)
    return in_guesses, out_guesses


def _input_guess(chosen, opts: list, values: Values) -> Guess:
    tensor, value, how = chosen
    ref = values.refs.get(tensor)
    d = distance(np.asarray(value), tensor, ref) if ref is not None else None
    against = f"rel. L2 {d[0]:.1e} against Kokoro's {tensor} on case {values.case}{d[1]}" if d else \
        f"Kokoro's {tensor} on case {values.case}"
    if how.startswith("stage "):
        return Guess(tensor, f"by value: {how}, {against}", d[0] if d else float("nan"))
    fed = f"by value: fed {how} {tensor} on case {values.case}" + ("" if how == "Kokoro's" else f" ({against})")
    if len(opts) == 1:  # Kokoro's own value needs no distance; an earlier output's does
        return Guess(tensor, f"{fed}: the only tensor its declared shape and dtype take")
    others = [o[0] for o in opts if o[0] != tensor]
    others = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
    return Guess(tensor, f"{fed}: of the {len(opts)} tensors that fit (also {others}), the one whose "
                         f"outputs come nearest Kokoro's")


# ---- the file -------------------------------------------------------------------------------------

def _guess(p, side: str, taken: set[str], reason: str) -> Guess:
    shape = f"declared {p.dtype or '?'} {list(p.shape) if p.shape is not None else '?'}"
    t = tensors.guess(p.name, p.rank, p.dtype)
    how = "by name"
    if t is None:
        t, how = by_shape(p, side, None, taken), "by rank and dtype"
    if t is None:
        return Guess(None, shape + (f"; {reason}" if reason else ""))
    return Guess(t, f"{how}{'; ' + reason if reason else ''}; {shape}, Kokoro's {tensors.describe(t)}")


def stage_lines(path: Path, out: Path, guessed, reason: str) -> list[str]:
    """One stage's lines: `guessed` is ([Guess per input], [Guess per output]) by value, or None (then
    by name, `reason` saying why)."""
    ins, outs = describe(path)
    rel = os.path.relpath(Path(path).resolve(), out.parent.resolve())
    lines = [f"  - name: {Path(path).stem.replace('.', '_')}", f"    artifact: {rel}"]
    if is_int8(Path(path)):
        lines.append("    precision: int8  # guess: confirm (integer matmuls/convolutions in the graph)")
    per_side = {}
    for side, ports, by_value in (("inputs", ins, guessed and guessed[0]),
                                  ("outputs", outs or [], guessed and guessed[1])):
        taken: set[str] = set()
        per_side[side] = []
        for i, p in enumerate(ports):
            name = p.name if p.name is not None else f"#{i}"
            g = by_value[i] if by_value else _guess(p, side, taken, reason)
            if g.tensor is not None:
                taken.add(g.tensor)
            per_side[side].append((name, g))
    noise_in = [n for n, g in per_side["inputs"] if g.tensor in tensors.NOISE]
    if noise_in:
        lines.append(f"    noise: inputs  # guess: confirm (the vocoder's noise is an input: {', '.join(noise_in)})")
    for side in ("inputs", "outputs"):
        lines.append(f"    {side}:")
        for name, g in per_side[side]:
            lines.append(f"      {_key(name)}: FIXME  # unknown: map me ({g.why})" if g.tensor is None else
                         f"      {_key(name)}: {g.tensor}  # guess: confirm ({g.why})")
    return lines


def port_text(artifacts: list[Path], out: Path, values: Values | None = None, reason: str = "") -> str:
    """The port file's text; `values`: the case the stages run on (by value), else by name
    (`reason`: why, in every comment)."""
    lines = ["# written by `kokoro-parity port init`: confirm every line marked `# guess: confirm`,",
             "# map every `# unknown: map me` to a Kokoro tensor (docs/own-port.md), then run",
             f"# `kokoro-parity port check {out.name}`.",
             f"name: {out.parent.resolve().name or 'my-port'}", "stages:"]
    chained: dict = {}
    produced: dict = {}
    for path in artifacts:
        guessed, why = None, reason
        if values is not None:
            got = stage_by_value(Path(path), values, chained, produced)
            guessed, why = (got, "") if isinstance(got, tuple) else (None, f"not run: {got}")
        lines += stage_lines(Path(path), out, guessed, why)
    return "\n".join(lines) + "\n"


def _key(name: str) -> str:
    return name if name.replace("_", "").isalnum() else f'"{name}"'


def write_port(artifacts: list[Path], out: Path, values: Values | None = None, reason: str = "") -> Path:
    text = port_text(artifacts, Path(out), values, reason)
    return atomic_write(out, lambda f: f.write(text.encode()))
