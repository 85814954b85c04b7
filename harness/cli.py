"""`kokoro-parity`: the same items as the pytest plugin, from a shell or CI script.

Only this module knows argparse. It holds the parser alone; `harness.commands` does the work and
is imported once the arguments are parsed, so `--help` is fast.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import options
from .plumbing import stopping
from .plumbing.errors import UsageError
from .quiet import quiet

RUN = (*options.RUN, "step")  # `kokoro-parity run` and `nightly` take pytest's options, and --step for -k


def build_parser() -> argparse.ArgumentParser:
    """The subcommands, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(prog="kokoro-parity", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_item_commands, _matrix_commands, _tool_commands):
        add(sub)
    return parser


def _item_commands(sub) -> None:
    """Items judged: the run, a whole-model file, a port file, one item bisected."""
    p = sub.add_parser("run", help="run (case, step, backend, mode) items and print the summary")
    options.add_argparse(p, RUN)
    sub.add_parser("backends", help="list backends and whether they can run here")
    p = sub.add_parser("check", help="judge a whole-model artifact (tokens, style, speed -> audio) on the cases: "
                                     "audio metrics beside their noise band (docs/own-port.md)")
    p.add_argument("path", help=".onnx, .pte, TVM .so or .mlpackage")
    options.add_argparse(p, (*options.PORTS, "artifact_runtime"))
    p = sub.add_parser("port", help="port files: `port init ARTIFACT...` guesses one, `port check PORT.yaml` "
                                    "validates it (--run: and judges it stage by stage)")
    p.add_argument("action", choices=("init", "check"))
    p.add_argument("paths", nargs="+")
    p.add_argument("--out", type=Path, default=Path("port.yaml"), help="init: where to write (default port.yaml)")
    p.add_argument("--run", action="store_true", help="check: then run the port on the cases")
    p.add_argument("--no-run", action="store_true",
                   help="init: guess by the declared names, ranks and dtypes only; by default each stage runs "
                        "on the first --case (default en_short) and each tensor is mapped by value")
    options.add_argparse(p, options.PORTS)
    p = sub.add_parser("bisect", help="run one item; if it fails, find the first diverging module and op, "
                                      "and write a standalone repro to <report-dir>/repro/<item>/")
    p.add_argument("--case", required=True)
    p.add_argument("--step", required=True)
    p.add_argument("--backend", required=True)
    p.add_argument("--mode", choices=("dynamic", "static"), default="static")
    p.add_argument("--no-verify", action="store_true", help="do not run the written repro.py")
    p.add_argument("--force", action="store_true",
                   help="bisect a passing item too (a clean backend must localize nothing: a check of the rule)")
    options.add_argparse(p, options.BISECT)


def _matrix_commands(sub) -> None:
    """Many items: shards merged, a nightly entry, its dashboard; a profile; the rewrite drift."""
    p = sub.add_parser("merge", help="join the report dirs of several shards (--shard K/N) into one")
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--later-wins", action="store_true",
                   help="an item in several shards is taken from the last one given (a re-run), not refused")
    p = sub.add_parser("profile", help="ExecuTorch's per-operator run time (ETDump, devtools Inspector) of one item's "
                                       ".pte, split into delegated and not; writes <report-dir>/profile/<item>/")
    p.add_argument("--case", required=True)
    p.add_argument("--step", required=True)
    p.add_argument("--backend", required=True, help="an ExecuTorch backend: xnnpack or portable")
    p.add_argument("--mode", choices=("dynamic", "static"), default="static")
    p.add_argument("--repeat", type=int, default=3, help="runs; the first is a warm-up, left out when there are more")
    p.add_argument("--top", type=int, default=15, help="operators printed (the files have all)")
    options.add_argparse(p, ("weights", "report_dir", "with_patch"))
    p = sub.add_parser("drift", help="rewrite drift of the static references (no backend), per case and step")
    options.add_argparse(p, ("case", "step", "weights", "with_patch"),
                         with_patch=dict(help="also measure with this patch (e.g. length_aware_lstm)"))
    p = sub.add_parser("nightly", help="run the matrix into a history entry + JUnit XML; print regressions")
    options.add_argparse(p, RUN)
    p.add_argument("--history-dir", type=Path, help="default: <report-dir>/history")
    p.add_argument("--no-upstream", action="store_true",
                   help="do not re-run docs/upstream/'s repro bundles (by default each one's status is kept)")
    p.add_argument("--junit", type=Path, help="default: <report-dir>/junit/nightly.xml")
    p.add_argument("--factor", type=float, default=2.0, help="an error metric that grew by more is a regression")
    p.add_argument("--dashboard", type=Path, help="then build the dashboard into this directory")
    p.add_argument("--from-records", type=Path, help="run nothing: make the entry from these records "
                                                      "(e.g. shards joined by `kokoro-parity merge`)")
    p = sub.add_parser("dashboard", help="build the static HTML dashboard of the history")
    p.add_argument("--report-dir", default="reports", type=Path)
    p.add_argument("--history-dir", type=Path, help="default: <report-dir>/history")
    p.add_argument("--out", type=Path, help="default: <report-dir>/dashboard")
    p.add_argument("--factor", type=float, default=2.0, help="regression factor for error metrics")


def _tool_commands(sub) -> None:
    """The cache, cases, precision, tables, benchmarks, upstream bundles, the model."""
    p = sub.add_parser("cache", help="show the cache's size, prune it to its limit, or clear it")
    p.add_argument("action", choices=("info", "prune", "clear"), nargs="?", default="info")
    p.add_argument("--max-gb", type=float, help="prune down to this many GiB (default: the cache's limit)")
    p = sub.add_parser("new-case", help="write cases/<id>.yaml from plain text with an offline phonemizer")
    p.add_argument("--id", required=True)
    p.add_argument("--text", required=True)
    p.add_argument("--language", default="en-us", choices=("en-us", "en-gb", "ja"))
    p.add_argument("--voice", default="jf_alpha")
    p.add_argument("--tokens", type=int, help="static bucket: tokens, pads included (default: the smallest "
                                                 "standard bucket that fits)")
    p.add_argument("--frames", type=int, help="static bucket: alignment frames (default: the smallest standard "
                                                 "bucket that fits the reference's durations)")
    p.add_argument("--weights", help="the model whose durations pick the frame bucket (default: the default model)")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", help="where to write (default: $KOKORO_PARITY_CASES, else kokoro_parity_cases in "
                                 "./pyproject.toml, else ./cases)")
    p = sub.add_parser("precision", help="the smallest set of modules to keep in float32 so that the step in "
                                         "float16 is shippable on every case; writes a keep-list and a Core ML op_selector")
    p.add_argument("--case", action="append", help="case id (repeatable; default: all in cases/)")
    p.add_argument("--step", default="decoder", help="a step with an audio or duration output, or e2e (the e2e "
                                                      "item's duration stage and synthesizer; default: decoder)")
    p.add_argument("--keep", action="append", metavar="MODULE[,MODULE]",
                   help="no search: judge this float32 set (KModel module paths; repeatable) on the cases")
    p.add_argument("--from", dest="start", action="append", metavar="MODULE[,MODULE]",
                   help="search on from this float32 set (the one your port ships) instead of from nothing")
    p.add_argument("--mode", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--weights", help="a Kokoro .pth, `hf`, or `random[:seed]` (default: int8-rebuilt v1.0)")
    p.add_argument("--profile", help="tolerance profile YAML (min_pesq, max_mcd_db, max_level_db)")
    p.add_argument("--depth", type=int, default=5, help="module levels below the KModel the audit looks at")
    p.add_argument("--top-k", type=int, default=4, help="candidates tried per greedy round")
    p.add_argument("--native", action="store_true", help="PyTorch's float16 CPU kernels instead of the float16 "
                                                         "emulation (5x slower; an LSTM's recurrence rounds at "
                                                         "every frame there, in one op emulated)")
    p.add_argument("--out", type=Path, default=Path("reports/precision"), help="where the keep-list and op_selector go")
    p = sub.add_parser("table", help="the step x backend table of report dirs' records (Markdown with --markdown)")
    p.add_argument("--report-dir", action="append", type=Path,
                   help="repeatable (default: reports); for an item in several, the last one's record counts")
    p.add_argument("--case", action="append", help="only these cases (repeatable)")
    p.add_argument("--backend", action="append", help="only these backends (repeatable)")
    p.add_argument("--markdown", action="store_true")
    p = sub.add_parser("bench", help="benchmarks/bench.py of a source checkout: cold vs warm, harness vs bare "
                                     "script, per-item figures (arguments are passed on)", add_help=False)
    p = sub.add_parser("upstream", help="regenerate docs/upstream/: one standalone repro bundle per known runtime "
                                        "defect, each run alone (without kokoro or this harness); error if one "
                                        "does not reproduce")
    p.add_argument("--out", type=Path, default=None, help="default: docs/upstream of the checkout")
    p.add_argument("--only", action="append", help="only this defect (repeatable; its directory name)")
    p.add_argument("--check", action="store_true", help="only run the existing bundles' repro.py (nightly's check)")
    p = sub.add_parser("weights", help="load (and on first use rebuild) the model, and describe it")
    p.add_argument("--weights")


def main(argv: list[str] | None = None) -> int:
    quiet()  # torch's warnings about Kokoro's modules are not the user's business
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    previous = stopping.install()  # SIGTERM cleans up as Ctrl-C does (harness.plumbing.stopping)
    try:
        from . import commands  # after parsing (--help stays fast): the harness loads for a command that runs

        return commands.dispatch(args)
    except (UsageError, FileNotFoundError) as e:  # what the user gave; anything else is a bug: its traceback
        print(f"kokoro-parity: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C or a stop signal: what the run held is cleaned up by now
        print(f"kokoro-parity: stopped ({stopping.cause(e)})", file=sys.stderr)
        return stopping.exit_status(e)
    finally:
        stopping.restore(previous)


if __name__ == "__main__":
    sys.exit(main())
