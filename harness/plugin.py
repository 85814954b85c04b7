"""The pytest plugin: one test item per (case, step, backend, mode), ids `case-step-backend-mode`
so that `-k decoder`, `-k xnnpack` and `-k "decoder and static"` select what a user expects.

Registered through the `pytest11` entry point. It is the only module that imports pytest.
"""
from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from _pytest.config.findpaths import locate_config

from . import options, pipeline, progress
from .backends import backend_names, get_backend, set_disabled_workarounds
from .cases import CaseError
from .golden import GOLDEN_DIR, GoldenError, GoldenStore
from .plumbing import stopping
from .plumbing.errors import UsageError
from .plumbing.files import atomic_write_json
from .plumbing.targets import TargetError, get_target
from .quiet import quiet_logs
from .record import Record, read_records
from .report import item_table, summary_table, verdict_cell
from .runner import Session
from .verdict import Verdict


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kokoro-parity")
    options.add_pytest(g, options.RUN)  # the same options, spelled the same, as `kokoro-parity run`
    g.addoption("--golden-dir", default=None, metavar="DIR",
                help="your golden store (read first, written by --update-golden); ini: kokoro_parity_golden")
    parser.addini("kokoro_parity_cases", "directories of your own cases (relative to the ini file)", type="paths",
                  default=[])
    parser.addini("kokoro_parity_golden", "your golden store directory (relative to the ini file)", type="paths",
                  default=[])
    g.addoption("--update-golden", action="store_true",
                help="regenerate the golden store (--golden-dir, else the shipped one) from the current references")
    g.addoption("--shard", default=None, metavar="K/N",
                help="run the K-th of N shards (1-based); items that share a compile stay together. "
                     "Join the shards' report dirs with `kokoro-parity merge`.")


PATH_OPTIONS = ("--report-dir", "--weights", "--profile", "--targets-file", "--port", "--etrecord")


def _check_rootdir_kept(config: pytest.Config) -> None:
    """pytest chooses its rootdir and ini file before plugins register their options, so in
    `--report-dir /tmp/x` it takes an existing /tmp/x for a test path: the ini file is then looked
    for from /tmp/x, the project's pytest configuration is lost and every test under the current
    directory gets collected. Refuse that with the fix, rather than running the unit tests as
    parity items. The test is on the ini file itself, not on where the rootdir landed: a checkout
    and a report dir under one scratch directory share an ancestor that looks like a project."""
    if getattr(config.option, "inifilename", None):  # `-c FILE`: the user chose the configuration
        return
    cwd = config.invocation_params.dir
    expected, has_config = _pytest_ini(cwd)
    if not has_config or _same_file(config.inipath, expected):
        return
    args = list(config.invocation_params.args)
    for option, value in zip(args, args[1:]):
        path = cwd / value
        if option in PATH_OPTIONS and path.exists() and _same_file(_pytest_ini(path)[0], config.inipath):
            raise pytest.UsageError(
                f"`{option} {value}`: pytest read the existing path {value} as a test path before "
                f"kokoro-parity's options were known, and took {config.rootpath} as its rootdir instead of "
                f"this project's configuration ({expected}). Write `{option}={value}`.")


def _pytest_ini(path: Path) -> tuple[Path | None, bool]:
    """The file pytest looks to for its configuration from `path` (its own lookup, upwards), and
    whether that file holds any."""
    found = locate_config(path, [path])
    return found[1], bool(found[2])


def _same_file(a: Path | None, b: Path | None) -> bool:
    return a == b if a is None or b is None else a.resolve() == b.resolve()


SESSION_KEY = pytest.StashKey()  # the runner.Session of this pytest process
SIGNALS_KEY = pytest.StashKey()  # the stop signals' handlers before this plugin's (harness.plumbing.stopping)
RECORDS_KEY = pytest.StashKey()  # the records this process made
RAN_KEY = pytest.StashKey()  # ids of the parity items that ran (controller and workers)
VERDICT_LINE = "kokoro_parity_verdict"  # the user property that carries an item's verdict line to the reporter


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """Under `pytest -n N`, distribute by group (items that share a compile stay on one worker).
    SIGTERM stops this process as Ctrl-C does: an item's temporary files removed, its record kept."""
    quiet_logs()
    config.stash[SIGNALS_KEY] = stopping.install()
    config.pluginmanager.register(_RanItems(config), "kokoro-parity-ran-items")
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(_VerdictLines(config), "kokoro-parity-verdict-lines")
        _check_rootdir_kept(config)
        if getattr(config.option, "target", "local") != "local":  # a bad target or targets file: a usage error now
            try:
                get_target(config.option.target, config.option.targets_file)
            except TargetError as e:
                raise pytest.UsageError(str(e)) from None
    if getattr(config.option, "no_workaround", None):  # read by the backends here and in their job children
        try:
            set_disabled_workarounds(config.option.no_workaround)
        except UsageError as e:
            raise pytest.UsageError(str(e)) from None
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") in ("no", "load"):
        config.option.dist = "loadgroup"


def pytest_unconfigure(config: pytest.Config) -> None:
    stopping.restore(config.stash.get(SIGNALS_KEY, {}))


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller (or a plain run) starts afresh
        for p in (Path(session.config.getoption("--report-dir")) / "counts").glob("*.json"):
            p.unlink()

    progress.set_display(_progress_display(session.config))
    progress.set_say(_say_uncaptured(session.config))
    _session(session.config)  # a bad case or target: one usage error (exit 4) before collection



def _say_uncaptured(config: pytest.Config):
    """A line on stderr past pytest's capture (a device target's URL: the user must open it)."""
    capman = config.pluginmanager.get_plugin("capturemanager")
    uncaptured = capman.global_and_fixture_disabled if capman is not None else contextlib.nullcontext

    def say(line: str) -> None:
        with uncaptured():
            print(line, file=sys.stderr, flush=True)

    return say


def _progress_display(config: pytest.Config):
    """How this process shows what the harness is doing (harness.progress): nothing with `-q` or
    without pytest's terminal reporter (`-p no:terminal`); plain lines on stderr from an xdist
    worker (it has no terminal of its own: it must not draw); one updating line inside pytest's
    own on a terminal that takes escape codes; plain lines otherwise (CI logs, pipes)."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or getattr(config.option, "verbose", 0) < 0:
        return None
    capman = config.pluginmanager.get_plugin("capturemanager")
    uncaptured = capman.global_and_fixture_disabled if capman is not None else contextlib.nullcontext
    if hasattr(config, "workerinput"):
        def to_stderr(line: str) -> None:
            with uncaptured():
                print(line, file=sys.stderr, flush=True)

        return progress.PlainLines(to_stderr, prefix=f"kokoro-parity [{config.workerinput['workerid']}]: ")
    if tr.isatty and tr.hasmarkup:
        line = _PytestLine(tr._tw, uncaptured)
        return progress.UpdatingLine(line.draw, line.erase)

    def write_line(text: str) -> None:
        with uncaptured():
            tr.write_line(text)

    return progress.PlainLines(write_line)


class _PytestLine:
    """The updating line drawn into pytest's current line: after what pytest wrote there (the
    file's dots, or the item's id with -v) when that leaves room, over it when not (and then put
    back, uncoloured). Escape codes save the cursor where pytest left it, so pytest's own output
    goes on exactly where it was."""

    MIN_ROOM = 40  # columns the status needs to say something useful after pytest's text

    def __init__(self, tw, uncaptured) -> None:
        self.tw, self.uncaptured = tw, uncaptured
        self.drawn = False
        self.prefix = ""  # pytest's text on the line, redrawn after an overwrite (over mode)
        self.over = False
        self.room = 0  # columns the status may use

    def draw(self, text: str) -> None:
        with self.uncaptured():
            if not self.drawn:
                self.prefix = getattr(self.tw, "_current_line", "")
                room = self.tw.fullwidth - self.tw.width_of_current_line - 2
                self.over = room < self.MIN_ROOM
                self.tw.write_raw("\r" if self.over else "\x1b7 ")  # over: the line's start; else save the cursor
                self.drawn = True
                self.room = self.tw.fullwidth - 1 if self.over else room
            home = "\r" if self.over else "\x1b8 "
            self.tw.write_raw(f"{home}\x1b[K{text[:self.room]}", flush=True)

    def erase(self) -> None:
        if not self.drawn:
            return
        with self.uncaptured():
            self.tw.write_raw(f"\r\x1b[K{self.prefix}" if self.over else "\x1b8\x1b[K", flush=True)
        self.drawn = False


CONFIG_KEY = pytest.StashKey()  # this run's options.RunConfig


def run_config(config: pytest.Config) -> options.RunConfig:
    """This run's options, read once (harness.options: the same table as the CLI's)."""
    if CONFIG_KEY not in config.stash:
        config.stash[CONFIG_KEY] = options.RunConfig.from_options(
            config.getoption, extra_cases_dirs=config.getini("kokoro_parity_cases"))
    return config.stash[CONFIG_KEY]


def _session(config: pytest.Config):
    s = config.stash.get(SESSION_KEY, None)
    if s is None:
        s = Session.from_config(run_config(config))

        try:
            s.target_for(s.target)  # an unknown target or a malformed targets file: a usage error now
            s.cases  # a bad case (file, field, voice, vocabulary, bucket): one usage error before any work
        except (TargetError, CaseError) as e:
            raise pytest.UsageError(str(e)) from None
        config.stash[SESSION_KEY] = s
        config.stash[RECORDS_KEY] = []
    return s


def _backends(config: pytest.Config) -> list[str]:
    chosen = config.getoption("--backend")
    if chosen:
        for name in chosen:
            get_backend(name)  # unknown name: a usage error now, not a skip later
        return chosen
    return [b for b in backend_names() if get_backend(b).available()[0]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The run's items, made by `pipeline.items` as `kokoro-parity run` makes them."""
    config = metafunc.config
    modes = run_config(config).modes
    if "parity_item" in metafunc.fixturenames:
        try:
            items = pipeline.items(_session(config), run_config(config), _backends(config))
        except (UsageError, FileNotFoundError) as e:  # any other exception is the harness's: its traceback
            raise pytest.UsageError(str(e)) from None
        metafunc.parametrize("parity_item", items, ids=[i.id for i in items])
    if "golden_key" in metafunc.fixturenames:
        keys = [(c, m) for c in _session(config).cases for m in modes]
        metafunc.parametrize("golden_key", keys, ids=[f"{c}-{m}-golden" for c, m in keys])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark parity items; group those that share a program (xdist `--dist loadgroup` keeps a group
    on one worker, so nothing compiles twice); keep only this shard's groups with --shard."""
    groups = {}
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is None:
            continue
        if "parity_item" in callspec.params:
            groups[item.nodeid] = _group(config, callspec.params["parity_item"])
        elif "golden_key" in callspec.params:
            groups[item.nodeid] = f"golden:{callspec.params['golden_key'][0]}"
        else:
            continue
        item.add_marker(pytest.mark.parity)
        item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    if groups:
        items.sort(key=lambda it: (_case_length(config, it), _not_control(it)))  # stable otherwise
    else:  # no parity item here (this repository's unit tests): their Sessions' phases are not news
        progress.set_display(None)
        progress.set_say(None)
    shard = config.getoption("--shard")
    if shard:
        k, n = _parse_shard(shard)
        order = sorted(set(groups.values()))
        mine = {g for i, g in enumerate(order) if i % n == k - 1}
        keep = [it for it in items if groups.get(it.nodeid) in mine]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep


def _case_length(config: pytest.Config, item: pytest.Item) -> tuple[int, int, int]:
    """Shortest case first, so that the first verdict comes after the short case's references and
    lowerings, not after en_long's (a cold `make parity` was silent for 15 minutes). Items that
    are not parity items sort first and keep their order."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    case_id = (params["parity_item"].case if "parity_item" in params
               else params["golden_key"][0] if "golden_key" in params else None)
    case = _session(config).cases.get(case_id) if case_id else None
    if case is None:
        return (0, 0, 0)
    return (len(case.phonemes), case.bucket.tokens, case.bucket.frames)


def _not_control(item: pytest.Item) -> bool:
    """Within a case the eager control comes first: its verdict (seconds, no lowering) says the
    references and the pipeline hold before a backend's lowering takes minutes, and it is the
    first verdict a cold `make parity` prints."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return "parity_item" in params and params["parity_item"].backend != "eager"


def _group(config: pytest.Config, item) -> str:
    """Items that share an exported program: same step, mode and shapes (the bucket when static)."""
    if item.mode == "dynamic" or item.step == "e2e" or item.step.startswith("port:"):
        return f"{item.step}:{item.mode}:{item.case}"
    bucket = _session(config).cases[item.case].bucket
    return f"{item.step}:{item.mode}:{bucket.tokens}x{bucket.frames}"


def _parse_shard(text: str) -> tuple[int, int]:
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise pytest.UsageError(f"--shard {text!r}: expected K/N, e.g. 1/2") from None
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {text!r}: K must be between 1 and N")
    return k, n


@pytest.fixture
def parity_session(request: pytest.FixtureRequest):
    return _session(request.config)


@pytest.fixture
def check_parity(request: pytest.FixtureRequest):
    """Run one item and turn its record into a pytest outcome with a metric table, not a traceback."""
    def check(item) -> Record:
        with progress.item(item.id):
            rec = pipeline.check(_session(request.config), item, run_config(request.config).localize)
        request.config.stash[RECORDS_KEY].append(rec)
        request.node.user_properties.append((VERDICT_LINE, f"{rec.item_id}: {verdict_cell(rec)}"))
        if rec.verdict is Verdict.SKIPPED:
            pytest.skip(rec.reason)
        if rec.verdict is not Verdict.PASS:
            pytest.fail(item_table(rec), pytrace=False)
        return rec

    return check


@pytest.fixture
def check_golden(request: pytest.FixtureRequest):
    def check(case_id: str, mode: str) -> None:

        session = _session(request.config)
        with progress.item(f"{case_id}-{mode}-golden"):
            store = _golden_store(request.config, session.model, case_id, mode)
            traces = session.traces(case_id)
        case = session.cases[case_id]
        if request.config.getoption("--update-golden"):
            store.write(case, mode, traces, session.model)
            return
        try:
            problems = store.check(case, mode, traces, session.model)
        except GoldenError as e:
            pytest.fail(str(e), pytrace=False)
        if problems:
            pytest.fail("\n".join(problems), pytrace=False)

    return check


def _golden_store(config: pytest.Config, model, case_id: str, mode: str):
    """The user's golden store (--golden-dir / kokoro_parity_golden) when set; for reading, the
    shipped store where the user's has no data for this case (the shipped cases' golden data)."""
    own = config.getoption("--golden-dir") or next(iter(config.getini("kokoro_parity_golden")), None)
    if own is None:
        return GoldenStore.for_model(model)
    store = GoldenStore.for_model(model, Path(own))
    if config.getoption("--update-golden") or (store.dir(case_id, mode) / "manifest.json").exists():
        return store
    shipped = GoldenStore.for_model(model, GOLDEN_DIR)
    return shipped if (shipped.dir(case_id, mode) / "manifest.json").exists() else store


class _RanItems:
    """Remembers which parity items ran, in the config's stash: under xdist the records live in
    the workers, and the controller, which sees only their reports, reads the records by id."""
    def __init__(self, config: pytest.Config) -> None:
        self.ran = config.stash.setdefault(RAN_KEY, set())

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.skipped):
            if "test_parity[" in report.nodeid:
                self.ran.add(report.nodeid.split("[", 1)[1].rstrip("]"))


class _VerdictLines:
    """Prints each parity item's verdict line (verdict, error against its floor, PESQ) as the item
    ends, after pytest's own mark for it: a long run shows its results as they come, not only in
    the summary table at the end. In the controller under xdist: the line comes with the report."""
    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(trylast=True)
    def pytest_runtest_logreport(self, report) -> None:
        tr = self.config.pluginmanager.get_plugin("terminalreporter")
        if report.when != "call" or tr is None or self.config.get_verbosity() < 0:
            return  # the teardown's report carries the item's properties too
        for name, line in report.user_properties:
            if name == VERDICT_LINE:
                tr.ensure_newline()  # after the file's dots
                if tr._tw.width_of_current_line:  # a dot pytest wrote on a line of its own (after progress lines)
                    tr._tw.line()
                tr.write_line(line)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Each process writes its work counts, so that the controller (xdist) can add them up."""
    progress.set_display(None)
    progress.set_say(None)
    s = session.config.stash.get(SESSION_KEY, None)
    if s is not None:
        s.close()  # the targets' SSH connections
    if s is not None and s.counts:
        worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
        atomic_write_json(s.report_dir / "counts" / f"{worker}.json", dict(s.counts))


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    ran = config.stash.get(RAN_KEY, set())
    if not ran:
        return
    session = _session(config)
    records = config.stash.get(RECORDS_KEY, None)
    if not records:  # xdist controller: read what the workers wrote
        records = [r for r in read_records(session.report_dir / "records") if r.item_id in ran]

    tr = terminalreporter
    passing_ports = [r for r in records if r.stages and r.verdict.ok]  # a failing one printed its own
    if passing_ports:
        tr.section("kokoro-parity ports, stage by stage")
        for rec in passing_ports:
            tr.write_line(item_table(rec))
    tr.section("kokoro-parity summary")
    tr.write_line(summary_table(records))
    c = _counts(session)
    tr.write_line(f"work: exports {c['exports']}, compiles {c['compiles']}, runs {c['runs']}; cache: "
                  f"programs {c['programs_hits']} hit / {c['programs_misses']} miss, "
                  f"artifacts {c['artifacts_hits']} hit / {c['artifacts_misses']} miss, "
                  f"op audits {c['audits_hits']} hit / {c['audits_misses']} miss"
                  + (f", runs {c['runs_reused']} reused" if c["runs_reused"] else ""))
    tr.write_line(f"records: {session.report_dir / 'records'}")


def _counts(session):
    total = Counter(session.counts)
    if not total:
        for p in (session.report_dir / "counts").glob("*.json"):
            total.update(json.loads(p.read_text()))
    return total
