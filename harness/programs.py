"""Programs: a step exported once with `torch.export` for given shapes and patches.

The exported program is the one form every backend takes (and bisection later cuts). Exporting
runs as a job in a child process, so a hang or crash inside torch.export is an item's outcome.
"""
from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

PROGRAM_VERSION = 1  # bump when the export recipe changes: it invalidates cached programs


def export_step(weights: str | None, expected_digest: str, step: str, patches: list[str],
                inputs_path: str, out_path: str) -> dict:
    """Job function: load the model, patch a copy, export `step` on the saved inputs."""
    import torch

    from .model import load_model
    from .patches import apply_patches
    from .steps import get_step

    model = load_model(weights)
    if model.digest != expected_digest:
        raise RuntimeError(f"weights changed under the run: digest {model.digest} != {expected_digest}")
    module = get_step(step).module(apply_patches(model.kmodel, patches))
    inputs = tuple(torch.load(inputs_path, weights_only=True))
    start = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(module, inputs, strict=False)
    export_s = time.perf_counter() - start
    torch.export.save(program, out_path)
    ops = Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function")
    return {"export_s": export_s, "n_nodes": len(program.graph.nodes), "ops": dict(ops)}


def op_counts(program_path: Path) -> dict[str, int]:
    import torch

    program = torch.export.load(str(program_path))
    return dict(Counter(str(n.target) for n in program.graph.nodes if n.op == "call_function"))
