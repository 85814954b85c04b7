"""Programs: a step exported once with `torch.export` for given shapes and patches.

The exported program is the one form every backend takes, and bisection cuts the same file. So
one function names a program (`program_key`) and one gets it (`ensure_program`): the runner and
the bisection cannot disagree about which program an item has (with two, a bisection after a
patch edit could run on a stale program). Exporting runs as a job in a child process, so
a hang or crash inside torch.export is an item's outcome; a run's exports share one such process
(`EXPORTER`), which keeps kokoro imported and the model built between them.
"""
from __future__ import annotations

import atexit
import json
import time
from collections import Counter
from pathlib import Path

import torch

from . import progress
from .backends import cost
from .cases import CASES_ENV
from .model import SAMPLE_RATE, load_model
from .patches import affecting, apply_patches, graph_code_digest
from .plumbing import cache
from .plumbing.files import atomic_write_json, content_key, save_tensors
from .plumbing.jobs import JobResult, cached_job
from .plumbing.worker import JobProcess
from .steps import get_step

PROGRAM_VERSION = 2  # bump when the export recipe changes: it invalidates cached programs
# Each export in a fresh child imported kokoro (with transformers' ALBERT) and built the model
# again, 5-10 s before an export of 5-15 s; this process pays that once per run (and again after
# a crash, a timeout, a change of the environment or this many exports: its memory grows).
# The cases directories (the CLI's $KOKORO_PARITY_CASES) are the parent's concern, like the cache:
# each export job carries both, and a test that switches them keeps the process.
EXPORTER = JobProcess(max_jobs=16, per_job_env=(cache.CACHE_ENV, CASES_ENV))
atexit.register(EXPORTER.stop)
_LOADED: dict = {}  # in the export process: the model each export patches a copy of


def program_key(step: str, inputs: dict, patches, model_digest: str) -> tuple[str, list[str]]:
    """(cache key, the patches that were keyed): only the patches that can change `step` are
    applied and keyed, with a digest of their sources, so an edited patch re-exports and a
    backend's extra LSTM patch shares the decoder's program with the others."""
    patches = list(affecting(patches, step))
    shapes = [(k, tuple(v.shape), str(v.dtype)) for k, v in inputs.items()]
    key = content_key("program", PROGRAM_VERSION, step, shapes, patches, model_digest, torch.__version__,
                      graph_code_digest(tuple(patches)))
    return key, patches


def ensure_program(weights: str | None, model_digest: str, step: str, inputs: dict, patches, timeout: float,
                   counts: Counter | None = None) -> tuple[Path, str, JobResult | None]:
    """(cache entry holding program.pt2, its key, the export job's result or None on a hit)."""
    key, patches = program_key(step, inputs, patches, model_digest)
    with progress.phase(f"exporting {step}", active=cache.lookup("programs", key) is None):
        entry, result = cached_job(
            "programs", key, "harness.programs:export_step", timeout,
            lambda tmp: dict(weights=weights, expected_digest=model_digest, step=step, patches=patches,
                             inputs_path=str(save_tensors(tmp / "inputs.pt", inputs)),
                             out_path=str(tmp / "program.pt2")),
            counts, runner=EXPORTER.run_job)
    if result is not None and counts is not None:
        counts["exports"] += 1
    return entry, key, result


def export_step(weights: str | None, expected_digest: str, step: str, patches: list[str],
                inputs_path: str, out_path: str) -> dict:
    """Job function: load the model (once per export process), patch a copy, export `step` on the
    saved inputs."""
    model = _LOADED.get(weights)
    if model is None or model.digest != expected_digest:  # a weights file edited: read it again
        _LOADED.clear()
        model = _LOADED[weights] = load_model(weights)
    if model.digest != expected_digest:
        raise RuntimeError(f"weights changed under the run: digest {model.digest} != {expected_digest}")
    module = get_step(step).module(apply_patches(model.kmodel, patches))
    inputs = tuple(torch.load(inputs_path, weights_only=True))
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, inputs, strict=False)
        unused = unused_submodels(program, module)
        if unused:  # export again without them: their weights would be saved with the program
            for name in unused:
                setattr(module.kmodel, name, torch.nn.Module())
            program = torch.export.export(module, inputs, strict=False)
    export_s = time.perf_counter() - start
    torch.export.save(program, out_path)
    ops = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    return {"export_s": export_s, "n_nodes": len(program.graph.nodes), "ops": dict(ops), "dropped": unused}


def program_sizes(program_dir: Path, step: str) -> dict[str, float]:
    """The sizes a backend's cost law is written in (harness.backends.cost): the exported nodes,
    the time steps of the longest `aten.lstm` (which TVM's frontends write out one by one) and the
    seconds of audio the step returns. Read from the program once (2 s for en_long's f0n) and kept
    beside it in `sizes.json`."""
    path = program_dir / "sizes.json"
    if path.exists():
        sizes = json.loads(path.read_text())
        if set(sizes) >= {cost.EXPORTED_NODES, cost.LSTM_STEPS, cost.AUDIO_SECONDS}:  # else: kept by an older harness
            return sizes

    ops = json.loads((program_dir / "result.json").read_text())["value"]["ops"]
    program = torch.export.load(program_dir / "program.pt2")
    lstm_steps = 0
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.lstm.input:
            shape, batch_first = node.args[0].meta["val"].shape, node.args[8]
            lstm_steps = max(lstm_steps, int(shape[1] if batch_first else shape[0]))
    outputs = next(n for n in program.graph.nodes if n.op == "output").args[0]
    audio_s = 0.0
    for spec, node in zip(get_step(step).outputs, outputs):
        for dim, name in spec.axes.items():
            if name == "samples":
                audio_s = max(audio_s, int(node.meta["val"].shape[dim]) / SAMPLE_RATE)
    sizes = {cost.EXPORTED_NODES: sum(ops.values()), cost.LSTM_STEPS: lstm_steps, cost.AUDIO_SECONDS: audio_s}
    atomic_write_json(path, sizes)
    return sizes


def unused_submodels(program, module) -> list[str]:
    """Kokoro's parts (bert, predictor, decoder, ...) that the step's graph never reads.

    A step module holds the whole KModel, and torch.export lifts and saves every parameter of the
    module, read or not: each program was 370 MB, whichever step it held (bert alone is 25 MB),
    and a matrix run's cache grew to 48 GB."""
    kmodel = getattr(module, "kmodel", None)
    if kmodel is None:
        return []
    sig = program.graph_signature
    lifted = {**sig.inputs_to_parameters, **sig.inputs_to_buffers}
    state = program.state_dict
    # by identity, not by name: a tensor reachable by several paths (the e2e stages hold the step
    # modules, which hold kmodel again) is lifted under one of its names
    used = {id(state[lifted[n.name]]) for n in program.graph.nodes
            if n.op == "placeholder" and n.name in lifted and n.users and lifted[n.name] in state}
    mine = {id(t): t for t in (*module.parameters(), *module.buffers())}
    if not used <= set(mine):  # the program's tensors are not the module's: keep everything
        return []
    return [name for name, child in kmodel.named_children()
            if any(True for _ in child.parameters())
            and not any(id(t) in used for t in (*child.parameters(), *child.buffers()))]
