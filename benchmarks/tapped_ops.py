"""Every float op of one module, as a backend computes it inside the step: the step's tapped
module-stage program is run once (harness.bisect), then the module's ops alone, fed the backend's own
values of everything before them, each judged against the step's fp32 and fp64 references. Prints
rel_l2, fp32 floor and ratio per op: where a backend's error starts inside a module, without a fault.

    python benchmarks/tapped_ops.py --backend xnnpack --module decoder.generator.m_source
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="xnnpack")
    p.add_argument("--case", default="en_short")
    p.add_argument("--step", default="decoder")
    p.add_argument("--mode", default="dynamic")
    p.add_argument("--module", default="decoder.generator.m_source", help="module path prefix of the ops")
    p.add_argument("--report-dir", type=Path, default=REPO / "reports" / "tapped-ops")
    args = p.parse_args()

    from tabulate import tabulate

    from harness.bisect import Bisector, module_path
    from harness.runner import Item, Session

    session = Session(case_ids=[args.case], report_dir=args.report_dir)
    b = Bisector.for_item(session, Item(args.case, args.step, args.backend, args.mode), depth=2)
    b.module_stage()
    if b.tapped is None:
        print("the tapped module-stage program did not run (see the probe log under the report dir)")
        return 1
    names = [c.name for c in b.float_ops() if module_path(c).startswith(args.module)]
    if not names:
        print(f"no float op under {args.module!r}")
        return 1
    graph = b.graph
    before = [n.name for n in graph.nodes if graph.pos[n.name] < graph.pos[names[0]] and n.op != "get_attr"]
    probe = b.probe("bisect", args.module, names, before, feed=b.tapped.values)
    rows = [[n, str(graph.node[n].target), module_path(graph.node[n])[len(args.module):] or ".",
             *(f"{probe.metrics.get(n, {}).get(k, float('nan')):.3g}" for k in ("rel_l2", "floor_rel_l2", "floor_ratio"))]
            for n in names]
    print(f"{args.backend}, {args.case} {args.step} {args.mode}: the ops of {args.module} (status {probe.status})")
    if not probe.ran:
        print(probe.why, probe.log, sep="\n")
        return 1
    print(tabulate(rows, headers=["node", "op", "module", "rel_l2", "fp32 floor", "ratio"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
