"""The `kokoro-parity` subcommands: what each one does once its arguments are parsed.

`harness.cli` holds only the parser and imports this module after parsing, so `--help` does not
wait for torch; everything here is imported at module level.
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from tabulate import tabulate

from . import options, pipeline, progress
from .backends import backend_names, get_backend, set_disabled_workarounds
from .cases import configured_dirs, write_case
from .dashboard import build_dashboard
from .history import nightly, record_run
from .merge import merge_shards
from .metrics import fmt
from .model import load_model
from .plumbing import cache
from .port.init import INIT_CASE, case_values, write_port
from .port.portfile import PortError, load_port
from .precision.islands import patches_for
from .precision.search import search, targets_for, verify, write_keep_list
from .profile import markdown, profile_item
from .record import read_records
from .reference import fitting_bucket, rewrite_drift
from .report import item_table, summary_table, verdict_cell
from .runner import Item, Session
from .upstream import default_dir
from .upstream import main as upstream_main
from .verdict import Profile

def _config(args) -> options.RunConfig:
    return options.RunConfig.from_options(lambda name: getattr(args, name))


def _session(config: options.RunConfig):
    """The Session of these options, its target checked first (an unknown target or a malformed
    targets file is an error before any work)."""

    session = Session.from_config(config)
    _OPENED.append(session)
    session.target_for(config.target)
    return session


_OPENED: list[Session] = []  # the Sessions this command opened: `dispatch` closes them however it ends


def _backends(config: options.RunConfig) -> list[str]:
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
    session = _session(config)
    records = []
    try:
        for item in pipeline.items(session, config, backends):
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
        values, reason = (None, "--no-run") if args.no_run else _init_values(args)
        out = write_port([Path(a) for a in args.paths], args.out, values, reason)
        print(f"wrote {out}: confirm every line marked `# guess: confirm`, then `kokoro-parity port check {out}`")
        return 0

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


def _init_values(args):
    """`port init`'s case (the first --case, default en_short) and its references: (Values, "") or,
    when they cannot be had, (None, why) and the file is guessed by name."""
    case = (args.case or [INIT_CASE])[0]
    config = dataclasses.replace(_config(args), case_ids=(case,))
    session = Session.from_config(config)
    try:
        return case_values(session.traces(case)), ""
    except Exception as e:  # noqa: BLE001 - no weights, no such case: by name, saying why
        why = f"no reference on case {case}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(f"kokoro-parity: warning: {why}; guessing by name", file=sys.stderr)
        return None, why
    finally:
        session.close()


def cmd_bisect(args) -> int:
    """Run one item; if it fails, localize the first diverging module and op, and write a repro."""
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
    history_dir = args.history_dir or args.report_dir / "history"
    if args.from_records:
        result = record_run(args.from_records, history_dir, junit_path=args.junit or args.report_dir / "junit" /
                            "nightly.xml", factor=args.factor, profile=Profile.load(args.profile))
        return _nightly_done(args, result, history_dir)
    config = _config(args)  # the time and memory limits included, as `run` takes them
    session = _session(config)
    backends = _backends(config)
    items = pipeline.items(session, config, backends)
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

    with progress.displayed(progress.for_cli()), progress.item(item.id):
        return pipeline.check(session, item, config.localize, log=_print_line)


def _upstream_dir():
    """docs/upstream of the checkout, when it has bundles (an installed package has none)."""
    return default_dir() if any(default_dir().glob("*/repro.py")) else None


def _nightly_done(args, result, history_dir) -> int:
    for problem in result.problems:
        print(f"history: unreadable file {problem}", file=sys.stderr)
    print(result.summary())
    if args.dashboard:
        print(f"dashboard: {build_dashboard(history_dir, args.dashboard, report_dir=args.report_dir, factor=args.factor)}")
    return 1 if result.regressions else 0


def cmd_dashboard(args) -> int:
    out = build_dashboard(args.history_dir or args.report_dir / "history", args.out or args.report_dir / "dashboard",
                          report_dir=args.report_dir, factor=args.factor)
    print(f"dashboard: {out / 'index.html'}")
    return 0


def cmd_drift(args) -> int:
    """Rewrite drift of the static references, with and without extra patches, per case and step."""


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
    for name in backend_names():
        b = get_backend(name)
        ok, why = b.available()
        print(f"{name:12s} {'available' if ok else 'skipped: ' + why}  ({b.description}; patches: {', '.join(b.patches)})")
        for w in b.workarounds.values():  # harness.backends.Workaround: `--no-workaround NAME` switches it off
            tags = (" (patch)" if w.patch else "") + (" [performance]" if w.kind == "performance" else "")
            print(f"{'':14s}workaround {w.name}{tags}: {w.defect}; {w.runtime}; upstream: {w.upstream}")
    return 0


def cmd_upstream(args) -> int:
    return upstream_main(out=args.out, only=args.only, check_only=args.check)


def cmd_cache(args) -> int:
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
    directory = Path(args.dir or next(iter(configured_dirs()), "cases"))
    directory.mkdir(parents=True, exist_ok=True)
    tokens, frames = args.tokens, args.frames
    if tokens is None or frames is None:  # the smallest standard bucket that fits (one duration-stage run)
        fit = fitting_bucket(load_model(args.weights), args.text, args.language, args.voice, args.speed)
        tokens, frames = tokens or fit.tokens, frames or fit.frames
    path = write_case(directory, args.id, args.text, args.language, args.voice, tokens, frames, args.speed,
                      args.seed)
    print(path.read_text())
    return 0


def cmd_weights(args) -> int:
    m = load_model(args.weights)
    n = sum(p.numel() for p in m.kmodel.parameters())
    print(f"model {m.name}: {n / 1e6:.1f} M parameters, digest {m.digest}\nsource: {m.source}")
    return 0


def cmd_precision(args) -> int:
    """harness.precision: the smallest set of modules to keep in float32 for a shippable float16 step."""


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
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench.py"
    if not script.exists():
        raise FileNotFoundError(f"{script}: `bench` needs a source checkout of kokoro-parity")
    return subprocess.call([sys.executable, str(script), *args.rest])


def dispatch(args) -> int:
    """Run the parsed subcommand (`new-case` -> cmd_new_case), its `--no-workaround` applied first:
    the backends read it here and in their job children."""
    if getattr(args, "no_workaround", None):
        set_disabled_workarounds(args.no_workaround)
    try:
        return globals()[f"cmd_{args.command.replace('-', '_')}"](args)
    finally:  # a remote target's SSH connection and its socket directory, the warm worker
        while _OPENED:
            _OPENED.pop().close()
