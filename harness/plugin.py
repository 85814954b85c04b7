"""The pytest plugin: one test item per (case, step, backend, mode), ids `case-step-backend-mode`
so that `-k decoder`, `-k xnnpack` and `-k "decoder and static"` select what a user expects.

Registered through the `pytest11` entry point. It is the only module that imports pytest.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from .record import Record
from .verdict import Verdict


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("kokoro-parity")
    g.addoption("--backend", action="append", default=None,
                help="backend to check (repeatable; default: every installed backend)")
    g.addoption("--case", action="append", default=None, help="case id from cases/ (repeatable; default: all)")
    g.addoption("--mode", choices=("dynamic", "static", "both"), default="both",
                help="dynamic (exact lengths) or static (padded to the bucket, packing disabled)")
    g.addoption("--weights", default=None,
                help="Kokoro .pth to load strictly, `hf` (local HF cache), `random[:seed]`; default: the "
                     "int8-rebuilt Kokoro-82M v1.0 (env KOKORO_PARITY_WEIGHTS)")
    g.addoption("--update-golden", action="store_true", help="regenerate golden/ from the current references")
    g.addoption("--report-dir", default="reports", help="where JSON records and run files go")
    g.addoption("--profile", default=None, help="tolerance profile YAML (default: harness/tolerances.yaml)")
    g.addoption("--with-patch", action="append", default=[], dest="with_patch",
                help="add a patch to every backend's own (repeatable), e.g. length_aware_lstm")


def _session(config: pytest.Config):
    s = getattr(config, "_parity_session", None)
    if s is None:
        from .runner import Session
        from .verdict import Profile

        s = Session(weights=config.getoption("--weights"), case_ids=config.getoption("--case"),
                    report_dir=Path(config.getoption("--report-dir")),
                    profile=Profile.load(config.getoption("--profile")),
                    extra_patches=tuple(config.getoption("with_patch")))
        config._parity_session = s
        config._parity_records = []
    return s


def _backends(config: pytest.Config) -> list[str]:
    from .backends import backend_names, get_backend

    chosen = config.getoption("--backend")
    if chosen:
        for name in chosen:
            get_backend(name)  # unknown name: a usage error now, not a skip later
        return chosen
    return [b for b in backend_names() if get_backend(b).available()[0]]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    mode = config.getoption("--mode")
    modes = ("dynamic", "static") if mode == "both" else (mode,)
    if "parity_item" in metafunc.fixturenames:
        items = _session(config).items(_backends(config), modes=modes)
        metafunc.parametrize("parity_item", items, ids=[i.id for i in items])
    if "golden_key" in metafunc.fixturenames:
        keys = [(c, m) for c in _session(config).cases for m in modes]
        metafunc.parametrize("golden_key", keys, ids=[f"{c}-{m}-golden" for c, m in keys])


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "parity_item" in getattr(item, "fixturenames", ()) or "golden_key" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.parity)


@pytest.fixture
def parity_session(request: pytest.FixtureRequest):
    return _session(request.config)


@pytest.fixture
def check_parity(request: pytest.FixtureRequest):
    """Run one item and turn its record into a pytest outcome with a metric table, not a traceback."""
    from .report import item_table

    def check(item) -> Record:
        rec = _session(request.config).run(item)
        request.config._parity_records.append(rec)
        if rec.verdict is Verdict.SKIPPED:
            pytest.skip(rec.reason)
        if rec.verdict is not Verdict.PASS:
            pytest.fail(item_table(rec), pytrace=False)
        return rec

    return check


@pytest.fixture
def check_golden(request: pytest.FixtureRequest):
    def check(case_id: str, mode: str) -> None:
        from .golden import GoldenError, GoldenStore

        session = _session(request.config)
        store = GoldenStore.for_model(session.model)
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


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    records = getattr(config, "_parity_records", None)
    session = getattr(config, "_parity_session", None)
    if not records or session is None:
        return
    from .report import summary_table

    tr = terminalreporter
    tr.section("kokoro-parity summary")
    tr.write_line(summary_table(records))
    c = session.counts
    tr.write_line(f"work: exports {c['exports']}, compiles {c['compiles']}, runs {c['runs']}; cache: "
                  f"programs {c['programs_hits']} hit / {c['programs_misses']} miss, "
                  f"artifacts {c['artifacts_hits']} hit / {c['artifacts_misses']} miss")
    tr.write_line(f"records: {session.report_dir / 'records'}")
