"""Rewrite drift in float64: a step's static reference (with extra patches) against its dynamic one,
both in float64, on the valid region (no backend: eager PyTorch, cached references).

`kokoro-parity drift` compares fp32 with fp32, beside the fp32 noise floor; two fp32 runs that sum
in different orders can differ by a few times that floor. In float64 a semantics-preserving
rewrite leaves ~1e-15, and a semantic difference stays where it was.
Usage: python benchmarks/rewrite_drift_fp64.py --case en_long --step f0n
       --with-patch length_aware_lstm --with-patch length_aware_norm
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from harness.cases import load_cases  # noqa: E402
from harness.metrics.tensor import error_metrics  # noqa: E402
from harness.model import load_model  # noqa: E402
from harness.patches import PATCHES, affecting  # noqa: E402
from harness.reference import load_traces, variant_outputs  # noqa: E402
from harness.steps import get_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", required=True)
    ap.add_argument("--step", action="append", required=True)
    ap.add_argument("--with-patch", action="append", default=[])
    args = ap.parse_args()
    if not all(PATCHES[p].preserves_semantics for p in args.with_patch):
        raise SystemExit("only semantics-preserving patches: the dynamic float64 reference is Kokoro's own")
    model = load_model()
    rows = []
    for case in load_cases(only=args.case):
        traces = load_traces(model, case)
        for name in args.step:
            variant = affecting(tuple(args.with_patch), name)
            static64 = (variant_outputs(model, case, traces, name, "static", variant)["float64"] if variant
                        else traces.outputs(name, "static", "float64"))
            dynamic64 = traces.outputs(name, "dynamic", "float64")
            for out in get_step(name).output_names:
                drift = error_metrics(traces.valid_region(name, out, static64[out]), dynamic64[out])["rel_l2"]
                rows.append([case.id, name, out, "+".join(variant) or "-", drift])
    print(tabulate(rows, headers=["case", "step", "output", "patches", "drift_rel_l2_float64"], floatfmt=".2e"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
