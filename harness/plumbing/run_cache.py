"""Saved run outputs, so that a warm re-run judges again without running again (`--reuse-runs`).

Polygraphy's `--save-outputs` / `--load-outputs` in one flag: every successful local run stores
its outputs (a few MB at most: en_long's 27 s of audio is 2.6 MB) in the cache, keyed by the
compiled artifact's cache key (which already holds the program, the backend, its version and its
workarounds), the artifact's file name and the inputs' bytes. With `--reuse-runs` a run whose key
is there is not run: its outputs are judged against today's references and tolerances, and the
record says `cache.run = "hit"` with the stored run's own timings; the runner looks the key up
before exporting or compiling (`Session.saved_run`), so the program and the artifact (nearly all of a capped
cache's bytes, and pruned with the rest) are not needed again. Without the flag every run runs,
as before: a runtime that is not deterministic, or a machine whose speed is the question, needs
fresh runs. Remote targets never reuse (the run's machine is the point of them).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import cache
from .files import atomic_write_json, content_key, tensors_digest

KIND = "runs"


def run_key(artifact_path: Path, inputs: list, backend_name: str) -> str | None:
    """The run's key, or None when the artifact is not a cache entry (nothing stable to key on)."""
    entry = Path(artifact_path).parent
    if entry.parent != cache.cache_dir() / "artifacts":
        return None
    digest = tensors_digest({f"{i:04d}": t for i, t in enumerate(inputs)})
    return content_key("run", entry.name, Path(artifact_path).name, backend_name, digest)


def load(key: str, outputs_path: Path) -> dict | None:
    """Copy the stored outputs to `outputs_path` and return the stored run's figures, or None."""
    entry = cache.lookup(KIND, key)
    if entry is None:
        return None
    stored = entry / ("outputs" + outputs_path.suffix)
    if not stored.exists():  # saved by the other kind of job (.pt against .npz): not this run
        return None
    outputs_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(stored, outputs_path)
    return json.loads((entry / "run.json").read_text())


def store(key: str, outputs_path: Path, figures: dict) -> None:
    """Keep a successful run's outputs and figures (run_s, run_job_s, peak_rss_mb, audit)."""
    def build(tmp: Path) -> None:
        shutil.copyfile(outputs_path, tmp / ("outputs" + outputs_path.suffix))
        atomic_write_json(tmp / "run.json", figures)

    cache.get_or_build(KIND, key, build)
