"""`make bench`: cold vs warm runs, harness overhead vs a bare script, per-item figures, work counts.

Prints a table and writes the same figures as JSON into reports/history/ (bench-<time>.json), so
the dashboard can show performance over time. Speed is measured here, never asserted in tests.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from harness.plumbing.files import atomic_write_json  # noqa: E402
from harness.record import read_records  # noqa: E402

WORK = re.compile(r"work: exports (\d+), compiles (\d+), runs (\d+); cache: programs (\d+) hit / (\d+) miss, "
                  r"artifacts (\d+) hit / (\d+) miss")


def run_pytest(args: list[str], cache: Path, report_dir: Path) -> dict:
    env = {**os.environ, "KOKORO_PARITY_CACHE": str(cache)}
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", *args, "-p", "no:logging", "-q", f"--report-dir={report_dir}"],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    m = WORK.search(r.stdout)
    if r.returncode not in (0, 1) or not m:
        raise SystemExit(f"benchmark run failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    keys = ("exports", "compiles", "runs", "program_hits", "program_misses", "artifact_hits", "artifact_misses")
    return {"wall_s": wall, **dict(zip(keys, map(int, m.groups())))}


def per_item(report_dir: Path) -> list[dict]:
    rows = []
    for r in read_records(report_dir / "records"):
        t = r.timings
        audio_s = None
        if "audio" in r.metrics or "gen_audio" in r.metrics:
            for name in ("audio", "gen_audio"):
                if name in r.audio_metrics:
                    audio_s = r.audio_metrics[name].get("duration_s")
        rows.append({"item": r.item_id, "verdict": r.verdict.value, "export_s": t.get("export_s"),
                     "compile_s": t.get("compile_s"), "run_s": t.get("run_s"), "run_job_s": t.get("run_job_s"),
                     "peak_compile_mb": r.peak_rss_mb.get("compile"), "peak_run_mb": r.peak_rss_mb.get("run"),
                     "artifact_mb": (r.artifact_bytes or 0) / 2**20,
                     "rtf": (t["run_s"] / audio_s) if audio_s and t.get("run_s") else None})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="xnnpack")
    ap.add_argument("--step", default="decoder")
    ap.add_argument("--case", default="en_short")
    ap.add_argument("--mode", default="static")
    ap.add_argument("--out", type=Path, default=ROOT / "reports" / "history")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare-script comparison")
    args = ap.parse_args()
    selection = [f"--backend={args.backend}", f"--case={args.case}", f"--mode={args.mode}",
                 "-k", f"{args.step} and not golden"]
    tmp = Path(tempfile.mkdtemp(prefix="kp-bench-"))
    cache, reports = tmp / "cache", tmp / "reports"
    try:
        # separate report dirs: the warm run's records (cache hits, no compile times) must not
        # replace the cold run's, which hold the export and compile figures
        cold = run_pytest(selection, cache, reports / "cold")
        warm = run_pytest(selection, cache, reports / "warm")
        result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "selection": selection,
                  "cold": cold, "warm": warm, "warm_over_cold": warm["wall_s"] / cold["wall_s"],
                  "items": per_item(reports / "cold"), "items_warm": per_item(reports / "warm")}
        if args.backend == "xnnpack" and not args.no_bare:
            program = next((cache / "programs").glob("*/program.pt2"))
            inputs = program.parent / "inputs.pt"
            start = time.perf_counter()
            r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bare_xnnpack.py"), str(program), str(inputs)],
                               capture_output=True, text=True, check=True)
            bare_wall = time.perf_counter() - start
            bare = json.loads(r.stdout.strip().splitlines()[-1])
            rec = result["items"][0]  # the cold run's: its compile job did the lowering
            if rec["compile_s"] is None:
                raise SystemExit(f"{rec['item']}: the cold run has no compile time (was the cache empty?)")
            harness_s = rec["compile_s"] + (rec["run_job_s"] or 0)
            result["overhead"] = {"bare_process_s": bare_wall, "bare": bare,
                                  "harness_compile_plus_run_jobs_s": harness_s,
                                  "harness_over_bare": harness_s / bare_wall}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(tabulate([["cold run (empty cache)", f"{cold['wall_s']:.1f} s", f"exports {cold['exports']}, compiles {cold['compiles']}"],
                    ["warm run (its cache)", f"{warm['wall_s']:.1f} s", f"exports {warm['exports']}, compiles {warm['compiles']}"],
                    ["warm / cold", f"{result['warm_over_cold']:.2f}", "target <= 0.15"]],
                   headers=["", "wall", "work"]))
    if "overhead" in result:
        o = result["overhead"]
        print(tabulate([["bare script (lower + serialize + load + run)", f"{o['bare_process_s']:.1f} s"],
                        ["harness (compile job + run job)", f"{o['harness_compile_plus_run_jobs_s']:.1f} s"],
                        ["harness / bare", f"{o['harness_over_bare']:.2f}  (target <= 1.05)"]]))
    print(tabulate(result["items"], headers="keys", floatfmt=".2f"))
    path = atomic_write_json(args.out / f"bench-{result['date'].replace(':', '')}.json", result)
    print(f"written: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
