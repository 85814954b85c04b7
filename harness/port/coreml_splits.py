"""Core ML conversions of the example splits: each stage's torch module
(harness/port/splits.py) exported with torch.export and converted by coremltools to an mlprogram
`<stage>.mlpackage`, by the route and graph fixes of the `coreml-*` backends
(harness/backends/coreml.py `_inference_ir`), with `port-coreml.yaml` beside them.

Conversion runs on any OS; prediction needs Core ML, i.e. macOS, so elsewhere the chain's item is
SKIPPED with that reason (harness/backends/prebuilt.py), never passed.

Shapes are the case's exact lengths: torch 2.13's export specializes an LSTM's length, which fixes
the token count (each LSTM converts to one MIL `lstm` op per direction, the backends'
`lstm_converter`). A Core ML port file runs the case it was converted for.

A stage coremltools cannot convert is a finding, not hidden: its error is printed and kept
(`StageResult.error`), no file is written for it, and no port file either.
"""
from __future__ import annotations

import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from . import splits, tensors
from ..backends.coreml import CORE_ML_WORKAROUNDS, CoreMLFp32Backend, _inference_ir, mil_gaps
from ..backends.prebuilt import describe
from ..patches import apply_patches
from ..plumbing.files import atomic_write_text
from ..plumbing.errors import UsageError
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
ct = deferred_import("coremltools")

# the ONNX export's patches, plus the coreml-* backends' frontend fixes that apply to these stages
# (ExactSTFT needs no `stft_phase_where`): rsqrt of an int constant
COREML_PATCHES = (*splits.EXPORT_PATCHES, "rsqrt_float_const")
PORT_FILE = "port-coreml.yaml"
PRECISIONS = ("float32", "float16")
# The public 7-stage Core ML port (laishere/kokoro-coreml, convert.py; shipped by FluidAudio as
# `kokoroAne`): Albert, PostAlbert, Alignment, Prosody and Vocoder at FLOAT16 for the Neural
# Engine; Noise and Tail at FLOAT32 (the sine source's phase, a cumsum, and the inverse STFT).
# Stages not named here are float32.
PUBLIC_PRECISIONS = {"kokoro-7stage": {"albert": "float16", "post_albert": "float16", "prosody": "float16",
                                       "vocoder": "float16"}}


class ConversionError(RuntimeError):
    """coremltools could not convert a stage: the converter's own message, with the ops it has no
    MIL lowering for when there are any."""


@dataclass
class StageResult:
    name: str
    path: Path
    precision: str
    seconds: float
    error: str | None = None  # the converter's error: no file written

    @property
    def ok(self) -> bool:
        return self.error is None


def precisions_for(split: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Each stage's compute precision: the public port's, then `overrides` (STAGE -> float32|float16)."""
    names = [s.name for s in splits.SPLITS[split]]
    chosen = {n: PUBLIC_PRECISIONS.get(split, {}).get(n, "float32") for n in names}
    for stage, precision in (overrides or {}).items():
        if stage not in chosen:
            raise UsageError(f"--precision {stage}={precision}: no stage {stage!r} in {split}; stages: "
                             f"{', '.join(names)}")
        if precision not in PRECISIONS:
            raise UsageError(f"--precision {stage}={precision}: one of {', '.join(PRECISIONS)}")
        chosen[stage] = precision
    return chosen


def parse_precisions(texts: list[str] | None, split: str) -> dict[str, str]:
    """`--precision STAGE=float16` (repeatable) -> the split's precisions."""
    overrides = {}
    for text in texts or ():
        stage, sep, precision = text.partition("=")
        if not sep:
            raise UsageError(f"--precision {text!r}: expected STAGE=float32 or STAGE=float16")
        overrides[stage] = precision
    return precisions_for(split, overrides)


def convert_stage(module: nn.Module, stage: splits.StageDef, args: tuple, path: Path, precision: str,
                  disabled: set[str] = frozenset()) -> Path:
    """One stage to `path` (an .mlpackage, replaced whole): torch.export at the inputs' shapes, the
    coreml backends' inference IR (without the graph fixes named in `disabled`), ct.convert to an
    iOS17 mlprogram whose inputs and outputs carry the stage's names. ConversionError with the
    converter's message when it fails."""

    # torch.export records each example input's dim order; a transposed one (the reference's `d`)
    # is refused ("Core ML does not have general support for non-contiguous dim order"): an app
    # feeds contiguous arrays
    args = tuple(a.contiguous() for a in args)
    with torch.no_grad():
        program = _inference_ir(torch.export.export(module, args, strict=False), disabled)
    try:
        model = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17,
                           compute_precision=getattr(ct.precision, precision.upper()),
                           inputs=[ct.TensorType(name=n) for n in stage.inputs],
                           outputs=[ct.TensorType(name=n) for n in stage.outputs],
                           skip_model_load=platform.system() != "Darwin")
    except Exception as e:  # noqa: BLE001 - any converter failure is the stage's finding
        gaps = mil_gaps(program)["ops_without_mil_lowering"]
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConversionError(f"{type(e).__name__}: {first}" + (f" (ops without a MIL lowering: {gaps})"
                                                                  if gaps else "")) from e
    tmp = path.parent / f".{path.stem}.tmp{path.suffix}"  # coremltools saves to *.mlpackage only
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save(str(tmp))
        _replace_dir(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _replace_dir(new: Path, path: Path) -> None:
    """`new` renamed over `path` (a directory): never a half-written package at `path`."""
    old = path.parent / f".{path.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        path.replace(old)
    new.replace(path)
    shutil.rmtree(old, ignore_errors=True)


def convert_split(split: str, model, traces, out_dir: Path, precisions: dict[str, str] | None = None,
                  defect: splits.DefectSpec | None = None, log=print, only: set[str] | None = None,
                  disabled: set[str] | None = None) -> tuple[Path | None, list[StageResult]]:
    """Convert every stage of `split` to `<out_dir>/<stage>.mlpackage` and write
    `<out_dir>/port-coreml.yaml`; returns (the port file, or None when a stage failed; each stage's
    result). `only`: convert just these stages (the others' packages are already there).
    `disabled`: the coreml backends' workarounds left out (default: `--no-workaround`, its env
    variable), so that the converter's gap they close shows. `traces` must hold the module
    captures of HAR and CONV_POST (`reference.module_captures`)."""
    precisions = precisions or precisions_for(split)
    disabled, patches = workarounds_off(disabled)
    out_dir.mkdir(parents=True, exist_ok=True)
    km, results = None, []
    for stage in splits.SPLITS[split]:
        path = out_dir / f"{stage.name}.mlpackage"
        if only is not None and stage.name not in only:
            continue
        km = km if km is not None else apply_patches(model.kmodel, patches)
        module = splits.defect_module(stage, model, km, defect, patches)
        start = time.perf_counter()
        try:
            convert_stage(module, stage, splits.stage_inputs(traces, stage.inputs), path, precisions[stage.name],
                          disabled)
            error = None
        except ConversionError as e:
            error = str(e)
            shutil.rmtree(path, ignore_errors=True)  # a package of an earlier run is not this one
        result = StageResult(stage.name, path, precisions[stage.name], time.perf_counter() - start, error)
        results.append(result)
        log(f"{path}: {precisions[stage.name]}, {result.seconds:.1f} s" if result.ok else
            f"{path}: coremltools cannot convert stage {stage.name!r}: {error}")
    port = out_dir / PORT_FILE
    missing = [s.name for s in splits.SPLITS[split] if not (out_dir / f"{s.name}.mlpackage").is_dir()]
    if missing:
        port.unlink(missing_ok=True)  # it would name packages that are not there
        log(f"no {PORT_FILE}: no package for stage(s) {', '.join(missing)}")
        return None, results
    return write_port_file(split, model, traces, out_dir, precisions, defect), results


def workarounds_off(disabled: set[str] | None = None) -> tuple[set[str], tuple[str, ...]]:
    """(the graph fixes of `_inference_ir` left out, the model's patches): the coreml backends'
    workarounds named in `disabled` (default: those switched off for this process) are not applied."""
    off = CoreMLFp32Backend().disabled_workarounds() if disabled is None else set(disabled)
    off = set(CORE_ML_WORKAROUNDS) if "all" in off else off
    unknown = sorted(off - set(CORE_ML_WORKAROUNDS))
    if unknown:
        raise UsageError(f"--no-workaround {', '.join(unknown)}: not a Core ML workaround; known: "
                         f"{', '.join(sorted(CORE_ML_WORKAROUNDS))}")
    dropped = {CORE_ML_WORKAROUNDS[n].patch for n in off if CORE_ML_WORKAROUNDS[n].patch}
    return off - {n for n in off if CORE_ML_WORKAROUNDS[n].patch}, tuple(p for p in COREML_PATCHES if p not in dropped)


def write_port_file(split: str, model, traces, out_dir: Path, precisions: dict[str, str],
                    defect: splits.DefectSpec | None = None) -> Path:
    """The port file of the packages in `out_dir`: each stage's declared inputs and its outputs
    mapped, a dtype the package declares other than the vocabulary's given as `dtype:` (Core ML I/O
    has no bool or int64; a FLOAT16 stage's I/O is float16), its precision."""
    lengths = f"{traces.chain['input_ids'].shape[-1]} tokens, {traces.chain['aln'].shape[-1]} frames"
    lines = [f"# {split}, converted to Core ML from {model.name} for case {traces.case_id!r} by "
             f"examples/{split}/export.py --format coreml" + (f" with the defect {defect}" if defect else ""),
             f"# shapes fixed at that case's lengths ({lengths}): it runs that case only; prediction needs macOS",
             f"name: {split}-coreml", "stages:"]
    for stage in splits.SPLITS[split]:
        if stage.name == "prosody" and split == "kokoro-7stage":
            lines.append("  # Alignment (host glue, the harness's own): duration -> pred_dur -> aln")
        path = out_dir / f"{stage.name}.mlpackage"
        ins, outs = ({p.name: p for p in ports} for ports in describe(path))
        lines += [f"  - name: {stage.name}", f"    artifact: {path.name}", f"    precision: {precisions[stage.name]}",
                  f"    noise: {stage.noise}", "    inputs:"]
        lines += [_mapping(n, splits.INPUT_TENSORS.get(n, n), ins[n]) for n in stage.inputs if n in ins]
        lines += ["    outputs:", *(_mapping(n, t, outs.get(n)) for n, t in stage.outputs.items())]
    port = out_dir / PORT_FILE
    atomic_write_text(port, "\n".join(lines) + "\n")
    return port


def _mapping(name: str, tensor: str, declared) -> str:
    """`name: tensor`, or `name: {tensor: ..., dtype: ...}` where the package's dtype is not Kokoro's."""
    t, dtype = tensors.VOCAB.get(tensor), declared.dtype if declared is not None else None
    want = t.dtype if t is not None else "float32"  # a module reference: a float32 activation
    if dtype is None or dtype == want:
        return f"      {name}: {tensor}"
    why = "a FLOAT16 stage's I/O" if dtype == "float16" else f"Core ML I/O has no {want}"
    return f"      {name}: {{tensor: {tensor}, dtype: {dtype}}}  # {why}"
