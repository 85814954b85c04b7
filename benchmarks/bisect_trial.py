"""Bisection trial on a compiling backend: seeded random faults, each named exactly or not.

For each of N seeded random float nodes of a module (default: the decoder's generator), the test
backend `faulty-<backend>` (tests/unit/faulty_backend.py: the real backend with that one node
corrupted before lowering) runs the item; a fault that fails the item is bisected, and the table
says whether the named node is the injected one, with the compiles and the wall time it took.
A fault that leaves the item inside its floor is "nothing to localize" (right). `--clean` bisects
the clean backend by force: it must localize nothing.

    python benchmarks/bisect_trial.py --backend xnnpack --case en_short --mode dynamic --faults 10
    python benchmarks/bisect_trial.py --backend xnnpack --case en_short --mode dynamic --clean
    python benchmarks/bisect_trial.py --backend xnnpack --faults 10 --band-from xnnpack   # with a band
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
from tests.unit.faulty_backend import BASES, EXTRA  # noqa: E402

os.environ.setdefault("KOKORO_PARITY_EXTRA_BACKENDS", EXTRA)

from harness.plumbing.files import atomic_write_json  # noqa: E402

FAULT_ENV = "KOKORO_PARITY_FAULT"


def pick_nodes(session, item, prefix: str, n: int, seed: int) -> list[tuple[str, str, str]]:
    """(node, op, module) of n seeded random float ops whose module path starts with `prefix`."""
    from harness.backends import get_backend
    from harness.bisect.graph import StepGraph, is_float, module_path
    from harness.programs import ensure_program

    backend = get_backend(item.backend)
    inputs = session.traces(item.case).inputs(item.step, item.mode, "float32")
    entry, _, _ = ensure_program(session.weights, session.model.digest, item.step, inputs,
                                 session.patches_for(backend), session.limits.export_s, session.counts)
    graph = StepGraph(entry / "program.pt2", list(inputs.values()))
    cands = [(x.name, str(x.target), module_path(x)) for x in graph.nodes
             if x.op == "call_function" and is_float(x) and module_path(x).startswith(prefix)]
    return random.Random(seed).sample(cands, min(n, len(cands)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="xnnpack", choices=tuple(BASES))
    p.add_argument("--case", default="en_short")
    p.add_argument("--mode", default="dynamic")
    p.add_argument("--step", default="decoder")
    p.add_argument("--module", default="decoder.generator", help="faults go into nodes under this module path")
    p.add_argument("--faults", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default="nan,sign,scale", help="fault kinds, cycled over the nodes")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--clean", action="store_true", help="bisect the clean backend by force instead")
    p.add_argument("--report-dir", type=Path, default=REPO / "reports" / "bisect-trial")
    p.add_argument("--with-patch", action="append", default=[])
    p.add_argument("--band-from", help="bisect against this backend's values (e.g. the clean --backend)")
    args = p.parse_args()

    from harness.bisect import bisect_item
    from harness.runner import Item, Session

    session = Session(case_ids=[args.case], report_dir=args.report_dir, extra_patches=tuple(args.with_patch))
    item = Item(args.case, args.step, f"faulty-{args.backend}", args.mode)
    faults = [None] if args.clean else pick_nodes(session, item, args.module, args.faults, args.seed)
    kinds = args.kinds.split(",")
    rows = []
    for i, fault in enumerate(faults):
        spec = "" if fault is None else f"node={fault[0]},kind={kinds[i % len(kinds)]}"
        os.environ[FAULT_ENV] = spec
        start = time.monotonic()
        rec = session.run(item)
        row = {"fault": spec or "none", "op": fault[1] if fault else "", "module": fault[2] if fault else "",
               "item": rec.verdict.value}
        if rec.verdict.value == "pass" and not args.clean:
            row.update(result="nothing to localize (item inside its floor)")
        else:
            b = bisect_item(session, item, rec, depth=args.depth, verify=False,
                            log=lambda line: print(line, flush=True), band_from=args.band_from)
            named = (b.get("first_op") or {}).get("node")
            row.update(named=named, named_module=(b.get("first_op") or {}).get("module"),
                       first_module=b.get("first_module"), compiles=b.get("compiles"), bisect_s=b.get("seconds"),
                       probe_failures=len(b.get("probe_failures") or []),
                       result=("localized nothing" if named is None else
                               "exact" if fault and named == fault[0] else "WRONG"))
        row["seconds"] = round(time.monotonic() - start, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.environ.pop(FAULT_ENV, None)
    from tabulate import tabulate

    print(tabulate(rows, headers="keys", tablefmt="github"))
    atomic_write_json(args.report_dir / "trial.json", rows)
    return 0 if all(r["result"] in ("exact", "nothing to localize (item inside its floor)", "localized nothing")
                    for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
