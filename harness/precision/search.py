"""The smallest set of modules to keep in float32 so that a float16 step is *shippable*
(`harness.verdict.shippable`) on every selected case: the per-module error and range audit ranks
the candidates, a greedy pass adds the one of most measured benefit until every case is shippable,
and a pruning pass drops those no longer needed. `write_keep_list` emits the result in the two
forms porters use (harness.precision.islands): a keep-list JSON and a standalone Python file with a
Core ML `op_selector`. `kokoro-parity precision` is its face.
"""
from __future__ import annotations

import copy
import inspect
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
from torch.nn.modules.module import register_module_forward_hook
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from ..backends.fp16 import Fp16Backend
from ..cases import case_dirs, configured_dirs, load_cases
from ..metrics.audio import audio_metrics
from ..metrics.tensor import error_metrics
from ..patches import affecting, apply_patches, to_float64
from ..plumbing.files import atomic_write_json, atomic_write_text
from ..plumbing.hooks import registered
from ..reference import (NEUTRAL_PATCHES, REFERENCE_PATCHES, as_outputs, load_traces, references_for,
                         synthesizer_reference)
from ..steps import get_step
from ..verdict import shippable
from .float16 import Mixed, _kmodel_path, _strip, under
from .islands import ISLAND_PATCHES, KEEP_SCHEMA, island_nodes, node_module_path, op_selector_for, patches_for
from ..plumbing.errors import UsageError

# ---- the per-module audit -------------------------------------------------------------------------

FP16_MAX = 65504.0


def module_audit(module: torch.nn.Module, inputs: list, depth: int = 4, dtype=torch.float16,
                 emulate: bool = True) -> list[dict]:
    """Per submodule (up to `depth` levels below the KModel): its largest float32 activation against
    float16's 65,504, and its *local* float16 error: the module alone in float16 on its exact float32
    inputs, against its float32 output (relative L2; inf when float16 is non-finite); and its
    `producers`, the modules whose outputs (or views of them) it reads. Sorted worst first."""
    rows: dict[str, dict] = {}
    hooks = []
    made: dict[int, str] = {}  # storage of a module's output -> the first module that made it
    keep_alive = []  # outputs kept referenced, so that no storage is reused within the audit

    def storages(obj) -> set[int]:
        # tree_flatten, not tree_map: a PackedSequence (the duration LSTMs' input) cannot be rebuilt
        return {x.untyped_storage().data_ptr() for x in tree_flatten(obj)[0]
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.numel()}

    def rel(a, b) -> float:
        a, b = a.double(), b.double()
        if not torch.isfinite(a).all():
            return math.inf
        n = float(b.norm())
        return float((a - b).norm()) / n if n else float((a - b).norm() != 0)

    for path, sub in module.named_modules():
        p = _strip(path)
        if not path or path == "kmodel" or p.count(".") >= depth or not _kmodel_path(module, path):
            continue

        def hook(m, args, kwargs, out, p=p):
            floats = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if p in rows or not floats:
                return
            peak = max(float(t.detach().abs().max()) if t.numel() else 0.0 for t in floats)
            row = {"module": p, "type": type(m).__name__, "max_abs_fp32": peak, "of_fp16_max": peak / FP16_MAX,
                   "params": sum(q.numel() for q in m.parameters())}
            try:
                half = Mixed(_detached(m), dtype=dtype, emulate=emulate)
                local = [t for t in tree_flatten(half(*args, **kwargs))[0]
                         if isinstance(t, torch.Tensor) and t.is_floating_point()]
                # the worst of its outputs: the STFT's phase, not its magnitude, is what float16 breaks
                row["local_rel_l2"] = max(rel(lo, fo) for lo, fo in zip(local, floats))
            except Exception as e:  # noqa: BLE001 - a module that cannot run alone is still listed
                row["local_rel_l2"], row["local_error"] = math.nan, f"{type(e).__name__}: {e}"[:160]
            row["producers"] = sorted({made[s] for s in storages((args, kwargs)) if s in made} - {p})
            for s in storages(out):
                made.setdefault(s, p)
            keep_alive.append(out)
            rows[p] = row

        hooks.append(sub.register_forward_hook(hook, with_kwargs=True))
    with registered(hooks), torch.no_grad():
        module(*inputs)
    return sorted(rows.values(), key=_audit_order)


def _audit_order(r: dict) -> tuple:
    """Worst local float16 error first (a module that cannot run alone last), then the largest range."""
    return -(r["local_rel_l2"] if not math.isnan(r["local_rel_l2"]) else -1), -r["of_fp16_max"]


def _detached(m: torch.nn.Module) -> torch.nn.Module:
    """A copy of a submodule without the audit's hooks."""
    c = copy.deepcopy(m)
    for s in c.modules():
        s._forward_hooks.clear()
        s._forward_hooks_with_kwargs.clear() if hasattr(s, "_forward_hooks_with_kwargs") else None
    return c


# ---- the search ---------------------------------------------------------------------------------

@dataclass
class Target:
    """One case's step, as the search runs it: the float32 step module (the reference's patches and
    the backend's semantics-changing ones), its float32 inputs and the float64 reference outputs."""

    case: str
    step: Any  # harness.steps.Step
    module: torch.nn.Module
    inputs: list
    fp64: dict[str, torch.Tensor]
    valid: Callable[[str, torch.Tensor], torch.Tensor]
    # `--step e2e`'s synthesizer: the same case's duration stage, whose `d` it is fed (fed_inputs)
    upstream: "Target | None" = None
    fed: dict = field(default_factory=dict, repr=False)  # the upstream's kept modules -> its `d`, or None
    called: frozenset | None = field(default=None, repr=False)  # the KModel modules its step runs


# `--step e2e`: the two programs of the e2e item (harness.e2e), judged as the item judges them: the
# duration stage by its durations, the synthesizer by its audio on the reference's alignment, fed
# the float16 duration stage's `d` (the item's chained run) while every duration rounds as float64's,
# else the reference's `d` (the item's local run: a duration that rounds differently is counted
# once, at its stage, not again as audio).
E2E_STAGES = ("duration_stage", "synthesizer")


def fed_inputs(target: Target, keep: list[str], emulate: bool) -> tuple[list, str]:
    """The target's inputs for a run with `keep` in float32, and how they were fed. An e2e
    synthesizer gets its duration stage's float16 `d`, run with the same set (the part of it that
    the duration stage runs; memoized per that part): before, the search judged it on float32 `d`
    and a set it found shippable failed on the `fp16` backend (MCD 0.58 dB, docs/precision.md)."""
    up = target.upstream
    if up is None or "d" not in target.step.input_names:
        return target.inputs, "reference inputs"
    if up.called is None:
        up.called = called_modules(up.module, up.inputs)
    part = frozenset(k for k in keep if any(under(c, [k]) for c in up.called))
    if part not in target.fed:
        target.fed[part] = float16_d(up.step, up.module, up.inputs, part, emulate, up.fp64["duration"])
    d = target.fed[part]
    if d is None:
        return target.inputs, "reference d (the float16 durations round differently: the item's local run)"
    inputs = list(target.inputs)
    i = target.step.input_names.index("d")
    inputs[i] = d.to(inputs[i].dtype).reshape(inputs[i].shape)
    return inputs, "the float16 duration stage's d (the item's chained run)"


def float16_d(step, module: torch.nn.Module, inputs: list, keep: Iterable[str], emulate: bool,
              reference_duration: torch.Tensor) -> torch.Tensor | None:
    """The duration stage in float16 with `keep` in float32: its `d` (float16 values, as float32)
    when every rounded duration equals the reference's (`reference_duration`, before rounding),
    else None. How the search feeds an e2e synthesizer and how the e2e item's float16 floor
    (harness.e2e.float16_floor_audio) chains its two stages."""
    outs = as_outputs(step, Mixed(module, sorted(keep), emulate=emulate)(*inputs))
    rr = lambda x: torch.round(x.double()).clamp(min=1)  # noqa: E731 - kokoro's rounding of durations
    if bool(torch.isfinite(outs["duration"]).all()) and torch.equal(rr(outs["duration"]), rr(reference_duration)):
        return outs["d"].float()
    return None


def called_modules(module: torch.nn.Module, inputs: list) -> frozenset:
    """KModel paths of the modules a step's forward calls (one float32 pass with hooks)."""
    seen = set()
    with registered(sub.register_forward_pre_hook(lambda m, a, p=_strip(path): seen.add(p))
                    for path, sub in module.named_modules() if path and _kmodel_path(module, path)), torch.no_grad():
        module(*inputs)
    return frozenset(seen)


def targets_for(model, case_ids: list[str] | None, step: str, mode: str = "dynamic",
                patches: Iterable[str] | None = None) -> list[Target]:
    """The search's targets: one per case (per case and stage for `e2e`), with the patches of the
    `fp16` backend's programs and ISLAND_PATCHES (bit-exact; they make code that a module runs as
    methods keepable)."""
    if step == "e2e" and mode != "dynamic":
        raise UsageError("--step e2e: dynamic mode only (the e2e item's static buckets pad the synthesizer, a "
                         "rewrite of its own; search the static decoder with --step decoder --mode static)")
    steps = E2E_STAGES if step == "e2e" else (step,)
    patches = tuple((*Fp16Backend.patches, *ISLAND_PATCHES) if patches is None else patches)
    out = []
    for case in load_cases(case_dirs(configured_dirs()), only=case_ids):
        traces = load_traces(model, case)
        for name in steps:
            s = get_step(name)
            # an e2e stage gets the patches of both (a keep-list names modules of either; a patch
            # that cannot change a stage leaves it as it is)
            variant = tuple(dict.fromkeys(p for n in steps for p in affecting(
                [p for p in patches if p not in REFERENCE_PATCHES[mode] and p not in NEUTRAL_PATCHES], n)))
            km = apply_patches(model.kmodel, (*REFERENCE_PATCHES[mode], *variant))
            if step == "e2e":  # the stages' inputs are the chain's, exact lengths: nothing to trim
                inputs = [traces.chain[k] for k in s.input_names]
                fp64 = _e2e_fp64(model, case, traces, s, km, inputs, variant)
                valid = lambda n, t: t  # noqa: E731
            else:
                inputs = list(traces.inputs(name, mode, "float32").values())
                fp64 = references_for(model, case, traces, name, mode, patches).fp64
                valid = lambda n, t, traces=traces, name=name: traces.valid_region(name, n, t)  # noqa: E731
            out.append(Target(case.id if len(steps) == 1 else f"{case.id}:{name}", s, s.module(km), inputs, fp64, valid))
            if step == "e2e" and name == "synthesizer":
                out[-1].upstream = out[-2]  # this case's duration stage
    return out


def _e2e_fp64(model, case, traces, step, km, inputs, variant) -> dict[str, torch.Tensor]:
    """float64 outputs of an e2e stage: the synthesizer's is the e2e item's own (cached), the
    duration stage's is one cheap float64 pass here."""
    if step.name == "synthesizer":
        return {"audio": synthesizer_reference(model, case, traces, tuple(variant))["float64"]}
    with torch.no_grad():
        return as_outputs(step, step.module(to_float64(copy.deepcopy(km)))(
            *[x.double() if x.is_floating_point() else x for x in inputs]))


@dataclass
class Evaluation:
    case: str
    keep: list[str]
    shippable: bool | None
    why: str
    badness: float  # 0 when shippable; how far from the bars otherwise (the search minimizes it)
    metrics: dict[str, dict[str, float]]  # per output: rel_l2, nan_rate, and the audio bars' metrics
    seconds: float


AUDIO_KEYS = ("pesq", "mcd_db", "rms_ratio_db")


def evaluate(target: Target, keep: Iterable[str], tol, emulate: bool = True) -> Evaluation:
    """Run the target's step in float16 with `keep` in float32 and judge it by the shippable bar."""
    start = time.perf_counter()
    keep = sorted(keep)
    inputs, fed = fed_inputs(target, keep, emulate)
    outs = as_outputs(target.step, Mixed(target.module, keep, emulate=emulate)(*inputs))
    metrics, audio, durations = {}, {}, {}
    for spec in target.step.outputs:
        n = spec.name
        o, r = target.valid(n, outs[n]), target.valid(n, target.fp64[n])
        e = error_metrics(o, r)
        metrics[n] = {"rel_l2": e["rel_l2"], "nan_rate": e["nan_rate"]}
        if "samples" in spec.axes.values():
            a = audio_metrics(r[0].double().numpy(), o[0].double().numpy())
            audio[n] = a
            metrics[n].update({k: a[k] for k in AUDIO_KEYS})
        if n == "duration":
            durations[n] = (o, r)
    ok, why = shippable(tol, audio, durations)
    bad = 0.0
    for a in audio.values():
        if a.get("nan_rate") or a.get("inf_rate") or math.isnan(a["pesq"]) or math.isnan(a["mcd_db"]):
            bad += 100.0
            continue
        bad += (max(0.0, tol.min_pesq - a["pesq"]) + max(0.0, a["mcd_db"] - tol.max_mcd_db)
                + max(0.0, abs(a["rms_ratio_db"]) - tol.max_level_db))
    for o, r in durations.values():
        o = o.double()
        if not torch.isfinite(o).all():  # worse than every duration rounding differently
            bad += 100.0 + o.numel()
            continue
        rr = lambda x: torch.round(x).clamp(min=1)  # noqa: E731
        bad += float((rr(o) != rr(r.double())).sum())
    if ok is None:  # no audio, no duration: not a search this tool can do
        raise UsageError(f"step {target.step.name!r} has no audio or duration output: nothing to judge as shippable "
                         f"(use decoder, generator or duration)")
    if target.upstream is not None:
        why += f"; fed {fed}"
    return Evaluation(target.case, keep, ok, why, 0.0 if ok else bad, metrics, round(time.perf_counter() - start, 1))


def candidates(audit: list[dict], root: str) -> list[str]:
    """Modules worth trying, worst local float16 error first: not the step itself, not a module
    whose error one of its descendants already explains (>= half of it), not an exact one."""
    rows = [r for r in audit if r["module"] != root and r["local_rel_l2"] > 0]
    out = []
    for r in rows:
        own = r["local_rel_l2"]
        explained = any(d["module"].startswith(r["module"] + ".") and d["local_rel_l2"] >= 0.5 * own for d in rows)
        if not explained:
            out.append(r["module"])
    return out


def block_of(path: str) -> str:
    """The block a module belongs to: the innermost ancestor that is an element of a ModuleList or
    Sequential (`predictor.F0.1.conv1` -> `predictor.F0.1`), else the module itself. A chain kept
    per block reads as a porter's sentence ("the F0 blocks in float32") and skips no inner layer."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return path


def upstream(keep: Iterable[str], audit: list[dict], root: str) -> list[str]:
    """Everything the kept modules read, transitively (the audit's `producers`), lifted to blocks:
    a float32 island fed by a float16 chain gets its input rounded at every link (SineGen integrates
    an F0 that `predictor.shared` -> `F0` -> `F0_proj` -> `f0_upsamp` computes), and keeping one link
    alone changes nothing, so the greedy pass needs the whole chain as one candidate."""
    by_module = {r["module"]: r for r in audit}
    keep = list(keep)
    seen: set[str] = set()
    todo = [p for k in keep for p in by_module.get(k, {}).get("producers", [])]
    while todo:
        p = todo.pop()
        if p in seen or p == root or under(p, keep) or p not in by_module:
            continue
        seen.add(p)
        todo += by_module[p].get("producers", [])
    return _normalize(block_of(p) for p in seen if not any(k.startswith(p + ".") for k in keep))


def _children(module: torch.nn.Module) -> dict[str, list[str]]:
    """Module path -> its children's paths (KModel paths, as keep-lists name them)."""
    out: dict[str, list[str]] = {}
    for path, sub in module.named_modules():
        p = _strip(path)
        out[p] = [f"{p}.{n}" if p else n for n, _ in sub.named_children()]
    return out


def enclosing(keep: Iterable[str], children: Mapping[str, list[str]], root: str) -> list[str]:
    """Parents of two or more kept modules that still run code of their own in float16: the ops of
    a parent's `forward` between its kept children (the Generator's sums, activations and the
    exp/sin before the iSTFT) are on the signal's main path, and no child kept alone covers them.
    Innermost first; a parent whose every child is already kept adds nothing and is left out."""
    keep = list(keep)
    out = []
    for k in keep:
        parts = k.split(".")
        for i in range(len(parts) - 1, 0, -1):
            p = ".".join(parts[:i])
            if p == root or under(p, keep) or p in out:
                continue
            if sum(1 for o in keep if o.startswith(p + ".")) >= 2 and not all(
                    under(c, keep) for c in children.get(p, [])):
                out.append(p)
    return sorted(out, key=lambda p: -p.count("."))


def _normalize(keep: Iterable[str]) -> list[str]:
    """Drop modules inside another kept one."""
    keep = sorted(set(keep))
    return [k for k in keep if not any(k != o and k.startswith(o + ".") for o in keep)]


@dataclass
class SearchResult:
    step: str
    cases: list[str]
    keep: list[str]
    reached: bool  # shippable on every case with `keep`
    before: list[Evaluation]
    after: list[Evaluation]
    audit: list[dict]
    rounds: list[dict] = field(default_factory=list)
    share: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    emulate: bool = True


def search(targets: list[Target], tol, depth: int = 5, top_k: int = 4, max_rounds: int = 8, emulate: bool = True,
           start: Iterable[str] = (), log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """The smallest set of modules to keep in float32 so that every target is shippable: the audit
    ranks the candidates (module alone in float16, local error), a greedy pass adds the candidate of
    most measured benefit to the *cheapest* case not yet shippable (top_k single modules tried per
    round, plus the kept modules' whole upstream chain as one candidate and the innermost parent of
    kept modules that runs code of its own), then a pruning pass drops every module the set no
    longer needs. Cases are evaluated cheapest first and a longer one only once the shorter ones are
    shippable: what fixes 3 s of audio mostly fixes 27 s, at a fifth of the cost of trying it there.
    `start`: a set to search on from (a porter's current set), instead of nothing."""
    return _Search(targets, tol, depth, top_k, emulate, log).run(start, max_rounds)


class _Search:
    """One search's shared state (the kept set, each case's current evaluation, the rankings), a
    method per phase: audit, greedy rounds, pruning."""

    def __init__(self, targets, tol, depth, top_k, emulate, log):
        self.targets, self.tol, self.depth, self.top_k, self.emulate, self.log = targets, tol, depth, top_k, emulate, log
        self.began = time.perf_counter()
        self.root = targets[0].step.module_path
        self.rounds: list[dict] = []
        self.stuck: set[int] = set()  # cases no candidate of their step helps: the search goes on with the others

    def judge(self, i: int, keep) -> Evaluation:
        e = evaluate(self.targets[i], keep, self.tol, self.emulate)
        self.log(f"  {e.case}: keep {e.keep or '-'}: {'SHIPPABLE' if e.shippable else 'not shippable'} "
                 f"({e.why}) [{e.seconds} s]")
        return e

    def run(self, start, max_rounds: int) -> SearchResult:
        targets = self.targets
        self.log(f"float16 everywhere, {len(targets)} case(s):")
        before = [self.judge(i, []) for i in range(len(targets))]
        self.by_cost = sorted(range(len(targets)), key=lambda i: before[i].seconds)  # cheapest first
        self.audit_modules()
        self.keep: list[str] = _normalize(start)
        self.current: list[Evaluation | None] = list(before) if not self.keep else [None] * len(targets)
        while sum(1 for r in self.rounds if r.get("kept")) < max_rounds:
            work = self.next_case()
            if work is None:
                break
            self.round(work)
        self.current = [e if e is not None else self.judge(i, self.keep) for i, e in enumerate(self.current)]
        self.prune()
        audit = sorted((r for rows in self.audits.values() for r in rows), key=_audit_order)
        result = SearchResult(step_label(targets), [t.case for t in targets], self.keep,
                              all(e.shippable for e in self.current), before, self.current, audit, self.rounds,
                              emulate=self.emulate)
        result.share = share_of(self.smallest, self.keep)
        result.seconds = round(time.perf_counter() - self.began, 1)
        return result

    def audit_modules(self) -> None:
        """Per step (two for e2e): each module alone in float16, ranked; a case is helped only by
        modules its step runs."""
        self.smallest = smallest_per_step(self.targets)
        self.audits: dict[str, list[dict]] = {}
        self.ranked: dict[str, list[str]] = {}
        for small in self.smallest:
            self.log(f"audit: each module (<= {self.depth} levels) alone in float16 on its float32 inputs "
                     f"({small.case}, the smallest)")
            self.audits[small.step.name] = module_audit(small.module, small.inputs, self.depth, emulate=self.emulate)
            self.ranked[small.step.name] = candidates(self.audits[small.step.name], small.step.module_path)
            self.log("  candidates: " + ", ".join(self.ranked[small.step.name][:self.top_k * 3]))
        self.tree = {t.step.name: _children(t.module) for t in self.smallest}

    def next_case(self) -> int | None:
        """The cheapest case not shippable with the kept set (judged lazily, cheapest first)."""
        for i in self.by_cost:
            if self.current[i] is None:
                self.current[i] = self.judge(i, self.keep)
            if not self.current[i].shippable and i not in self.stuck:
                return i
        return None

    def options(self, work: int) -> list[tuple[str, ...]]:
        """What a round tries on a case: single modules (those feeding a kept one first: an island's
        input arrives rounded to float16 otherwise; SineGen integrates its F0, so a float16 F0 is a
        frequency error the phase accumulates), the kept modules' whole upstream chain, their
        innermost enclosing module, and for a chained synthesizer the duration stage's best."""
        keep, root, target = self.keep, self.root, self.targets[work]
        in_step = self.audits[target.step.name]
        by_module = {r["module"]: r for r in in_step}
        feeding = [p for k in keep for p in by_module.get(k, {}).get("producers", [])
                   if not under(p, keep) and not any(k.startswith(p + ".") for k in keep) and p != root
                   and p in by_module]
        singles = list(dict.fromkeys([*feeding, *(c for c in self.ranked[target.step.name]
                                                  if not under(c, keep))]))[:self.top_k]
        options = [(c,) for c in singles]
        chain = tuple(upstream(keep, in_step, root))
        if len(chain) > 1 and chain not in options:
            options.append(chain)
        options += [(p,) for p in enclosing(keep, self.tree[target.step.name], root) if (p,) not in options][:1]
        up = target.upstream
        if up is not None:  # a chained synthesizer: `d`'s own error is the duration stage's to fix,
            # by its best candidate or the whole KModel block holding it (ALBERT's float16 error
            # reaches `d` through every layer; no single one of them fixes it)
            best_up = next((c for c in self.ranked.get(up.step.name, []) if not under(c, keep)
                            and (c,) not in options), None)
            if best_up is not None:
                options += [o for o in dict.fromkeys([(best_up,), (best_up.split(".")[0],)])
                            if o not in options and not under(o[0], keep)]
        return options

    def round(self, work: int) -> None:
        """Try the options on the case; keep the best one if it lowers the case's distance."""
        target, current = self.targets[work], self.current[work]
        options = self.options(work)
        if not options:
            self.log(f"  no candidate left for {target.case}")
            self.stuck.add(work)
            return
        label = lambda o: o[0] if len(o) == 1 else "upstream chain [" + ", ".join(o) + "]"  # noqa: E731
        self.log(f"round {len(self.rounds) + 1}: on {target.case} (distance {current.badness:.3f}), trying "
                 + "; ".join(label(o) for o in options))
        tried = {}
        for o in options:
            e = evaluate(target, _normalize([*self.keep, *o]), self.tol, self.emulate)
            tried[o] = e
            self.log(f"  + {label(o)}: distance {e.badness:.3f} ({e.why}) [{e.seconds} s]")
            if e.badness == 0:  # shippable on this case: no other option can do better
                break
        best = min(tried, key=lambda o: (tried[o].badness, len(o)))
        self.rounds.append({"case": target.case, "tried": {",".join(o): e.badness for o, e in tried.items()},
                            "chosen": ",".join(best)})
        if tried[best].badness >= current.badness - 1e-6:
            self.log(f"  no candidate lowers {target.case}'s distance: on with the other cases")
            self.stuck.add(work)
            return
        self.keep = _normalize([*self.keep, *best])
        self.rounds[-1]["kept"] = True
        self.ranked = {name: [c for c in rows if not under(c, self.keep)] for name, rows in self.ranked.items()}
        self.log(f"  keep {label(best)}")
        self.current = [None] * len(self.targets)
        self.current[work] = tried[best]

    def prune(self) -> None:
        """Drop every kept module the set no longer needs (each tried cheapest case first)."""
        if not (all(e.shippable for e in self.current) and len(self.keep) > 1):
            return
        self.log("pruning:")
        for k in list(self.keep):
            trial, evs = [x for x in self.keep if x != k], {}
            for i in self.by_cost:  # cheapest first: a failing trial stops early
                evs[i] = self.judge(i, trial)
                if not evs[i].shippable:
                    break
            if len(evs) == len(self.targets) and all(e.shippable for e in evs.values()):
                self.keep, self.current = trial, [evs[i] for i in range(len(self.targets))]
                self.log(f"  dropped {k}: not needed")


def verify(targets: list[Target], keep: Iterable[str], tol, emulate: bool = True,
           log: Callable[[str], None] = lambda s: None) -> SearchResult:
    """A given float32 set judged on every target, no search: to check a set found on some cases on
    others (en_long), or a set a porter already ships. Before: float16 everywhere."""
    start = time.perf_counter()
    keep = _normalize(keep)
    results = {}
    for label, k in (("float16 everywhere", []), (f"keeping {', '.join(keep) or 'nothing'}", keep)):
        log(f"{label}, {len(targets)} case(s):")
        evs = results[label] = []
        for t in targets:
            e = evaluate(t, k, tol, emulate)
            evs.append(e)
            log(f"  {e.case}: {'SHIPPABLE' if e.shippable else 'not shippable'} ({e.why}) [{e.seconds} s]")
    before, after = results.values()
    result = SearchResult(step_label(targets), [t.case for t in targets], keep, all(e.shippable for e in after),
                          before, after, audit=[], emulate=emulate)
    result.share = share_of(smallest_per_step(targets), keep)
    result.seconds = round(time.perf_counter() - start, 1)
    return result


def smallest_per_step(targets: list[Target]) -> list[Target]:
    """One target per step (two for `e2e`), the one with the fewest input elements: the audit's and
    the FLOP count's input."""
    size = lambda t: sum(x.numel() for x in t.inputs if isinstance(x, torch.Tensor))  # noqa: E731
    by_step: dict[str, Target] = {}
    for t in targets:
        if t.step.name not in by_step or size(t) < size(by_step[t.step.name]):
            by_step[t.step.name] = t
    return list(by_step.values())


def step_label(targets: list[Target]) -> str:
    """`e2e` for the e2e item's two stages, else the step's name (it names the emitted files)."""
    names = {t.step.name for t in targets}
    return "e2e" if names == set(E2E_STAGES) else targets[0].step.name


def share_of(targets: Target | list[Target], keep: list[str]) -> dict[str, Any]:
    """The kept modules' share of the steps' parameters (those of the modules that ran: a step module
    holds the whole KModel) and of their FLOPs (torch.utils.flop_counter: matmuls and convolutions),
    on each step's smallest inputs in float32, summed over the steps."""
    targets = [targets] if isinstance(targets, Target) else targets
    params: dict[str, int] = {}  # KModel path of a parameter -> elements
    total = kept = 0
    for target in targets:
        ran: set[int] = set()
        hook = register_module_forward_hook(lambda m, a, o: ran.add(id(m)))
        counter = FlopCounterMode(display=False)
        try:
            with torch.no_grad(), counter:
                target.module(*target.inputs)
        finally:
            hook.remove()
        for path, sub in target.module.named_modules():
            if id(sub) in ran and _kmodel_path(target.module, path):
                params.update((_strip(f"{path}.{n}"), q.numel()) for n, q in sub.named_parameters(recurse=False))
        counts = counter.get_flop_counts()
        total += sum(counts.get("Global", {}).values())
        # the outermost counted module inside the keep-list: a kept parent whose forward step code
        # skips (F0NStep calls predictor.shared) has no count of its own, its children do
        paths = {_strip(name.split(".", 1)[1]): sum(ops.values()) for name, ops in counts.items() if "." in name}
        kept += sum(n for p, n in paths.items() if under(p, keep) and not any(
            q != p and p.startswith(q + ".") and under(q, keep) for q in paths))
    total_p = sum(params.values())
    kept_p = sum(n for p, n in params.items() if under(p.rsplit(".", 1)[0], keep))
    return {"params": kept_p, "params_total": total_p, "params_share": kept_p / total_p if total_p else 0.0,
            "flops": kept, "flops_total": total, "flops_share": kept / total if total else 0.0}


# ---- emitting the result ------------------------------------------------------------------------

OP_SELECTOR_HEADER = '''"""Core ML float32 islands for Kokoro's {step} (kokoro-parity precision, {date}).

Keep these modules in float32 and the rest in float16 with coremltools' FP16ComputePrecision:

    import coremltools as ct
    from keep_fp32_op_selector import KEEP_FP32, op_selector_for

    program = ...  # the torch.export program of the step (module paths as in KModel: decoder.generator...)
    selector, n_kept = op_selector_for(program, KEEP_FP32)
    mlmodel = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17,
                         compute_precision=ct.transform.FP16ComputePrecision(op_selector=selector))

`op_selector_for` tags each FX node with a debug handle, which coremltools carries into each MIL op's
EXIR_DEBUG_HANDLE scope; an op from a node inside a kept module stays float32.
"""
KEEP_FP32 = {keep!r}


'''


def write_keep_list(result: SearchResult, out_dir: Path) -> dict[str, Path]:
    """The keep-list JSON (for $KOKORO_PARITY_KEEP_FP32: the fp16 and coreml-fp16 backends) and a
    standalone Core ML op_selector file."""
    out_dir = Path(out_dir)
    data = {"schema": KEEP_SCHEMA, "step": result.step, "cases": result.cases, "keep_fp32": result.keep,
            "with_patch": patches_for(result.keep),  # the patches the backend's program needs for these modules
            "reached": result.reached, "share": result.share, "emulated_float16": result.emulate,
            "before": [e.__dict__ for e in result.before], "after": [e.__dict__ for e in result.after]}
    paths = {"keep_list": out_dir / f"keep_fp32-{result.step}.json",
             "op_selector": out_dir / f"keep_fp32_op_selector-{result.step}.py"}
    atomic_write_json(paths["keep_list"], data)
    src = (OP_SELECTOR_HEADER.format(step=result.step, date=time.strftime("%Y-%m-%d"), keep=result.keep)
           + inspect.getsource(node_module_path) + "\n\n" + inspect.getsource(island_nodes) + "\n\n"
           + inspect.getsource(op_selector_for))
    atomic_write_text(paths["op_selector"], src)
    return paths
