"""How far a CPU's code paths move Kokoro's references (finding 12), against their fp32 noise floor.

Computes a case's references (the harness's own traces, cached per `reference.numerics()`) in one
child process per CPU path: the CPU's own (on an AVX-512 machine: torch's AVX-512 kernels, MKL's
AVX-512 FFT, oneDNN's AVX-512 convolutions), then with MKL and torch pinned to AVX2 (what the unit
tests run), then oneDNN pinned too. Prints, per output and precision, the relative L2 of each path
against the first pinned one and against the shipped golden file, beside the output's fp32 floor
(fp32 against float64): the golden store's tolerance is 2 floors (harness/golden.py).

    .venv/bin/python benchmarks/cpu_paths.py [--case en_short] [--steps f0n decoder]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PATHS = {  # name -> environment
    "cpu's own": {},
    "mkl+aten avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "+onednn avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
PINS = ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
CHILD = """
import sys, numpy as np
from pathlib import Path
sys.path.insert(0, {root!r})
from harness.reference import numerics
from harness.runner import Session
out = Path({out!r})
s = Session(case_ids=[{case!r}], report_dir=out / "reports")
tr = s.traces({case!r})
for mode in ("dynamic", "static"):
    for prec in ("float32", "float64"):
        for step in {steps!r}:
            for name, v in tr.outputs(step, mode, prec).items():
                np.save(out / f"{{step}}.{{name}}.{{mode}}.{{prec}}.npy", tr.valid_region(step, name, v).numpy())
(out / "numerics").write_text(numerics())
"""


def rel(a: np.ndarray, b: np.ndarray) -> float:
    from harness.metrics.tensor import error_metrics

    return error_metrics(a, b)["rel_l2"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="en_short")
    ap.add_argument("--steps", nargs="+", default=["f0n", "decoder"])
    args = ap.parse_args()
    from tabulate import tabulate

    tmp = Path(tempfile.mkdtemp(prefix="kp-cpu-paths-"))
    dirs = {}
    for name, env in PATHS.items():
        out = tmp / name.replace(" ", "_").replace("'", "").replace("+", "")
        out.mkdir()
        child_env = {k: v for k, v in os.environ.items() if k not in PINS} | env
        code = CHILD.format(root=str(ROOT), out=str(out), case=args.case, steps=tuple(args.steps))
        subprocess.run([sys.executable, "-c", code], env=child_env, check=True, capture_output=True)
        dirs[name] = out
        print(f"{name}: {(out / 'numerics').read_text()}", flush=True)
    base = dirs["mkl+aten avx2"]
    golden = ROOT / "golden" / "kokoro-v1_0-int8" / args.case
    rows = []
    for f in sorted(base.glob("*.npy")):
        step_out, mode, prec = f.stem.rsplit(".", 2)
        row = [step_out, mode, prec]
        if prec == "float32":
            row.append(rel(np.load(f), np.load(base / f"{step_out}.{mode}.float64.npy")))
        else:
            row.append(None)
        row += [rel(np.load(d / f.name), np.load(f)) for n, d in dirs.items() if d != base]
        g = golden / mode / f"{step_out}.npy"
        row += [rel(np.load(d / f.name), np.load(g)) if g.exists() and prec == "float32" else None
                for d in dirs.values()]
        rows.append(row)
    others = [n for n in dirs if dirs[n] != base]
    headers = ["output", "mode", "precision", "fp32 floor", *(f"{n} vs avx2" for n in others),
               *(f"{n} vs golden" for n in dirs)]
    print(tabulate(rows, headers=headers, floatfmt=".2e", missingval="-"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
