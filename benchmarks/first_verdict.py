"""Time to the first verdict of a pytest run (default: `make parity`'s command), and to its end.

`python benchmarks/first_verdict.py [--stop] [-- PYTEST ARGS]`: runs pytest with `-v` (one line
per verdict), timestamps its output and prints the seconds to the first PASSED / FAILED /
SKIPPED / ERROR line and, unless `--stop` ends the run there, to the end of the run. It measures
what a user waits for, with whatever the cache holds: say which (cold or warm) beside a figure.

`--cold-and-warm` measures `make parity` as a new user meets it: its command on a new, empty cache
(`KOKORO_PARITY_CACHE`: the default model rebuilt, every reference, export and lowering made),
then again on the cache it left (warm), and prints each figure beside its target (cold at most
15 minutes, its first verdict within 3, warm at most 60 s); the figures go to
reports/history/first-verdict-<time>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tabulate import tabulate  # noqa: E402

from harness.plumbing.files import atomic_write_json  # noqa: E402

PARITY = ["--backend=xnnpack", "--backend=eager", "-k", "decoder", "-n", "2", "--reuse-runs"]  # the Makefile's `parity` target
VERDICT = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")
SUMMARY = re.compile(r"=+ (.*\d+ (passed|failed|skipped).*) in [\d.]+s")
TARGETS = {"cold_first_verdict_s": 180, "cold_total_s": 900, "warm_total_s": 60}


def timed(cmd: list[str], env: dict, stop: bool = False, label: str = "") -> dict:
    """One pytest run, its output echoed with seconds since the start: the first verdict's and
    the end's seconds, and pytest's summary line."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env=env)
    first, first_line, summary = None, "", ""
    for line in proc.stdout:
        sys.stdout.write(f"{label}[{time.monotonic() - start:7.1f}] {line}")
        if first is None and "::" in line and VERDICT.search(line):
            first, first_line = time.monotonic() - start, line.strip()
            if stop:
                os.killpg(proc.pid, signal.SIGTERM)
                break
        m = SUMMARY.search(line)
        summary = m.group(1) if m else summary
    proc.wait()
    return {"command": " ".join(cmd), "first_verdict_s": first, "first_verdict": first_line,
            "total_s": None if stop else time.monotonic() - start, "exit_code": proc.returncode, "summary": summary}


def cold_and_warm(pytest_args: list[str]) -> dict:
    cache = Path(tempfile.mkdtemp(prefix="kp-first-verdict-"))
    env = {**os.environ, "KOKORO_PARITY_CACHE": str(cache / "cache")}
    cmd = [sys.executable, "-m", "pytest", *(pytest_args or PARITY), "-v", f"--report-dir={cache / 'reports'}"]
    try:
        cold = timed(cmd, env, label="cold ")
        warm = timed(cmd, env, label="warm ")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    figures = {"cold_first_verdict_s": cold["first_verdict_s"], "cold_total_s": cold["total_s"],
               "warm_first_verdict_s": warm["first_verdict_s"], "warm_total_s": warm["total_s"]}
    rows = [[name, f"{value:.1f} s" if value is not None else "no verdict",
             (f"<= {TARGETS[name]} s: " + ("met" if value is not None and value <= TARGETS[name] else "NOT met"))
             if name in TARGETS else ""] for name, value in figures.items()]
    print(tabulate(rows, headers=["", "seconds", "target"]))
    print(f"cold: {cold['summary']}; warm: {warm['summary']}")
    result = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "command": cold["command"],
              "cold": cold, "warm": warm, "figures": figures, "targets": TARGETS}
    path = atomic_write_json(ROOT / "reports" / "history" / f"first-verdict-{result['date'].replace(':', '')}.json",
                             result)
    print(f"written: {path}")
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stop", action="store_true", help="end the run at its first verdict")
    ap.add_argument("--cold-and-warm", action="store_true",
                    help="the command on a new empty cache, then again on it; each figure against its target")
    ap.add_argument("pytest_args", nargs="*", help="pytest arguments (default: make parity's)")
    args = ap.parse_args()
    if args.cold_and_warm:
        result = cold_and_warm(args.pytest_args)
        return 0 if result["cold"]["first_verdict_s"] is not None else 1
    cmd = [sys.executable, "-m", "pytest", *(args.pytest_args or PARITY), "-v"]
    result = timed(cmd, dict(os.environ), stop=args.stop)
    print(json.dumps(result))
    return 0 if result["first_verdict_s"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
