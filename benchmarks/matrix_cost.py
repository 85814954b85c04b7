"""What a matrix run cost, per backend and case, from its records (issue 19: "report what the full
cold matrix costs"): items, the work seconds (export + compile + run jobs, as each record timed
them), the longest item, the peak memory of a compile and of a run, and the artifacts' size.

`python benchmarks/matrix_cost.py REPORT_DIR [REPORT_DIR ...]` (a merged matrix, or shards). The
seconds are the items' own work, not wall time: references, judging and a bisection are left out,
and a cached program or artifact counts 0 (say whether the run was cold beside a figure).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from harness.record import read_records  # noqa: E402

WORK = ("export_s", "compile_s", "run_job_s")  # a stage's keys end with these (e2e: "synthesizer.local.compile_s")


def item_work(timings: dict) -> float:
    return sum(v for k, v in timings.items() if k.endswith(WORK) and isinstance(v, (int, float)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report_dirs", nargs="+", type=Path)
    args = ap.parse_args()
    rows: dict = defaultdict(lambda: {"items": 0, "work_s": 0.0, "longest": ("", 0.0), "compile_mb": 0.0,
                                      "run_mb": 0.0, "artifact_mb": 0.0, "verdicts": defaultdict(int)})
    for d in args.report_dirs:
        for r in read_records(d / "records"):
            row = rows[(r.backend, r.case)]
            work = item_work(r.timings)
            row["items"] += 1
            row["work_s"] += work
            row["verdicts"][r.verdict.value] += 1
            if work > row["longest"][1]:
                row["longest"] = (f"{r.step} {r.mode}", work)
            peaks = r.peak_rss_mb or {}
            row["compile_mb"] = max([row["compile_mb"], *(v for k, v in peaks.items() if k.endswith("compile"))])
            row["run_mb"] = max([row["run_mb"], *(v for k, v in peaks.items() if k.endswith("run"))])
            row["artifact_mb"] += (r.artifact_bytes or 0) / 2**20
    table = [[backend, case, row["items"], ", ".join(f"{n} {v}" for v, n in sorted(row["verdicts"].items())),
              f"{row['work_s'] / 60:.1f}", f"{row['longest'][0]} ({row['longest'][1] / 60:.1f})",
              f"{row['compile_mb'] / 1024:.1f}", f"{row['run_mb'] / 1024:.1f}", f"{row['artifact_mb']:.0f}"]
             for (backend, case), row in sorted(rows.items())]
    print(tabulate(table, headers=["backend", "case", "items", "verdicts", "work min", "longest item (min)",
                                   "peak compile GB", "peak run GB", "artifacts MB"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
