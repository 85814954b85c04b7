"""What the op audit costs a compile, computed and kept with the program (harness.backends.audit_of).

`python benchmarks/audit_cost.py PROGRAM.pt2 [--backend xnnpack] [--also portable]`: the audit of
the program computed (CPU and wall seconds: what the first compile of the program pays, beside its
lowering), then read back by a backend that shares it (what every later compile of the program
pays). Works on a copy of the program in a temporary directory; the cache is not touched.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.backends import audit_of, get_backend  # noqa: E402


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("program", type=Path)
    ap.add_argument("--backend", default="xnnpack")
    ap.add_argument("--also", default="portable", help="a backend that shares the audit")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kp-audit-"))
    try:
        program = tmp / "program.pt2"
        shutil.copyfile(args.program, program)
        audits = str(tmp / "audits")
        (audit, computed), wall, cpu = timed(lambda: audit_of(get_backend(args.backend), program, audits))
        (again, kept), wall2, cpu2 = timed(lambda: audit_of(get_backend(args.also), program, audits))
        assert computed is False and kept is True and again == audit
        print(json.dumps({"program": str(args.program), "computed_by": args.backend, "computed_wall_s": wall,
                          "computed_cpu_s": cpu, "read_by": args.also, "read_wall_s": wall2, "read_cpu_s": cpu2,
                          "audit_keys": sorted(audit)}))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
