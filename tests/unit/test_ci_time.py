"""benchmarks/ci_time.py: the suite time `make bench` prints is read from `make test`'s JUnit XML
as written, and a run with no XML says so instead of printing a figure."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
XML = ('<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest" errors="0" '
       'failures="1" skipped="1" tests="4" time="1500.5" timestamp="2026-11-27T06:12:00+00:00" hostname="ci">'
       '<testcase classname="tests.unit.test_a" name="test_fast" time="0.2" />'
       '<testcase classname="tests.unit.test_a.TestGroup" name="test_slow[x]" time="300.0" />'
       '<testcase classname="tests.unit.test_b" name="test_off" time="0.0"><skipped message="no runtime" /></testcase>'
       '<testcase classname="tests.unit.test_b" name="test_bad" time="12.0"><failure message="x" /></testcase>'
       '</testsuite></testsuites>')


def ci_time():
    spec = importlib.util.spec_from_file_location("ci_time", ROOT / "benchmarks" / "ci_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_suite_time_slowest_tests_and_counts_come_from_the_junit_xml(tmp_path, capsys):
    (tmp_path / "unit-tests.xml").write_text(XML)
    assert ci_time().main(["--junit", str(tmp_path / "unit-tests.xml"), "--top", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2026-11-27T06:12:00+00:00 on ci" in lines[0]
    assert lines[1].strip() == "4 tests: 2 passed, 1 skipped, 1 failed"
    assert "session 1500 s (25.0 min) against the 20-minute target: 5.0 min over" in lines[2]
    assert [line.split()[-1] for line in lines[-2:]] == ["tests/unit/test_a.py::TestGroup::test_slow[x]", "[failed]"]
    assert len(lines) == 7


def test_no_xml_is_no_figure(tmp_path, capsys):
    assert ci_time().main(["--junit", str(tmp_path / "none.xml")]) == 0
    out = capsys.readouterr().out
    assert "no measurement" in out and "s (" not in out


def test_module_seconds_are_written_for_the_suites_order_and_a_failing_run_is_refused(tmp_path):
    """`--write-durations`: each module's seconds, the heaviest first, for tests/unit/conftest.py's
    xdist order; a failing (or partial) run's seconds are not written."""
    import json

    import pytest

    module = ci_time()
    (tmp_path / "failing.xml").write_text(XML)
    with pytest.raises(SystemExit, match="partial or failing run"):
        module.main(["--junit", str(tmp_path / "failing.xml"), "--write-durations", str(tmp_path / "d.json")])
    assert not (tmp_path / "d.json").exists()
    suite = module.read_suite(tmp_path / "failing.xml")
    module.write_durations(suite, tmp_path / "d.json")
    data = json.loads((tmp_path / "d.json").read_text())
    assert list(data["modules"].items()) == [("test_a.py", 300.2), ("test_b.py", 12.0)]
    assert "2026-11-27T06:12:00+00:00 on ci" in data["about"]


def test_the_committed_durations_name_modules_that_exist():
    """A renamed module would fall back to an estimate: the committed file is kept current."""
    import json

    data = json.loads((ROOT / "tests" / "unit" / "durations.json").read_text())
    missing = [m for m in data["modules"] if not (ROOT / "tests" / "unit" / m).is_file()]
    assert not missing, f"tests/unit/durations.json names modules that are gone: {missing}"
