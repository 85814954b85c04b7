"""Bisection: from a failing item to the first diverging module and op, and a standalone repro.

Everything happens on the step's exported graph, in one name space (`graph`). A probe (`probe`)
carves a subprogram out of it, compiles and runs it on the backend through the item's jobs and
cache, and judges each output against the same subprogram's fp32 and fp64 values.

- Module stage: the step's modules (`depth` levels below the step's module) in completion order.
  The cut after module k outputs every value still live there, from the step's own inputs, so an
  error made anywhere before is seen at it; a binary search (`search.first_failing`) finds the
  first module whose cut diverges, in log2(modules) probes.
- Op stage: the same search over the float ops between the previous module's cut and that one.
- Local or accumulated: the op alone on exact inputs. If that passes, the error is accumulated,
  and the shortest window ending at the op that still fails is the repro.
- A band (`band_from`): the same probes run on a build of the backend known to be right (the
  previous runtime version, the build without your change), and a value counts as diverging only
  where the backend also leaves that build's value by more than the rule allows against float64:
  the runtime's own legitimate deviation (XNNPACK's float cumsum in SineGen, 4x its floor) is then
  not where a defect starts.
- A probe that cannot compile or run, while the item's whole program could, has no answer: the
  search steps past it and never names it; it is kept as a finding (`probe_failures`). When the
  item itself did not compile or run, a probe that does not compile or run is the failure being
  localized: the search then finds the smallest subgraph that still fails to convert.
"""
from __future__ import annotations

import math
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .. import progress
from ..backends import get_backend
from ..metrics.tensor import error_metrics
from ..plumbing.jobs import Limits, first_error_line
from ..programs import ensure_program
from ..record import Bisection
from ..steps import get_step
from ..verdict import comparator
from .graph import (BisectError, StepGraph, evaluate, is_float, is_tensor, module_boundaries, module_path,
                    restore_names, source_line, strip_kmodel)
from .probe import BISECT_VERSION, Probe, key_metrics, probe_worker, run_probe
from .search import first_failing

__all__ = ["BISECTABLE", "BisectError", "Bisector", "StepGraph", "bisect_item", "evaluate", "module_path",
           "restore_names"]

BISECTABLE = ("fail", "run_error", "crashed", "compile_error")
ERRORS = ("run_error", "crashed", "compile_error")  # item verdicts whose probes localize an error, not a value
TAP_BYTES = 1 << 30  # the tapped values one compiled probe may return
JUMP = 100.0  # an error that grows this much at one value is a defect there, not noise carried along
SKIP_MODULE_TYPES = ("torch.nn.modules.activation.", "torch.nn.modules.dropout.",
                     "torch.nn.modules.linear.Identity")


@dataclass
class ModuleCut:
    """One probed module cut: the module, the probe's status, the cut's last node, its worst output."""

    module: str
    type: str
    status: str
    cut: str
    n_ops: int
    why: str
    metrics: dict[str, float] = field(default_factory=dict)

    def row(self) -> dict:
        """The record's row (flat, as the tables and the dashboard read it)."""
        return {"module": self.module, "type": self.type, "status": self.status, "cut": self.cut,
                "n_ops": self.n_ops, "why": self.why, **self.metrics}


class Bisector:
    """One item's localization: module stage, op stage, local/accumulated, repro bundle.

    Works on a program file and its inputs, so tests can bisect a program they exported
    themselves; `for_item` builds one from a runner Session and an Item."""

    def __init__(self, program_path: Path, program_key: str, inputs: list, backend: str, tol, step: str,
                 report_dir: Path, item_id: str, limits=None, depth: int = 2,
                 log: Callable[[str], None] | None = None, errors_count: bool = False,
                 band_from: str | None = None, page=None):
        self.program_key, self.item_id, self.depth, self.errors_count = program_key, item_id, depth, errors_count
        self.log = log or (lambda msg: None)
        self.backend = get_backend(backend)
        self.step = get_step(step)
        self.tol = tol
        self.check = comparator(tol)
        self.limits = limits or Limits()
        self.report_dir = Path(report_dir)
        self.graph = StepGraph(Path(program_path), list(inputs))
        self.graph.program_key = program_key
        self.counts: Counter = Counter()
        self.probes: list[Probe] = []
        self.run_root = self.report_dir / "runs" / item_id / "bisect"
        self.persisting: list[str] | None = None  # values whose error reaches the output (tapped module stage)
        self.tapped: Probe | None = None  # the module stage's tapped run, whose values feed the op stage
        self.band = get_backend(band_from) if band_from else None  # what this backend does when right
        self.band_result: dict | None = None
        self.band_values: dict = {}
        self.page = page  # the browser target (a page on the user's device) the item ran on: probes run there

    @classmethod
    def for_item(cls, session, item, depth: int = 2, log=None, verdict: str = "fail",
                 band_from: str | None = None) -> "Bisector":
        """The item's own program: the same key and cache entry as the runner's (programs.ensure_program)."""
        backend = get_backend(item.backend)
        inputs = session.traces(item.case).inputs(item.step, item.mode, "float32")
        entry, key, result = ensure_program(session.weights, session.model.digest, item.step, inputs,
                                            session.patches_for(backend), session.limits.export_s, session.counts)
        if result is not None and not result.ok:
            raise BisectError(f"the step does not export: {result.error}")
        place = session.target_for(item.target) if getattr(item, "target", "local") != "local" else None
        return cls(entry / "program.pt2", key, list(inputs.values()), item.backend,
                   session.profile.for_(item.step, item.backend, item.mode), item.step, session.report_dir,
                   item.id, session.limits, depth, log, errors_count=verdict in ERRORS, band_from=band_from,
                   page=place if place is not None and place.kind == "browser" else None)

    # -- one probe ------------------------------------------------------------------------
    def probe(self, phase: str, label: str, outputs: list[str], stop=(), feed: dict | None = None,
              keep: bool = False, backend=None) -> Probe:
        """Run one probe (`probe.run_probe`); its output values are kept only with `keep`."""
        with progress.phase(f"bisecting ({phase} probe {len(self.probes) + 1}: {label})"):
            p = run_probe(self.graph, backend or self.backend, self.check, self.limits,
                          self.run_root / backend.name if backend else self.run_root, phase, label, outputs, stop, feed)
        if not keep:
            p.values = {}
        compiled = p.compile == "miss"
        self.counts["compiles" if compiled else "compile_hits"] += 1
        self.counts[f"{phase}_compiles"] += compiled
        self.counts["runs"] += p.ran
        self.probes.append(p)
        self.log(f"  {phase:7s} {label:40s} {p.n_ops:5d} ops  {p.status:13s} compile {p.compile}  {p.why[:90]}")
        return p

    def diverges(self, p: Probe) -> bool | None:
        return p.diverges(self.errors_count)

    # -- cuts -----------------------------------------------------------------------------
    def float_ops(self, region: set[str] | None = None) -> list:
        """The candidate cuts: float ops; when localizing an error, every op with a tensor value (an
        integer `aten.alias` may be what a converter lacks: ALBERT's position_ids)."""
        keep = is_tensor if self.errors_count else is_float
        return [n for n in self.graph.nodes if n.op == "call_function" and keep(n)
                and (region is None or n.name in region)]

    def live_at(self, cands: list, i: int, keep: set[str], outputs: list[str]) -> list[str]:
        """cands[i] and every earlier candidate still used after it (or an output of the region)."""
        pos = self.graph.pos
        cut = pos[cands[i].name]
        out = []
        for c in cands[:i + 1]:
            later = [pos[u.name] for u in c.users if u.name in keep]
            if c is cands[i] or c.name in outputs or any(u.name not in keep for u in c.users) \
                    or max(later, default=-1) > cut:
                out.append(c.name)
        return out

    # -- module stage ---------------------------------------------------------------------
    def modules(self) -> list[dict]:
        """Modules `depth` levels below the step's module(s), with their boundary, in completion order."""
        return module_boundaries(self.graph, {"kmodel." + p for p in self.step.module_path.split("+")}, self.depth,
                                 SKIP_MODULE_TYPES)

    def can_tap(self, names) -> bool:
        """Whether one program may return all these values: the backend runs here, the search is
        about values (not about what does not compile), and they fit TAP_BYTES."""
        return (not self.errors_count and self.backend.runnable()[0]
                and sum(self.graph.nbytes(n) for n in names) <= TAP_BYTES)

    def module_stage(self) -> tuple[dict | None, list[dict], list]:
        """(first diverging module, the module table, float ops after the cut before it).

        One compiled program returns every module's outputs (from the step's own inputs, so each
        carries everything before it); the first module whose error persists to the step's output
        (`StepGraph.persisting`) is the divergence. When those values do not fit one program, or
        it does not compile or run, a binary search over the module cuts (`by_cuts`)."""
        mods = self.modules()
        keep, _ = self.graph.closure(self.graph.outputs, [])
        cands = self.float_ops(keep)
        index = {c.name: i for i, c in enumerate(cands)}
        cuts = []  # (candidate index of the module's last float output, module), one per distinct cut
        for m in mods:
            i = index.get(m["last"])
            if i is not None and (not cuts or cuts[-1][0] != i):
                cuts.append((i, m))
        # every float value live at some module's cut: the modules' outputs and what crosses them,
        # so the op stage can feed a module's ops the backend's own values of everything before
        taps = list(dict.fromkeys([*(t for i, _ in cuts for t in self.live_at(cands, i, keep, self.graph.outputs)),
                                   *(o for o in self.graph.outputs if o in index)]))
        taps.sort(key=self.graph.pos.__getitem__)
        p = self.probe("module", f"{len(cuts)} modules, {len(taps)} values", taps, keep=True) \
            if self.can_tap(taps) else None
        if p is None or not p.ran:
            return self.by_cuts(cuts, cands, keep)
        self.tapped = p
        failing = set(p.failing) if self.band is None else self.beyond_band(p, taps)
        self.persisting = self.graph.persisting(taps, failing, failing & set(self.graph.outputs))
        origin = self.origin(self.persisting, taps, p)
        table = []
        for i, m in cuts:
            own = [o for o in m["outputs"] if o in p.metrics or o in failing]
            worst = max((p.metrics[o] for o in own if o in p.metrics), key=lambda x: _num(x.get("floor_ratio")),
                        default={})
            whys = [w for w in p.why.split("; ") if w.split(":")[0] in own]
            carried = set(own) & set(self.persisting)
            status = "fail" if carried and i >= index.get(origin, len(cands)) else "pass"
            why = _module_why(status, whys, carried, self.band.name if whys and not failing & set(own) and self.band
                              else None)
            table.append(ModuleCut(strip_kmodel(m["path"]), m["type"].rsplit(".", 1)[-1], status, cands[i].name,
                                   i + 1, why, dict(worst)).row())
        if not self.persisting:
            return None, table, cands
        first = index[origin]
        j = next((j for j, (i, _) in enumerate(cuts) if i >= first), None)
        if j is None:  # after the last module: the step's own ops at its end
            return None, table, cands[(cuts[-1][0] + 1 if cuts else 0):]
        return cuts[j][1], table, cands[(cuts[j - 1][0] + 1 if j > 0 else 0):cuts[j][0] + 1]

    def beyond_band(self, p: Probe, outputs: list[str], stop=()) -> set[str]:
        """The values of probe p that fail the rule *and* leave the band backend's own value there
        by more than the rule allows against float64 (its floor multiple, or its tolerance): the
        band's value stands in for float64, fp32 eager's error stays the floor. The band runs the
        same probe (an op-stage region fed the band's own module-stage values, as p is fed the
        backend's). Each value's `band_rel_l2` (distance to the band's value) and
        `band_own_rel_l2` (the band's own error) go into p's metrics. Without a band run, the
        rule alone."""
        first = self.band_result is None
        b = self.probe("band", f"{self.band.name}: {p.label}", outputs, stop, feed=self.band_values if stop else None,
                       keep=True, backend=self.band)
        if first:
            self.band_result = {"backend": self.band.name, "status": b.status, "within_band": [],
                                **({"why": b.why} if not b.ran else {})}
        if not b.ran:
            self.log(f"  the band backend {self.band.name} did not run ({b.status}): judged by the rule alone")
            return set(p.failing)
        kept = set()
        for t in outputs:
            got, ref = p.values.get(t), b.values.get(t)
            comparable = got is not None and ref is not None and tuple(got.shape) == tuple(ref.shape) \
                and t in p.metrics
            if comparable:
                m = error_metrics(got, ref)
                m["floor_rel_l2"] = p.metrics[t].get("floor_rel_l2", math.nan)
                p.metrics[t]["band_rel_l2"] = m["rel_l2"]
                p.metrics[t]["band_own_rel_l2"] = b.metrics.get(t, {}).get("rel_l2", math.nan)
            if t not in p.failing:
                continue
            if comparable and self.check(m)[0]:
                self.band_result["within_band"].append(t)
            else:
                kept.add(t)
        if first:
            self.band_values = b.values  # fed to the band's op-stage probe
        return kept

    def origin(self, persisting: list[str], taps: list[str], p: Probe) -> str | None:
        """Where the persisting error starts: the first value whose error jumps JUMP-fold over its
        inputs' (a NaN, a sign flip, a wrong kernel), else the first persisting value (an error
        that accumulates). A backend's noise beyond the rule upstream of a real defect (SineGen on
        XNNPACK, 4x its floor) is carried into the chain but does not start it."""
        return (self.jump(persisting, taps, p) or persisting[0]) if persisting else None

    def jump(self, persisting: list[str], taps: list[str], p: Probe) -> str | None:
        """The first persisting value whose error jumps JUMP-fold over its inputs', if any."""
        metrics = p.metrics
        if self.tapped is not None and p is not self.tapped:  # the op stage: its inputs' errors are the module stage's
            metrics = {**self.tapped.metrics, **p.metrics}
            taps = list(dict.fromkeys([*taps, *self.tapped.metrics]))
        jumps = self.graph.jumps(taps, metrics)
        return next((t for t in persisting if jumps.get(t, 1.0) >= JUMP), None)

    def by_cuts(self, cuts: list, cands: list, keep: set[str]) -> tuple[dict | None, list[dict], list]:
        """The module stage as a binary search: the cut after module k outputs every value still
        live there, so an error made anywhere before is seen at it."""
        rows = {}

        def fails(j: int) -> bool | None:
            i, m = cuts[j]
            p = self.probe("module", strip_kmodel(m["path"]), self.live_at(cands, i, keep, self.graph.outputs))
            worst = max(p.metrics.values(), key=lambda x: _num(x.get("floor_ratio")), default={})
            rows[j] = ModuleCut(strip_kmodel(m["path"]), m["type"].rsplit(".", 1)[-1], p.status, cands[i].name,
                                i + 1, p.why, dict(worst))
            return self.diverges(p)

        found = first_failing(len(cuts), fails)
        table = [rows[j].row() for j in sorted(rows)]
        if found.index is None:
            return None, table, cands
        lo = cuts[found.index - 1][0] + 1 if found.index > 0 else 0
        return cuts[found.index][1], table, cands[lo:cuts[found.index][0] + 1]

    # -- op stage -------------------------------------------------------------------------
    def op_stage(self, region: list | None = None) -> dict | None:
        """The first diverging float op of `region` (default: all): one program returning every op
        of the region, judged like the module stage (an error that persists to the values the
        module stage found persisting); else a binary search over prefix cuts."""
        graph = self.graph
        keep, _ = graph.closure(graph.outputs, [])
        cands = self.float_ops(keep)
        if not cands:
            return None
        names = [c.name for c in (region or cands)]
        ends = set(names) & set(self.persisting) if self.persisting is not None else set(names) & set(graph.outputs)
        if ends and self.can_tap(names):
            label = f"{len(names)} ops {names[0]}..{names[-1]}"
            before = []  # without a tapped module stage, the region's values from the step's inputs
            if self.tapped is not None:  # the region alone, fed what the backend computed before it
                before = [n.name for n in graph.nodes if graph.pos[n.name] < graph.pos[names[0]] and n.op != "get_attr"]
            p = self.probe("bisect", label, names, before, feed=self.tapped.values if self.tapped else None,
                           keep=self.band is not None)
            if p.ran:
                failing = set(p.failing) if self.band is None else self.beyond_band(p, names, before)
                found = graph.persisting(names, failing, ends & failing)
                if not found:
                    return {"n_nodes": len(names), "localized": False}
                k = graph.node[self.origin(found, names, p)]
                return self.named(k, cands, p, p, None, None, len(names))
        index = {c.name: i for i, c in enumerate(cands)}
        probes: dict[int, Probe] = {}

        def fails(j: int) -> bool | None:
            i = index[names[j]]
            probes[j] = self.probe("bisect", names[j], self.live_at(cands, i, keep, graph.outputs))
            return self.diverges(probes[j])

        found = first_failing(len(names), fails)
        if found.index is None:
            return {"n_nodes": len(names), "localized": False}
        before = next((probes[j] for j in range(found.index - 1, -1, -1) if j in probes and probes[j].ran), None)
        uncertain = found.uncertain_from
        return self.named(graph.node[names[found.index]], cands, probes[found.index], before,
                          names[found.index - 1] if found.index > 0 else None,
                          names[uncertain] if uncertain is not None else None, len(names))

    def named(self, k, cands: list, after: Probe, before_probe: Probe | None, previous: str | None,
              uncertain_from: str | None, n_nodes: int) -> dict:
        """The op stage's answer for op k: its inputs' errors, the op alone on exact inputs (local
        or accumulated), and the repro's window."""
        before = {}
        for a in k.all_input_nodes:
            if a.op == "placeholder":
                before[a.name] = "exact (reference input)"
            elif before_probe is not None and a.name in before_probe.metrics:
                before[a.name] = before_probe.metrics[a.name]
        local = self.probe("local", k.name, [k.name], [a.name for a in k.all_input_nodes if a.op != "get_attr"])
        window = local if self.diverges(local) else self.window(k, cands)
        return {"n_nodes": n_nodes, "localized": True, "node": k, "after": after, "before": before,
                "kind": _kind(self.diverges(local)), "local": local, "window": window,
                "previous": previous, "uncertain_from": uncertain_from}

    def window(self, k, cands: list) -> Probe:
        """Accumulated: the shortest window ending at k that still fails (the latest start)."""
        graph = self.graph
        ancestors, _ = graph.closure([k.name], [])
        starts = [c for c in cands if c.name in ancestors and graph.pos[c.name] <= graph.pos[k.name]]
        probes: dict[int, Probe] = {}

        def fails(j: int) -> bool | None:  # j = 0: the op alone; larger j: longer windows
            s = starts[len(starts) - 1 - j]
            early = [a for a in ancestors if graph.pos[a] < graph.pos[s.name]]
            probes[j] = self.probe("window", f"{s.name}..{k.name}", [k.name], early)
            return self.diverges(probes[j])

        found = first_failing(len(starts), fails)
        return probes[found.index] if found.index is not None else probes[max(probes)]

    # -- the whole localization -----------------------------------------------------------
    def run(self, repro: bool = True, verify: bool = True) -> dict:
        with probe_worker(self.page):  # every probe's compile and run in one process, its imports paid once
            return self._run(repro, verify)

    def _run(self, repro: bool, verify: bool) -> dict:
        start = time.monotonic()
        out: dict[str, Any] = {"version": BISECT_VERSION, "backend": self.backend.name, "depth": self.depth,
                               "searching": "errors" if self.errors_count else "values"}
        first, table, region = self.module_stage() if self.depth > 0 else (None, [], None)
        out["modules"] = table
        if self.band_result is not None:
            out["band"] = self.band_result
        out["module_compiles"] = self.counts["module_compiles"]
        if self.page is not None:  # every probe of the item's backend ran on the device's page
            out["ran_on"] = self.page.describe()
            self.log(f"the probes ran on target {self.page.name!r}: the page on the user's device "
                     f"({(self.page.device.seen or {}).get('user_agent', '?')})")
        out["first_module"] = strip_kmodel(first["path"]) if first else None
        out["region"] = f"module {out['first_module']}" if first else f"step {self.step.name}"
        self.log(f"op-level bisection in {out['region']}")
        if self.persisting == []:  # every module's values computed in one program: none persists
            op = {"n_nodes": len(region), "localized": False}
        else:
            op = self.op_stage(region)
        out["n_nodes"] = op["n_nodes"] if op else 0
        out["n_graph_ops"] = sum(1 for n in self.graph.nodes if n.op == "call_function")
        out["bisect_compiles"] = sum(1 for p in self.probes if p.phase == "bisect")
        out["probe_failures"] = [p.summary() for p in self.probes if not p.ran and not self.errors_count]
        if not op or not op["localized"]:
            out["status"] = "not_localized"
            out["message"] = (f"no value of {out['region']} on {self.backend.name} carries an error to the step's output "
                              f"(values beyond the rule are absorbed downstream, see the module table): the failure "
                              f"is not in a node's value (a shape, the valid region, or a crash of the whole program?)"
                              if self.persisting == [] else
                              f"every probe of {out['region']} passes on {self.backend.name}: the failure is not in "
                              f"a node's value (a shape, the valid region, or a crash of the whole program?)")
        else:
            out.update(localized(op))
            if repro:
                from ..repro import write_bundle  # cycle: repro imports harness.bisect.graph, so this package

                out["repro"] = write_bundle(self, op, verify=verify)
        out["compiles"] = self.counts["compiles"]
        out["compile_hits"] = self.counts["compile_hits"]
        out["runs"] = self.counts["runs"]
        out["probes"] = [p.summary() for p in self.probes]
        out["seconds"] = round(time.monotonic() - start, 1)
        return out


def localized(op: dict) -> dict:
    """The result fields of a localized op: first_op, message, window."""
    k, after = op["node"], op["after"]
    local = op["local"]
    first_op = {
        "node": k.name, "op": str(k.target), "module": module_path(k), "source": source_line(k),
        "kind": op["kind"], "status": "fail" if k.name in after.failing else after.status,
        "why": next((w for w in after.why.split("; ") if w.startswith(k.name + ":")), after.why),
        "after": after.metrics.get(k.name, {}), "before": op["before"], "previous_node": op["previous"],
        "local": {"status": local.status, **key_metrics(local.metrics.get(k.name, {}))}}
    if op["uncertain_from"]:
        first_op["uncertain_from"] = op["uncertain_from"]
    message = f"first diverging op {k.name} ({k.target}, {op['kind']}) in {module_path(k)} at {source_line(k)}"
    if op["uncertain_from"]:
        message += f" (or from {op['uncertain_from']} on: the probes before it could not run)"
    return {"status": "localized", "first_op": first_op, "message": message,
            "window": {"label": op["window"].label, "n_ops": op["window"].n_ops, "status": op["window"].status}}


def _module_why(status: str, whys: list[str], carried: set, band: str | None) -> str:
    """Why a module reads as it does; a PASS beyond the rule says where its error went."""
    if status == "fail" or not whys:
        return "; ".join(whys)
    where = ("carried into a larger error downstream" if carried else
             f"as {band} does when right (the band)" if band else "absorbed downstream")
    return f"beyond the rule here, {where}: " + "; ".join(whys)


def _kind(local_diverges: bool | None) -> str:
    return {True: "local", False: "accumulated", None: "undetermined"}[local_diverges]


def _num(v) -> float:
    return v if isinstance(v, (int, float)) and not math.isnan(v) else math.inf if v is not None else 0.0


# ---- entry point ----------------------------------------------------------------------------

def bisect_item(session, item, record=None, depth: int = 2, repro: bool = True, verify: bool = True,
                log: Callable[[str], None] | None = None, band_from: str | None = None) -> Bisection:
    """Localize one item; the result goes into `record.bisect` (rewritten) when given. `band_from`:
    a backend that is right where this one fails (see Bisector.beyond_band)."""
    verdict = record.verdict.value if record is not None else "fail"
    try:
        result = Bisection(**Bisector.for_item(session, item, depth=depth, log=log, verdict=verdict,
                                               band_from=band_from).run(repro=repro, verify=verify))
    except Exception as e:  # noqa: BLE001 - a bisection that cannot run is reported, not raised
        result = Bisection(status="error", message=first_error_line(e), traceback=traceback.format_exc()[-4000:])
    if record is not None:
        record.bisect = result
        record.write(Path(session.report_dir) / "records")
    return result
