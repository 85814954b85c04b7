"""A rewrite as an item of the pipeline (`--rewrite NAME|ADAPTER.py`): its mapped modules judged
locally, one row each, then its own tokens -> audio against the noise band.

Local: each module is fed the float64 reference's inputs at its boundary (cast to float32, in
the rewrite's layout by the adapter) and its output is judged against the float64 reference with
torch float32's own error on the same inputs as the floor (harness.rewrite.captures). The rows
are the port table's (`rec.stages`, printed by `report.port_lines`); the reason names the first
module, in the order their forward passes end (innermost first), whose local error leaves its
floor, with the kind of difference (harness.port.differences), and writes that module's repro
bundle (harness.rewrite.repro); where the adapter maps sub-callables of that module (its inverse
STFT), the first of them that leaves its floor is named inside it. Then the rewrite's own pipeline
(its own noise, its own durations) is judged like a whole-model artifact: durations exactly, the
audio against the spread the reference's audio has over noise seeds.
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import torch

from .. import progress
from ..metrics.tensor import compare_to_floor, error_metrics
from ..patches import NOISE_INPUTS
from ..plumbing import stopping
from ..port.differences import difference_kind, nonfinite
from ..port.tensors import reference as reference_tensor
from ..record import NoiseBand, Record, Rewrite, StageRow, item_id, versions
from ..verdict import Verdict, band_comparator, comparator
from .adapter import Adapter, Mapped
from .captures import cast32, module_io, reference_models
from .repro import write_rewrite_repro
from ..metrics.audio import audio_metrics
from ..port.noise import DIRECTIONS, noise_band, session_k


@dataclass(frozen=True)
class RewriteItem:
    """(case, rewrite): id `case-rewrite:<name>-<name>-dynamic`, selectable with -k."""

    case: str
    spec: str  # `mlx-audio` or an adapter file
    adapter: Adapter | None = None
    mapped: tuple[Mapped, ...] = ()
    error: str = ""  # an adapter that failed validation: the item reports it
    mode: str = "dynamic"

    @property
    def name(self) -> str:
        return self.adapter.name if self.adapter is not None else self.spec

    @property
    def step(self) -> str:
        return f"rewrite:{self.name}"

    @property
    def backend(self) -> str:
        return self.name

    @property
    def id(self) -> str:
        return item_id(self.case, self.step, self.backend, self.mode)

    # harness.pipeline: how this kind of item runs; its module table is its localization
    def run(self, session):
        return run_rewrite_item(session, self)

    def localizable(self, record, how) -> bool:
        return False

    def localize(self, session, record, how, log) -> None:
        return None


def run_rewrite_item(session, item: RewriteItem) -> Record:
    rec = Record(item.case, item.step, item.backend, item.mode, Verdict.SKIPPED,
                 model={"name": session.model.name, "digest": session.model.digest, "source": session.model.source})
    rec.versions = {**versions(None), **rewrite_versions()}
    if item.error:
        rec.verdict, rec.reason = Verdict.RUN_ERROR, item.error
        return session.finish(rec)
    missing = item.adapter.missing()
    if missing:
        rec.reason = missing
        return session.finish(rec)
    try:
        model = item.adapter.load(session.model.kmodel)
    except Exception as e:  # noqa: BLE001 - the rewrite's own loader: its error, named
        rec.verdict, rec.reason = Verdict.RUN_ERROR, f"{item.spec}: loading the checkpoint: {type(e).__name__}: {e}"
        return session.finish(rec)
    rec.audit["rewrite"] = {"adapter": item.spec, "modules": {m.path: m.convention for m in item.mapped},
                            "load_notes": list(getattr(model, "load_notes", []))}
    tol = session.profile.for_("rewrite", item.backend, item.mode)
    traces = session.traces(item.case)
    try:
        defects = judge_modules(session, item, model, traces, tol, rec)
        failures = [f"{path}: {m['why']}; {m['kind']}" for path, m in defects]
        failures += judge_pipeline(session, item, model, traces, tol, rec)
    except BaseException as e:  # a stop signal, Ctrl-C or a defect: the rows so far are kept, and it goes on
        rec.verdict = Verdict.RUN_ERROR
        rec.reason = f"stopped after {len(rec.stages)} of {len(item.mapped)} modules: {stopping.cause(e)}"
        session.finish(rec)
        raise
    if failures:
        first = first_defect(item, defects)
        rec.verdict, rec.reason = Verdict.FAIL, first + "; ".join(failures)
    else:
        rec.verdict, rec.reason = Verdict.PASS, f"{len(rec.stages)} modules within their floor" + \
            "".join(f"; {k}: {v.why}" for k, v in rec.bands.items() if isinstance(v, NoiseBand))
    return session.finish(rec)


def first_defect(item: RewriteItem, defects: list[tuple[str, dict]]) -> str:
    """The reason's head: the first module (not sub-callable) that leaves its floor, in the order
    forward passes end, and inside it the first of its sub-callables that does."""
    if not defects:
        return ""
    inside = {m.path: m.inside for m in item.mapped if m.inside}
    modules = [d for d in defects if d[0] not in inside] or defects
    path, m = modules[0]
    text = f"first module whose local error leaves its floor: {path!r} ({m['kind']})"
    held = [(p, c) for p, c in defects if p in inside and (inside[p] == path or inside[p].startswith(path + "."))]
    if held:
        text += f"; inside it: {held[0][0]!r} ({held[0][1]['kind']})"
    return text + "; "


def judge_modules(session, item: RewriteItem, model, traces, tol, rec) -> list[tuple[str, dict]]:
    """One row per mapped module (`rec.stages`), judged locally as soon as its reference run
    captured it, with the rewrite's own chain's value beside it (`chained`, not judged: the
    pipeline judges the chain end to end); the modules whose error leaves the floor, in the order
    their forward passes end."""
    conventions = {m.path: m.convention for m in item.mapped}
    inside = {m.path: m.inside for m in item.mapped if m.inside}
    km32, km64 = reference_models(session.model.kmodel)
    defects = []
    keep_so_far(session, rec, len(conventions))  # the rewrite's own chain runs first, and can be long
    with tempfile.TemporaryDirectory(prefix="kokoro-parity-chain-") as where:
        modules = {p: c for p, c in conventions.items() if p not in inside}  # the chain saves modules' outputs
        chain, why = rewrite_chain(session, item, model, traces, modules, Path(where))
        if why:
            rec.audit["rewrite"]["chain"] = why

        def judge(io) -> None:
            shown.update(f"{len(rec.stages) + 1} of {len(conventions)}: {io.path}")
            m, seconds = judge_one(item, model, conventions[io.path], io, tol)
            ch = chained_metrics(chain.get(io.path), io, why or ("a sub-callable: judged locally only"
                                                                 if io.path in inside else ""))
            rec.stages.append(StageRow(stage=io.path, artifact=conventions[io.path], precision="float32", run_s=seconds,
                                       local_ok=m["ok"], chained_ok=True, outputs={"out": {"local": m, "chained": ch}},
                                       **({"inside": inside[io.path]} if io.path in inside else {})))
            if not m["ok"] and io.path not in inside and not isinstance(rec.bisect, Rewrite):
                # the first failing module: its bundle, while its captures are here
                rec.bisect = Rewrite(module=io.path, **first_repro(session, item, model, conventions[io.path], io, m, tol))
            if not m["ok"]:
                defects.append((io.path, m))
            keep_so_far(session, rec, len(conventions))

        with progress.phase(f"{item.name}: its modules, each on the reference's inputs") as shown:
            rec.audit["rewrite"]["peak_capture_bytes"] = module_io(km32, km64, traces, list(conventions), judge)
    return defects


def keep_so_far(session, rec: Record, modules: int) -> None:
    """The record as it stands, written after each module (atomically): a run killed before its
    end (SIGKILL, out of memory) leaves the rows it judged; the finished run's record replaces it."""
    rec.verdict = Verdict.RUN_ERROR
    rec.reason = f"incomplete: {len(rec.stages)} of {modules} modules judged so far (still running, or killed)"
    rec.write(session.report_dir / "records")


def rewrite_chain(session, item: RewriteItem, model, traces, conventions: dict, where: Path) -> tuple[dict, str]:
    """The rewrite's own tokens -> audio, run once with Kokoro's noise: each mapped module's output
    in a file of `where` (memory holds none of them), and why the chain is missing or stopped."""
    case = session.cases[item.case]
    noise = {k: v.float() for k, v in traces.inputs("decoder", "dynamic", "float64").items() if k in NOISE_INPUTS}
    files: dict[str, Path] = {}

    def save(path: str, value: np.ndarray) -> None:
        files[path] = where / f"{len(files)}.npy"
        np.save(files[path], value)

    try:
        with progress.phase(f"{item.name}: its own chain, tokens to audio"):
            ran = item.adapter.chained(model, case.phonemes, reference_tensor("ref_s", traces), case.speed, noise,
                                       conventions, save)
    except Exception as e:  # noqa: BLE001 - the rewrite's own chain: its error, said; the modules it reached stand
        return files, f"the rewrite's own chain raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return files, "" if ran else "the adapter runs no chain of its own (`Adapter.chained`)"


def chained_metrics(saved: Path | None, io, why: str) -> dict:
    """The rewrite's own chain's value of a module against the float64 reference's (not judged)."""
    if saved is None:
        return {"why": why or "the rewrite's own chain did not call it"}
    value = torch.from_numpy(np.load(saved))
    if tuple(value.shape) != tuple(io.out64.shape):
        return {"why": f"shape {list(value.shape)} != reference {list(io.out64.shape)}"}
    m = error_metrics(value.double(), io.out64)
    m["kind"] = difference_kind(value, io.out64)
    return m


def first_repro(session, item: RewriteItem, model, convention: str, io, m: dict, tol) -> dict:
    """The repro bundle of the first failing module, <report-dir>/repro/<item>/: {"repro": its
    path}, or {"repro_error": why it could not be written} (`repro` is always a path: the
    dashboard links it)."""
    out = session.report_dir / "repro" / item.id
    try:
        write_rewrite_repro(out, item.adapter, model, convention, io, m, tol)
    except Exception as e:  # noqa: BLE001 - the bundle is a by-product: its failure is said, the row stands
        return {"repro_error": f"not written: {type(e).__name__}: {e}"}
    return {"repro": str(out)}


def judge_one(item: RewriteItem, model, convention: str, io, tol) -> tuple[dict, float]:
    """The rewrite's counterpart of one module on its captured inputs cast to float32, judged
    against the float64 output and the float32 floor; the seconds it ran."""
    args = tuple(cast32(v) for v in io.args)
    kwargs = {k: cast32(v) for k, v in io.kwargs.items()}
    start = time.perf_counter()
    try:
        with item.adapter.noise({k: v.float() for k, v in io.noise.items()}):
            value = item.adapter.run(model, io.path, convention, args, kwargs)
        seconds = time.perf_counter() - start
        return judge_local(value, io.out32, io.out64, tol), seconds
    except Exception as e:  # noqa: BLE001 - the rewrite raised on this module: the row says so
        return ({"ok": False, "why": f"the rewrite raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                 "kind": "run error"}, time.perf_counter() - start)


def judge_local(value: torch.Tensor, out32: torch.Tensor, out64: torch.Tensor, tol) -> dict:
    """A module's output against its float64 reference and its float32 floor; a NaN never passes."""
    if tuple(value.shape) != tuple(out64.shape):
        return {"ok": False, "why": f"shape {list(value.shape)} != reference {list(out64.shape)}", "kind": "shape"}
    m = compare_to_floor(value.double(), out32.double(), out64)
    m["kind"] = difference_kind(value, out64)
    bad = nonfinite(value, out64)
    if bad:
        m["ok"], m["why"] = False, bad
    else:
        m["ok"], m["why"] = comparator(tol)(m)
    return m


def judge_pipeline(session, item: RewriteItem, model, traces, tol, rec) -> list[str]:
    """The rewrite's own tokens -> audio (its own noise): its durations against the reference's
    exactly, its audio against the noise band; the failures, as the reason says them."""
    case = session.cases[item.case]
    with progress.phase(f"{item.name}: its own pipeline, its own noise and durations"):
        got = item.adapter.synthesize(model, case.phonemes, reference_tensor("ref_s", traces), case.speed)
    if got is None:
        return []
    audio, durations = got
    failures = []
    want = list(traces.pred_dur)
    differ = sum(a != b for a, b in zip(durations.tolist(), want)) + abs(len(durations) - len(want))
    rec.durations = {"tokens": len(want), "tokens_differ": differ, "frames": int(durations.sum()),
                     "frames_reference": int(sum(want))}
    if differ:
        failures.append(f"pipeline: {differ} of {len(want)} durations differ ({int(durations.sum())} frames, "
                        f"the reference {sum(want)})")
    bad = nonfinite(audio)
    if bad:
        return failures + [f"pipeline audio: {bad}"]
    ref = traces.chain["audio"][0].double().numpy()
    am = audio_metrics(ref, audio.double().numpy())
    rec.audio_metrics["audio"] = am
    band = noise_band(session.model, case, traces, session_k(session))
    check = band_comparator(tol)
    for metric, direction in DIRECTIONS.items():
        ok, why = check(metric, am.get(metric, math.nan), band["band"][metric], direction)
        rec.bands[metric] = NoiseBand(value=am.get(metric), band=band["band"][metric], ok=ok, direction=direction,
                                      why=why, k=band["k"])
        if not ok:
            failures.append(f"pipeline audio: {why}")
    return failures


def rewrite_versions() -> dict[str, str]:
    out = {}
    for pkg in ("mlx", "mlx-audio"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out
