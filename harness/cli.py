"""`kokoro-parity`: the same items as the pytest plugin, from a shell or CI script.

Only this module knows argparse. Heavy imports happen inside the commands, so `--help` is fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", help="backend (repeatable; default: every installed one)")
    p.add_argument("--case", action="append", help="case id (repeatable; default: all in cases/)")
    p.add_argument("--step", action="append", help="step name (repeatable; default: all)")
    p.add_argument("--mode", choices=("dynamic", "static", "both"), default="both")
    p.add_argument("--weights", help="a Kokoro .pth, `hf`, or `random[:seed]` (default: int8-rebuilt v1.0)")
    p.add_argument("--report-dir", default="reports", type=Path)
    p.add_argument("--profile", help="tolerance profile YAML")


def cmd_run(args) -> int:
    from .backends import backend_names, get_backend
    from .report import item_table, summary_table
    from .runner import Session
    from .verdict import Profile

    session = Session(weights=args.weights, case_ids=args.case, report_dir=args.report_dir,
                      profile=Profile.load(args.profile))
    backends = args.backend or [b for b in backend_names() if get_backend(b).available()[0]]
    modes = ("dynamic", "static") if args.mode == "both" else (args.mode,)
    records = []
    for item in session.items(backends, args.step, modes):
        rec = session.run(item)
        records.append(rec)
        print(item_table(rec) if not rec.verdict.ok else f"{rec.item_id}: {rec.verdict.value.upper()}", flush=True)
    print(summary_table(records))
    c = session.counts
    print(f"work: exports {c['exports']}, compiles {c['compiles']}, runs {c['runs']}")
    return 0 if all(r.verdict.ok for r in records) else 1


def cmd_backends(args) -> int:
    from .backends import backend_names, get_backend

    for name in backend_names():
        b = get_backend(name)
        ok, why = b.available()
        print(f"{name:12s} {'available' if ok else 'skipped: ' + why}  ({b.description}; patches: {', '.join(b.patches)})")
    return 0


def cmd_cache(args) -> int:
    from . import cache

    if args.action == "clear":
        cache.clear()
        print(f"cleared {cache.cache_dir()}")
    else:
        print(f"{cache.cache_dir()}: {cache.size_bytes() / 2**20:.1f} MiB")
    return 0


def cmd_new_case(args) -> int:
    from .cases import CASES_DIR, write_case

    path = write_case(Path(args.dir or CASES_DIR), args.id, args.text, args.language, args.voice,
                      args.tokens, args.frames, args.speed, args.seed)
    print(path.read_text())
    return 0


def cmd_weights(args) -> int:
    from .model import load_model

    m = load_model(args.weights)
    n = sum(p.numel() for p in m.kmodel.parameters())
    print(f"model {m.name}: {n / 1e6:.1f} M parameters, digest {m.digest}\nsource: {m.source}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kokoro-parity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="run (case, step, backend, mode) items and print the summary")
    _add_run_options(p)
    p.set_defaults(fn=cmd_run)
    sub.add_parser("backends", help="list backends and whether they can run here").set_defaults(fn=cmd_backends)
    p = sub.add_parser("cache", help="show the cache's size, or clear it")
    p.add_argument("action", choices=("info", "clear"), nargs="?", default="info")
    p.set_defaults(fn=cmd_cache)
    p = sub.add_parser("new-case", help="write cases/<id>.yaml from plain text with an offline phonemizer")
    p.add_argument("--id", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--language", default="en-us", choices=("en-us", "en-gb", "ja"))
    p.add_argument("--voice", default="jf_alpha")
    p.add_argument("--tokens", type=int, required=True, help="static bucket: tokens, pads included")
    p.add_argument("--frames", type=int, required=True, help="static bucket: alignment frames")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="cases directory (default: the repository's cases/)")
    p.set_defaults(fn=cmd_new_case)
    p = sub.add_parser("weights", help="load (and on first use rebuild) the model, and describe it")
    p.add_argument("--weights")
    p.set_defaults(fn=cmd_weights)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"kokoro-parity: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
