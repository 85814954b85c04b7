"""Time to the first verdict of a pytest run (default: `make parity`'s command), and to its end.

`python benchmarks/first_verdict.py [--stop] [-- PYTEST ARGS]`: runs pytest with `-v` (one line
per verdict), timestamps its output and prints the seconds to the first PASSED / FAILED /
SKIPPED / ERROR line and, unless `--stop` ends the run there, to the end of the run. It measures
what a user waits for, with whatever the cache holds: say which (cold or warm) beside a figure.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARITY = ["--backend=xnnpack", "--backend=eager", "-k", "decoder", "-n", "2", "--reuse-runs"]  # the Makefile's `parity` target
VERDICT = re.compile(r"\b(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stop", action="store_true", help="end the run at its first verdict")
    ap.add_argument("pytest_args", nargs="*", help="pytest arguments (default: make parity's)")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "pytest", *(args.pytest_args or PARITY), "-v"]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    first = None
    first_line = ""
    for line in proc.stdout:
        sys.stdout.write(f"[{time.monotonic() - start:7.1f}] {line}")
        if first is None and "::" in line and VERDICT.search(line):
            first, first_line = time.monotonic() - start, line.strip()
            if args.stop:
                os.killpg(proc.pid, signal.SIGTERM)
                break
    proc.wait()
    result = {"command": " ".join(cmd), "first_verdict_s": first, "first_verdict": first_line,
              "total_s": None if args.stop else time.monotonic() - start}
    print(json.dumps(result))
    return 0 if first is not None else 1


if __name__ == "__main__":
    sys.exit(main())
