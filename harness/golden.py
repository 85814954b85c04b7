"""The golden store: committed reference tensors at step boundaries, one manifest per (case, mode).

`<store>/<model>/<case>/<mode>/` (the shipped store: the repository's `golden/`, package data of
the wheel; a user's: --golden-dir) holds each step output (valid region) as `.npy` and a manifest
with the sha256 of every file, the weights digest, the case digest and the versions that made it.
A file that fails its checksum, or golden data made from other weights or another case, is an
error that says so; it is never a pass. Large tensors are stored as float16 to keep the store
small; they are compared at float16's precision. A NaN never passes (unlike pytest-regressions).

A fresh reference may differ from its golden copy by fp32 noise: the vocoder amplifies a 1e-7
change of its inputs (another CPU's kernels: AVX-512 against AVX2, MKL's or oneDNN's code path)
to about 5e-3 of the audio, as large as fp32 eager's own error against float64 (finding 12). So a
tensor's tolerance is the larger of its dtype's and FLOOR_FACTOR times that fp32 noise floor
(torch's accuracy-minifier rule applied to golden files). The floor is the one measured when the
files were made, kept in the manifest (a fresh run's floor would grow with the very error it
should catch; manifests without one use the fresh floor); the manifest also says which CPU path
made the files (`numerics`), and a failure names both paths.
"""
from __future__ import annotations

import importlib.metadata as md
import io
import json
import math
from pathlib import Path

import numpy as np

from .cases import shipped_dir
from .plumbing.files import atomic_write_bytes, atomic_write_json, sha256_file
from .metrics.tensor import error_metrics
from .reference import numerics
from .steps import STEPS

GOLDEN_DIR = shipped_dir("golden")  # the shipped cases' store
SCHEMA = "kokoro-parity/golden/1"
FP16_ABOVE_BYTES = 256 * 1024  # tensors larger than this are stored as float16
TOLERANCE = {"float32": 1e-5, "float16": 2e-3}  # relative L2 allowed against the stored copy
# two fp32 runs on two CPU paths each err by about the floor against float64: their difference is
# about sqrt(2) floors when independent (measured 0.6-0.9 on en_short's decoder audio), 2 with margin
FLOOR_FACTOR = 2.0
SKIP_OUTPUTS = {"gen_audio"}  # the generator's output is the decoder's; storing it twice buys nothing


class GoldenError(Exception):
    """Golden data that cannot be trusted: missing, corrupted, or made from other inputs."""


class GoldenStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    @classmethod
    def for_model(cls, model, base: Path = GOLDEN_DIR) -> "GoldenStore":
        return cls(Path(base) / model.name)

    def dir(self, case_id: str, mode: str) -> Path:
        return self.root / case_id / mode

    @staticmethod
    def tensors(traces, mode: str) -> dict[str, np.ndarray]:
        out = {}
        for step in STEPS:
            if (step.name, mode, "float32") not in traces.io or {t.name for t in step.outputs} <= SKIP_OUTPUTS:
                continue
            for name, value in traces.outputs(step.name, mode, "float32").items():
                if name not in SKIP_OUTPUTS:
                    out[f"{step.name}.{name}"] = traces.valid_region(step.name, name, value).numpy()
        out["alignment.pred_dur"] = np.asarray(traces.pred_dur, dtype=np.int64)
        return out

    @staticmethod
    def floors(traces, mode: str) -> dict[str, float]:
        """Each float output's fp32 noise floor: relative L2 of the fresh float32 reference (valid
        region) against the float64 one of the same inputs; absent where no float64 run exists."""
        out = {}
        for step in STEPS:
            if (step.name, mode, "float32") not in traces.io or (step.name, mode, "float64") not in traces.io:
                continue
            f64 = traces.outputs(step.name, mode, "float64")
            for name, value in traces.outputs(step.name, mode, "float32").items():
                if name in SKIP_OUTPUTS or name not in f64 or not value.is_floating_point():
                    continue
                floor = error_metrics(traces.valid_region(step.name, name, value),
                                      traces.valid_region(step.name, name, f64[name]))["rel_l2"]
                if math.isfinite(floor):  # a non-finite reference widens nothing
                    out[f"{step.name}.{name}"] = floor
        return out

    def write(self, case, mode: str, traces, model) -> Path:
        directory = self.dir(case.id, mode)
        files, floors = {}, self.floors(traces, mode)
        for name, value in self.tensors(traces, mode).items():
            stored = value.astype(np.float16) if value.dtype == np.float32 and value.nbytes > FP16_ABOVE_BYTES else value
            buf = io.BytesIO()
            np.save(buf, stored, allow_pickle=False)
            path = atomic_write_bytes(directory / f"{name}.npy", buf.getvalue())
            files[path.name] = {"sha256": sha256_file(path), "dtype": str(stored.dtype), "shape": list(value.shape),
                                **({"floor": float(f"{floors[name]:.3e}")} if name in floors else {})}
        for stale in directory.glob("*.npy"):
            if stale.name not in files:
                stale.unlink()
        manifest = {"schema": SCHEMA, "model": model.name, "weights_digest": model.digest, "case": case.id,
                    "case_digest": case.digest, "mode": mode, "files": files,
                    "versions": {p: md.version(p) for p in ("torch", "kokoro", "numpy")},
                    "numerics": numerics()}
        atomic_write_json(directory / "manifest.json", manifest)
        return directory

    def load(self, case, mode: str, model) -> dict[str, np.ndarray]:
        directory = self.dir(case.id, mode)
        mpath = directory / "manifest.json"
        if not mpath.exists():
            raise GoldenError(f"{mpath}: no golden data for case {case.id!r} ({mode}) of model {model.name!r}; "
                              "create it with --update-golden")
        try:
            manifest = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise GoldenError(f"{mpath}: unreadable manifest ({e})") from None
        if manifest.get("schema") != SCHEMA:
            raise GoldenError(f"{mpath}: schema {manifest.get('schema')!r}, expected {SCHEMA!r}")
        if manifest["weights_digest"] != model.digest:
            raise GoldenError(f"{mpath}: golden data was made from other weights (digest {manifest['weights_digest']}, "
                              f"these are {model.digest}); regenerate with --update-golden")
        if manifest["case_digest"] != case.digest:
            raise GoldenError(f"{mpath}: case {case.id!r} changed since its golden data was made; "
                              "regenerate with --update-golden")
        out = {}
        for fname, meta in manifest["files"].items():
            path = directory / fname
            if not path.exists():
                raise GoldenError(f"{path}: listed in the manifest but missing")
            if sha256_file(path) != meta["sha256"]:
                raise GoldenError(f"{path}: fails its checksum (corrupted or edited); regenerate with --update-golden")
            out[fname[:-4]] = np.load(path, allow_pickle=False)
        return out

    def check(self, case, mode: str, traces, model) -> list[str]:
        """Problems found comparing fresh references with the golden data (empty: they match)."""
        golden = self.load(case, mode, model)
        manifest = json.loads((self.dir(case.id, mode) / "manifest.json").read_text())
        fresh = self.tensors(traces, mode)
        problems = [f"{name}: in the fresh reference but not in golden" for name in sorted(set(fresh) - set(golden))]
        problems += [f"{name}: in golden but not produced any more" for name in sorted(set(golden) - set(fresh))]
        # the floors the golden data were written with; float64 runs only for a file that has none
        # (the float64 vocoder is most of a check's time)
        stored = {name: manifest["files"][f"{name}.npy"].get("floor") for name in set(fresh) & set(golden)}
        unfloored = [name for name, floor in stored.items() if floor is None and golden[name].dtype.kind == "f"]
        fresh_floors = self.floors(traces, mode) if unfloored else {}
        for name in sorted(stored):
            floor = stored[name] if stored[name] is not None else fresh_floors.get(name, 0.0)
            problem = compare(name, fresh[name], golden[name], floor)
            if problem:
                problems.append(problem)
        made = manifest.get("numerics", "not recorded")
        if problems and made != numerics():
            problems.append(f"(golden made under the CPU path {made}; this run: {numerics()})")
        return problems


def compare(name: str, fresh: np.ndarray, stored: np.ndarray, floor: float = 0.0) -> str | None:
    """None when `fresh` matches `stored`; else the problem. `floor`: the tensor's fp32 noise floor
    (relative L2, fresh fp32 against float64), which widens the tolerance to FLOOR_FACTOR floors."""
    if fresh.shape != stored.shape:
        return f"{name}: shape {fresh.shape} != golden {stored.shape}"
    if not np.issubdtype(stored.dtype, np.floating):
        return None if np.array_equal(fresh, stored) else f"{name}: values differ from golden"
    f, s = fresh.astype(np.float64), stored.astype(np.float64)
    if not (np.isfinite(f).all() and np.isfinite(s).all()):
        return f"{name}: non-finite values (fresh NaN/Inf: {int((~np.isfinite(f)).sum())}, golden: {int((~np.isfinite(s)).sum())})"
    norm = np.linalg.norm(s)
    rel = np.linalg.norm(f - s) / norm if norm > 0 else float(np.linalg.norm(f - s) > 0)
    tol = TOLERANCE.get(str(stored.dtype), 1e-5)
    if not rel <= max(tol, FLOOR_FACTOR * floor) or math.isnan(rel):
        by_floor = f" and {FLOOR_FACTOR:g} x its fp32 floor {floor:.2e}" if floor else ""
        return f"{name}: relative L2 {rel:.2e} from golden exceeds {tol:.0e}{by_floor}"
    return None
