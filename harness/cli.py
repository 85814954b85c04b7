"""`kokoro-parity`: the same items as the pytest plugin, from a shell or CI script.

Only this module knows argparse. Heavy imports happen inside the commands, so `--help` is fast.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from . import options
from .quiet import quiet


RUN = (*options.RUN, "step")  # `kokoro-parity run` and `nightly` take pytest's options, and --step for -k


def _config(args) -> options.RunConfig:
    return options.RunConfig.from_options(lambda name: getattr(args, name))


def _session(config: options.RunConfig):
    """The Session of these options, its target checked first (an unknown target or a malformed
    targets file is an error before any work)."""
    from .runner import Session

    session = Session.from_config(config)
    session.target_for(config.target)
    return session


def _backends(config: options.RunConfig) -> list[str]:
    from .backends import backend_names, get_backend

    return list(config.backends or [b for b in backend_names() if get_backend(b).available()[0]])


def _print_line(line: str) -> None:
    print(line, flush=True)


def cmd_run(args) -> int:
    """The same items as the pytest plugin, judged (and with --bisect localized) the same way."""
    config = _config(args)
    return _judge(config, _backends(config), summary=True)


def _run_ports(args, specs: list[str]) -> int:
    """Port items (whole-model files, port files) for the chosen cases: one stage table each."""
    return _judge(dataclasses.replace(_config(args), artifacts=(), ports=tuple(specs), modes=("dynamic",)), [], summary=False)


def _judge(config: options.RunConfig, backends: list[str], summary: bool) -> int:
    from .pipeline import items
    from .report import item_table, summary_table, verdict_cell

    session = _session(config)
    records = []
    try:
        for item in items(session, config, backends):
            rec = _shown_check(session, config, item)
            records.append(rec)
            show = not rec.verdict.ok or rec.stages or not summary  # a port's stage table is the answer
            print(item_table(rec) if show else f"{rec.item_id}: {verdict_cell(rec)}", flush=True)
    finally:
        session.close()
    if summary:
        print(summary_table(records))
        c = session.counts
        print(f"work: exports {c['exports']}, compiles {c['compiles']}, runs {c['runs']}"
              + (f" ({c['runs_reused']} more reused)" if c["runs_reused"] else ""))
    return 0 if all(r.verdict.ok for r in records) else 1


def cmd_check(args) -> int:
    """A whole-model artifact (tokens, style, speed -> audio) judged on the cases, without pytest."""
    return _run_ports(args, [f"e2e={args.path}"])


def cmd_port(args) -> int:
    if args.action == "init":
        from .port.init import write_port

        out = write_port([Path(a) for a in args.paths], args.out)
        print(f"wrote {out}: confirm every line marked `# guess: confirm`, then `kokoro-parity port check {out}`")
        return 0
    from .port.portfile import PortError, load_port

    if len(args.paths) != 1:
        print("kokoro-parity: error: `port check` takes one port file", file=sys.stderr)
        return 2
    try:
        port = load_port(args.paths[0])
    except PortError as e:
        print(f"kokoro-parity: error: {e}", file=sys.stderr)
        return 2
    print(f"{port.source}: {len(port.stages)} stage(s) "
          f"({' -> '.join(s.name for s in port.stages)}): valid")
    return _run_ports(args, [args.paths[0]]) if args.run else 0


def cmd_bisect(args) -> int:
    """Run one item; if it fails, localize the first diverging module and op, and write a repro."""
    from .report import item_table
    from .runner import Item

    config = _config(args)
    how = options.Localize(depth=args.bisect_depth, band_from=args.bisect_band_from, verify=not args.no_verify,
                           force=args.force)
    session = _session(config)
    item = Item(args.case, args.step, args.backend, args.mode)
    rec = item.run(session)
    if not item.localizable(rec, how):
        print(item_table(rec))
        print(f"{item.id}: {rec.verdict.value}: nothing to localize")
        return 0 if rec.verdict.ok else 1
    print(f"{item.id}: {rec.verdict.value.upper()} {rec.reason}\nbisecting ...", flush=True)
    item.localize(session, rec, how, _print_line)
    print(item_table(rec))
    return 0 if rec.verdict.ok else 1


def cmd_nightly(args) -> int:
    """The whole matrix (or the selected part) into one history entry, compared with the last one."""
    from .history import nightly
    from .pipeline import items as items_of
    from .verdict import Profile

    history_dir = args.history_dir or args.report_dir / "history"
    if args.from_records:
        from .history import record_run

        result = record_run(args.from_records, history_dir, junit_path=args.junit or args.report_dir / "junit" /
                            "nightly.xml", factor=args.factor, profile=Profile.load(args.profile))
        return _nightly_done(args, result, history_dir)
    config = _config(args)  # the time and memory limits included, as `run` takes them
    session = _session(config)
    backends = _backends(config)
    items = items_of(session, config, backends)
    selection = dict(backends=backends, cases=list(session.cases), steps=args.step or "all", modes=list(config.modes),
                     weights=args.weights, profile=args.profile, with_patch=args.with_patch)
    result = nightly((_shown_check(session, config, item) for item in items), history_dir, n_items=len(items),
                     backends=backends, profile=session.profile, counts=lambda: dict(session.counts),
                     junit_path=args.junit or args.report_dir / "junit" / "nightly.xml",
                     factor=args.factor, selection=selection,
                     on_record=lambda r: print(f"{r.item_id}: {r.verdict.value.upper()}  {r.reason}"[:200], flush=True),
                     upstream_dir=None if args.no_upstream else _upstream_dir())
    for row in result.run.upstream:
        print(f"upstream {row['name']}: {row['status']} (exit {row['exit_code']}) {row['message'][:120]}")
    return _nightly_done(args, result, history_dir)


def _shown_check(session, config: options.RunConfig, item):
    """One item judged (and with --bisect localized) with its phases on stderr (harness.progress):
    a run or a nightly in a CI log says what it is doing and that it is still working."""
    from . import progress
    from .pipeline import check

    with progress.displayed(progress.for_cli()), progress.item(item.id):
        return check(session, item, config.localize, log=_print_line)


def _upstream_dir():
    """docs/upstream of the checkout, when it has bundles (an installed package has none)."""
    from .upstream import default_dir

    return default_dir() if any(default_dir().glob("*/repro.py")) else None


def _nightly_done(args, result, history_dir) -> int:
    for problem in result.problems:
        print(f"history: unreadable file {problem}", file=sys.stderr)
    print(result.summary())
    if args.dashboard:
        from .dashboard import build_dashboard

        print(f"dashboard: {build_dashboard(history_dir, args.dashboard, report_dir=args.report_dir, factor=args.factor)}")
    return 1 if result.regressions else 0


def cmd_dashboard(args) -> int:
    from .dashboard import build_dashboard

    out = build_dashboard(args.history_dir or args.report_dir / "history", args.out or args.report_dir / "dashboard",
                          report_dir=args.report_dir, factor=args.factor)
    print(f"dashboard: {out / 'index.html'}")
    return 0


def cmd_drift(args) -> int:
    """Rewrite drift of the static references, with and without extra patches, per case and step."""
    from tabulate import tabulate

    from .reference import rewrite_drift

    session = _session(_config(args))
    rows = []
    for case_id, case in session.cases.items():
        traces = session.traces(case_id)
        for variant in ((), tuple(args.with_patch)) if args.with_patch else ((),):
            rows += [r for r in rewrite_drift(session.model, case, traces, variant)
                     if not args.step or r["step"] in args.step]
    print(tabulate(rows, headers="keys", floatfmt=".2e"))
    return 0


def cmd_merge(args) -> int:
    """Join several shards' report dirs (records, counts and every file their items wrote) into one."""
    from .merge import merge_shards

    result = merge_shards(args.dirs, args.out, later_wins=args.later_wins)
    for shard in result.shards:
        print(f"{shard.path}: {len(shard.records)} records, {len(shard.files)} files")
    for path, items in result.superseded.items():
        print(f"{path}: left out {len(items)} items a later shard re-ran: {', '.join(items)}")
    for path, items in result.dropped.items():
        print(f"{path}: left out the leftovers of {', '.join(items)} (killed there; another shard has the record)")
    print(f"merged {result.n_records} records and {result.n_files} files into {result.out}")
    return 0


def cmd_profile(args) -> int:
    """ExecuTorch's own per-operator profile (ETDump) of one item's .pte: delegated vs not."""
    from .profile import markdown, profile_item
    from .runner import Item

    session = _session(dataclasses.replace(_config(args), case_ids=(args.case,)))
    try:
        table, out = profile_item(session, Item(args.case, args.step, args.backend, args.mode), repeat=args.repeat)
    except RuntimeError as e:  # the item did not compile, or the profiled run failed: the reason, not a traceback
        print(f"kokoro-parity: profile: {e}", file=sys.stderr)
        return 1
    print(markdown(table, top=args.top))
    print(f"profile: {out / 'operators.md'}, {out / 'operators.csv'}, ETDump {out / 'etdump.etdp'}")
    return 0


def cmd_backends(args) -> int:
    from .backends import backend_names, get_backend

    for name in backend_names():
        b = get_backend(name)
        ok, why = b.available()
        print(f"{name:12s} {'available' if ok else 'skipped: ' + why}  ({b.description}; patches: {', '.join(b.patches)})")
        for w in b.workarounds.values():  # harness.backends.Workaround: `--no-workaround NAME` switches it off
            tags = (" (patch)" if w.patch else "") + (" [performance]" if w.kind == "performance" else "")
            print(f"{'':14s}workaround {w.name}{tags}: {w.defect}; {w.runtime}; upstream: {w.upstream}")
    return 0


def cmd_upstream(args) -> int:
    from .upstream import main as upstream_main

    return upstream_main(out=args.out, only=args.only, check_only=args.check)


def cmd_cache(args) -> int:
    from .plumbing import cache

    gib = 2**30
    if args.action == "clear":
        cache.clear()
        print(f"cleared {cache.cache_dir()}")
    elif args.action == "prune":
        limit = None if args.max_gb is None else int(args.max_gb * gib)
        result = cache.prune(limit)
        print(f"removed {len(result.removed)} entries ({result.freed_bytes / gib:.2f} GiB); "
              f"{result.size_bytes / gib:.2f} GiB left, limit {result.limit_bytes / gib:.1f} GiB")
    else:
        sizes = cache.sizes_by_kind()
        for kind, size in sizes.items():
            print(f"  {kind:12s} {size / gib:8.2f} GiB")
        print(f"{cache.cache_dir()}: {sum(sizes.values()) / gib:.2f} GiB, limit {cache.max_bytes() / gib:.1f} GiB "
              f"(${cache.MAX_GB_ENV}); least recently used entries go first")
    return 0


def cmd_new_case(args) -> int:
    """A phonemized case in your cases directory (--dir, else the configured one, else ./cases)."""
    from .cases import configured_dirs, write_case

    directory = Path(args.dir or next(iter(configured_dirs()), "cases"))
    directory.mkdir(parents=True, exist_ok=True)
    tokens, frames = args.tokens, args.frames
    if tokens is None or frames is None:  # the smallest standard bucket that fits (one duration-stage run)
        from .model import load_model
        from .reference import fitting_bucket

        fit = fitting_bucket(load_model(args.weights), args.text, args.language, args.voice, args.speed)
        tokens, frames = tokens or fit.tokens, frames or fit.frames
    path = write_case(directory, args.id, args.text, args.language, args.voice, tokens, frames, args.speed,
                      args.seed)
    print(path.read_text())
    return 0


def cmd_weights(args) -> int:
    from .model import load_model

    m = load_model(args.weights)
    n = sum(p.numel() for p in m.kmodel.parameters())
    print(f"model {m.name}: {n / 1e6:.1f} M parameters, digest {m.digest}\nsource: {m.source}")
    return 0


def cmd_precision(args) -> int:
    """harness.precision: the smallest set of modules to keep in float32 for a shippable float16 step."""
    from tabulate import tabulate

    from .metrics import fmt
    from .model import load_model
    from .precision.islands import patches_for
    from .precision.search import search, targets_for, verify, write_keep_list
    from .verdict import Profile

    model = load_model(args.weights)
    tol = Profile.load(args.profile).for_(args.step, "fp16", args.mode)
    targets = targets_for(model, args.case, args.step, args.mode)
    log = lambda line: print(line, flush=True)  # noqa: E731
    keep = [m for k in args.keep or () for m in k.split(",") if m]
    result = (verify(targets, keep, tol, emulate=not args.native, log=log) if keep else
              search(targets, tol, depth=args.depth, top_k=args.top_k, emulate=not args.native, log=log,
                     start=[m for k in args.start or () for m in k.split(",") if m]))
    rows = []
    for b, a in zip(result.before, result.after):
        for name, m in a.metrics.items():
            mb = b.metrics[name]
            rows.append([b.case, name, *(fmt(mb.get(k)) for k in ("rel_l2", "pesq", "mcd_db", "rms_ratio_db")),
                         "yes" if b.shippable else "no",
                         *(fmt(m.get(k)) for k in ("rel_l2", "pesq", "mcd_db", "rms_ratio_db")), "yes" if a.shippable else "no"])
    print(tabulate(rows, headers=["case", "output", "rel_l2", "PESQ", "MCD dB", "level dB", "shippable",
                                  "kept: rel_l2", "PESQ", "MCD dB", "level dB", "shippable"], tablefmt="simple"))
    sh = result.share
    flops = f", {sh['flops_share']:.2%} of its FLOPs" if "flops_share" in sh else ""
    print(f"float32 set for {args.step} ({', '.join(result.cases)}{', given' if keep else ''}): "
          f"{', '.join(result.keep) or 'none'}: "
          f"{sh['params_share']:.2%} of the step's parameters{flops}; "
          f"{'shippable on every case' if result.reached else 'NOT shippable on every case'} ({result.seconds} s)")
    paths = write_keep_list(result, args.out)
    with_patch = "".join(f" --with-patch {p}" for p in patches_for(result.keep))
    print(f"keep-list: {paths['keep_list']}  (KOKORO_PARITY_KEEP_FP32={paths['keep_list']} pytest --backend=fp16 "
          f"--backend=coreml-fp16{with_patch} -k {args.step})")
    print(f"Core ML op_selector: {paths['op_selector']}")
    return 0 if result.reached else 1


def cmd_table(args) -> int:
    from .record import read_records
    from .report import summary_table

    records = {}  # item id -> record; a later report dir's record of an item replaces an earlier one
    for d in args.report_dir or [Path("reports")]:
        found = read_records(d / "records")
        if not found:
            raise FileNotFoundError(f"{d / 'records'}: no records")
        records.update((r.item_id, r) for r in found
                       if (not args.case or r.case in args.case) and (not args.backend or r.backend in args.backend))
    print(summary_table(list(records.values()), "github" if args.markdown else "simple"))
    return 0


def cmd_bench(args) -> int:
    """The benchmarks live beside the package in a checkout (they time pytest runs of it)."""
    import subprocess

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not script.exists():
        raise FileNotFoundError(f"{script}: `bench` needs a source checkout of kokoro-parity")
    return subprocess.call([sys.executable, str(script), *args.rest])


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
    p.set_defaults(fn=cmd_run)
    sub.add_parser("backends", help="list backends and whether they can run here").set_defaults(fn=cmd_backends)
    p = sub.add_parser("check", help="judge a whole-model artifact (tokens, style, speed -> audio) on the cases: "
                                     "audio metrics beside their noise band (docs/own-port.md)")
    p.add_argument("path", help=".onnx, .pte, TVM .so or .mlpackage")
    options.add_argparse(p, options.PORTS)
    p.set_defaults(fn=cmd_check)
    p = sub.add_parser("port", help="port files: `port init ARTIFACT...` guesses one, `port check PORT.yaml` "
                                    "validates it (--run: and judges it stage by stage)")
    p.add_argument("action", choices=("init", "check"))
    p.add_argument("paths", nargs="+")
    p.add_argument("--out", type=Path, default=Path("port.yaml"), help="init: where to write (default port.yaml)")
    p.add_argument("--run", action="store_true", help="check: then run the port on the cases")
    options.add_argparse(p, options.PORTS)
    p.set_defaults(fn=cmd_port)
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
    p.set_defaults(fn=cmd_bisect)


def _matrix_commands(sub) -> None:
    """Many items: shards merged, a nightly entry, its dashboard; a profile; the rewrite drift."""
    p = sub.add_parser("merge", help="join the report dirs of several shards (--shard K/N) into one")
    p.add_argument("dirs", nargs="+", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--later-wins", action="store_true",
                   help="an item in several shards is taken from the last one given (a re-run), not refused")
    p.set_defaults(fn=cmd_merge)
    p = sub.add_parser("profile", help="ExecuTorch's per-operator run time (ETDump, devtools Inspector) of one item's "
                                       ".pte, split into delegated and not; writes <report-dir>/profile/<item>/")
    p.add_argument("--case", required=True)
    p.add_argument("--step", required=True)
    p.add_argument("--backend", required=True, help="an ExecuTorch backend: xnnpack or portable")
    p.add_argument("--mode", choices=("dynamic", "static"), default="static")
    p.add_argument("--repeat", type=int, default=3, help="runs; the first is a warm-up, left out when there are more")
    p.add_argument("--top", type=int, default=15, help="operators printed (the files have all)")
    options.add_argparse(p, ("weights", "report_dir", "with_patch"))
    p.set_defaults(fn=cmd_profile)
    p = sub.add_parser("drift", help="rewrite drift of the static references (no backend), per case and step")
    options.add_argparse(p, ("case", "step", "weights", "with_patch"),
                         with_patch=dict(help="also measure with this patch (e.g. length_aware_lstm)"))
    p.set_defaults(fn=cmd_drift)
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
    p.set_defaults(fn=cmd_nightly)
    p = sub.add_parser("dashboard", help="build the static HTML dashboard of the history")
    p.add_argument("--report-dir", default="reports", type=Path)
    p.add_argument("--history-dir", type=Path, help="default: <report-dir>/history")
    p.add_argument("--out", type=Path, help="default: <report-dir>/dashboard")
    p.add_argument("--factor", type=float, default=2.0, help="regression factor for error metrics")
    p.set_defaults(fn=cmd_dashboard)


def _tool_commands(sub) -> None:
    """The cache, cases, precision, tables, benchmarks, upstream bundles, the model."""
    p = sub.add_parser("cache", help="show the cache's size, prune it to its limit, or clear it")
    p.add_argument("action", choices=("info", "prune", "clear"), nargs="?", default="info")
    p.add_argument("--max-gb", type=float, help="prune down to this many GiB (default: the cache's limit)")
    p.set_defaults(fn=cmd_cache)
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
    p.set_defaults(fn=cmd_new_case)
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
    p.set_defaults(fn=cmd_precision)
    p = sub.add_parser("table", help="the step x backend table of report dirs' records (Markdown with --markdown)")
    p.add_argument("--report-dir", action="append", type=Path,
                   help="repeatable (default: reports); for an item in several, the last one's record counts")
    p.add_argument("--case", action="append", help="only these cases (repeatable)")
    p.add_argument("--backend", action="append", help="only these backends (repeatable)")
    p.add_argument("--markdown", action="store_true")
    p.set_defaults(fn=cmd_table)
    p = sub.add_parser("bench", help="benchmarks/bench.py of a source checkout: cold vs warm, harness vs bare "
                                     "script, per-item figures (arguments are passed on)", add_help=False)
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("upstream", help="regenerate docs/upstream/: one standalone repro bundle per known runtime "
                                        "defect, each run alone (without kokoro or this harness); error if one "
                                        "does not reproduce")
    p.add_argument("--out", type=Path, default=None, help="default: docs/upstream of the checkout")
    p.add_argument("--only", action="append", help="only this defect (repeatable; its directory name)")
    p.add_argument("--check", action="store_true", help="only run the existing bundles' repro.py (nightly's check)")
    p.set_defaults(fn=cmd_upstream)
    p = sub.add_parser("weights", help="load (and on first use rebuild) the model, and describe it")
    p.add_argument("--weights")
    p.set_defaults(fn=cmd_weights)


def main(argv: list[str] | None = None) -> int:
    quiet()  # torch's warnings about Kokoro's modules are not the user's business
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    args.rest = rest
    try:
        if getattr(args, "no_workaround", None):  # read by the backends here and in their job children
            from .backends import set_disabled_workarounds

            set_disabled_workarounds(args.no_workaround)
        return args.fn(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"kokoro-parity: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
