"""The examples' export command (`examples/kokoro-*/export.py`): a split of Kokoro exported to ONNX
(harness.port.splits) or converted to Core ML (harness.port.coreml_splits), with its port file. A module
of its own so that the two formats' modules do not import each other.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from .splits import CONV_POST, DEFECT_KINDS, HAR, export_split, parse_defect
from ..reference import module_captures
from ..runner import Session
from .coreml_splits import convert_split, parse_precisions, workarounds_off
from ..plumbing.errors import UsageError


def main(split: str, out: Path, argv=None) -> None:
    """The examples' command line: `export.py --case ja [--weights W] [--out DIR] [--defect S=gain:1.1]
    [--format coreml [--precision STAGE=float16] [--no-workaround NAME]]`. Exits 1 when coremltools
    cannot convert a stage (harness/port/coreml_splits.py)."""
    p = argparse.ArgumentParser(description=f"Export Kokoro's {split} split to ONNX (or convert it to Core ML) "
                                            f"and write its port file.")
    p.add_argument("--case", required=True)
    p.add_argument("--weights", default=None, help="default: the default model (see README)")
    p.add_argument("--out", type=Path, default=out, help=f"default: {out}")
    p.add_argument("--defect", default=None, help=f"{DEFECT_KINDS}: export one stage with a known defect")
    p.add_argument("--format", choices=("onnx", "coreml"), default="onnx",
                   help="onnx: <stage>.onnx and port.yaml; coreml: <stage>.mlpackage (coremltools mlprogram, "
                        "the case's exact shapes) and port-coreml.yaml")
    p.add_argument("--precision", action="append", metavar="STAGE=float32|float16",
                   help="Core ML compute precision of a stage (repeatable); default: the public port's "
                        "(harness/port/coreml_splits.py PUBLIC_PRECISIONS), else float32")
    p.add_argument("--no-workaround", action="append", metavar="NAME",
                   help="Core ML: leave out one of the coreml backends' graph fixes (docs/workarounds.md), so "
                        "that the converter's gap it closes shows (repeatable; `all`)")
    args = p.parse_args(argv)


    try:
        defect = parse_defect(args.defect, split)
        if (args.precision or args.no_workaround) and args.format != "coreml":
            raise UsageError("--precision, --no-workaround: only with --format coreml")
        if args.format == "coreml":
            precisions = parse_precisions(args.precision, split)
            disabled = set(args.no_workaround) if args.no_workaround else None
            workarounds_off(disabled)  # an unknown name: a usage error before any work
    except UsageError as e:
        p.error(str(e))
    session = Session(weights=args.weights, case_ids=[args.case])
    traces = session.traces(args.case)
    module_captures(session.model, session.cases[args.case], traces, (HAR, CONV_POST))
    if args.format == "coreml":
        port, results = convert_split(split, session.model, traces, args.out, precisions, defect,
                                      disabled=disabled)
        if port is None:
            raise SystemExit(f"coremltools could not convert {sum(not r.ok for r in results)} stage(s) of {split} "
                             f"(above); no port file written")
    else:
        port = export_split(split, session.model, traces, args.out, defect)
    print(f"wrote {port}: pytest --port {port} --case {args.case}")
