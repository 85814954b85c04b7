"""Run history: reading and writing run files, regressions against earlier runs, JUnit XML.

The fixture under data/nightly/ is three real `kokoro-parity nightly` runs (see its README.md).
"""
from __future__ import annotations

import copy
import json
import math
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.history import (SCHEMA, History, Run, compare, junit_xml, load_history, nightly, profile_dict,
                             profile_from, read_run, write_run)
from harness.record import SCHEMA as RECORD_SCHEMA, Record
from harness.verdict import Profile, Verdict

FIXTURE = Path(__file__).parent / "data" / "nightly"


@pytest.fixture
def history_dir(tmp_path: Path) -> Path:
    shutil.copytree(FIXTURE / "history", tmp_path / "history")
    return tmp_path / "history"


def test_fixture_loads_as_three_complete_runs():
    h = load_history(FIXTURE / "history")
    assert h.problems == []
    assert len(h.runs) == 3
    assert [r.date for r in h.runs] == sorted(r.date for r in h.runs)
    for run in h.runs:
        assert run.complete and run.git["commit"] and run.machine["cpus"] and run.versions["torch"]
        assert len(run.records) == 8
        for d in run.records:  # version 1 records, loaded as version 2 (later fields: their defaults)
            assert d["schema"] == "kokoro-parity/record/1"
            again = Record.from_dict(d).to_dict()
            assert again["schema"] == RECORD_SCHEMA
            assert {k: again[k] for k in d if k != "schema"} == {k: v for k, v in d.items() if k != "schema"}


def test_write_then_read_round_trips(tmp_path: Path):
    run = load_history(FIXTURE / "history").runs[0]
    path = write_run(tmp_path, run)
    back = read_run(path)
    assert back.to_dict() == run.to_dict()
    assert json.loads(path.read_text())["schema"] == SCHEMA


@pytest.mark.parametrize("content, reason", [
    ('{"schema": "kokoro-parity/run/1", "id": "x", "date": "2026-', "not valid JSON"),
    ('{"schema": "kokoro-parity/run/0", "id": "x", "date": "d", "records": []}', "schema"),
    ('[1, 2, 3]', "expected a JSON object"),
    ('{"schema": "kokoro-parity/run/1", "id": "x", "date": "d", "records": [{"schema": "kokoro-parity/record/1"}]}',
     "missing field"),
    ('{"schema": "kokoro-parity/run/1", "id": "x", "date": "d"}', "missing field 'records'"),
])
def test_an_unreadable_file_is_reported_and_skipped(history_dir: Path, content: str, reason: str):
    bad = history_dir / "20990101T000000Z-broken.json"
    bad.write_text(content)
    h = load_history(history_dir)
    assert len(h.runs) == 3  # the good runs are all still there
    assert len(h.problems) == 1
    assert h.problems[0].path == bad and reason in h.problems[0].reason
    assert "skipped" in str(h.problems[0])


def test_an_unknown_verdict_is_a_problem_not_a_crash(history_dir: Path):
    path = sorted(history_dir.glob("*.json"))[0]
    d = json.loads(path.read_text())
    d["records"][0]["verdict"] = "mostly_fine"
    path.write_text(json.dumps(d))
    h = load_history(history_dir)
    assert len(h.runs) == 2 and "unknown verdict 'mostly_fine'" in h.problems[0].reason


def test_identical_runs_have_no_regressions_and_the_strict_run_has_verdict_regressions():
    h = load_history(FIXTURE / "history")
    regs = h.regressions()
    first, second, strict = h.runs
    assert regs[first.id] == []  # nothing before it
    assert regs[second.id] == []  # the same items again: same verdicts, same errors
    got = regs[strict.id]
    failed = {item for item, r in strict.by_item().items() if r["verdict"] == "fail"}
    assert failed, "the fixture's third run must have failures"
    verdict_regs = [g for g in got if g.kind == "verdict"]
    assert {g.item for g in verdict_regs} == failed
    for g in verdict_regs:
        assert (g.before, g.after, g.previous_run) == ("pass", "fail", second.id)
        assert "pass -> fail" in str(g)


def _pair():
    h = load_history(FIXTURE / "history")
    run = h.runs[1]
    rec = next(r for r in run.records if r["verdict"] == "pass" and r["metrics"])
    return {f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}": (run.id, rec)}, copy.deepcopy(rec)


@pytest.mark.parametrize("key", ["rel_l2", "floor_ratio"])
def test_an_error_that_grew_past_the_factor_is_flagged_with_both_values(key: str):
    baseline, rec = _pair()
    output = next(iter(rec["metrics"]))
    before = rec["metrics"][output][key]
    rec["metrics"][output][key] = before * 3
    regs = compare(baseline, [rec], factor=2.0)
    assert len(regs) == 1
    g = regs[0]
    assert (g.kind, g.what, g.before, g.after) == ("metric", f"{output}.{key}", before, before * 3)
    assert "x3" in str(g)
    # under the factor: not a regression; a smaller factor makes it one
    rec["metrics"][output][key] = before * 1.5
    assert compare(baseline, [rec], factor=2.0) == []
    assert len(compare(baseline, [rec], factor=1.2)) == 1


def test_a_nan_error_is_always_a_regression():
    baseline, rec = _pair()
    output = next(iter(rec["metrics"]))
    rec["metrics"][output]["rel_l2"] = "nan"  # how records store NaN
    regs = compare(baseline, [rec])
    assert [g.what for g in regs] == [f"{output}.rel_l2"] and math.isnan(regs[0].after)


@pytest.mark.parametrize("before, after, kind", [
    ("pass", "compile_error", "verdict"),
    ("fail", "crashed", "verdict"),
    ("compile_error", "export_error", "verdict"),
    ("pass", "skipped", "coverage"),
    ("compile_error", "fail", None),  # got further: progress
    ("crashed", "timeout", None),  # as bad as before
    ("skipped", "fail", None),  # nothing to regress from
])
def test_verdict_order(before: str, after: str, kind: str | None):
    baseline, rec = _pair()
    prev = baseline[next(iter(baseline))][1]
    prev["verdict"], rec["verdict"], rec["metrics"] = before, after, {}
    regs = compare(baseline, [rec])
    assert [g.kind for g in regs] == ([kind] if kind else [])


def test_every_verdict_has_a_rank_and_a_colour():
    """A verdict added to harness.verdict must be placed in the order (and get a cell colour)."""
    from harness.dashboard import VERDICT_COLORS
    from harness.history import RANK

    assert set(RANK) | {"skipped"} == {v.value for v in Verdict} == set(VERDICT_COLORS)


def test_the_factor_must_be_above_one():
    with pytest.raises(ValueError, match="factor"):
        compare({}, [], factor=1.0)


def test_junit_has_one_testcase_per_item_and_one_failure_per_regression():
    h = load_history(FIXTURE / "history")
    strict = h.runs[2]
    regs = h.regressions()[strict.id]
    root = ET.fromstring(junit_xml(strict, regs, has_baseline=True))
    items, reg_suite = root.findall("testsuite")
    cases = items.findall("testcase")
    assert len(cases) == int(items.get("tests")) == len(strict.records)
    n_fail = sum(r["verdict"] == "fail" for r in strict.records)
    assert int(items.get("failures")) == n_fail == len(items.findall("testcase/failure"))
    assert {c.get("name") for c in cases} == set(strict.by_item())
    assert int(reg_suite.get("failures")) == len(regs) > 0
    # the first run has nothing to compare with: said as a skip, not as a pass
    root = ET.fromstring(junit_xml(h.runs[0], [], has_baseline=False))
    assert root.findall("testsuite")[1].find("testcase/skipped") is not None


def test_the_tolerance_profile_round_trips():
    p = Profile.load(FIXTURE / "strict_tolerances.yaml")
    assert profile_from(profile_dict(p)) == p
    assert profile_from(None) == Profile.load()
    stored, now = load_history(FIXTURE / "history").runs[2].selection["tolerances"], profile_dict(p)
    assert {k: now["default"][k] for k in stored["default"]} == stored["default"]  # later fields: defaults
    assert [{k: o[k] for k in s} for o, s in zip(now["overrides"], stored["overrides"])] == stored["overrides"]


def test_a_run_that_stops_half_way_leaves_a_valid_incomplete_entry(tmp_path: Path):
    """A real Session whose item cannot run: the history keeps a readable entry that says why."""
    from harness.runner import Item, Session

    session = Session(report_dir=tmp_path / "reports")
    with pytest.raises(KeyError, match="no_such_backend"):
        items = [Item("en_short", "decoder", "no_such_backend", "dynamic")]
        nightly((session.run(i) for i in items), tmp_path / "history", n_items=1, backends=["no_such_backend"],
                profile=session.profile)
    h = load_history(tmp_path / "history")
    assert h.problems == [] and len(h.runs) == 1
    run = h.runs[0]
    assert not run.complete and run.records == []
    assert "stopped after 0 of 1 items: UnknownName: unknown backend 'no_such_backend'" in run.error


def test_history_of_an_empty_or_missing_directory(tmp_path: Path):
    assert load_history(tmp_path / "nope") == History([], [])
    assert Verdict.PASS.value in {r["verdict"] for r in load_history(FIXTURE / "history").runs[0].records}
    assert isinstance(load_history(FIXTURE / "history").latest, Run)


def test_an_entry_from_records_already_written(history_dir: Path, tmp_path: Path):
    """`nightly --from-records` (shards joined by `kokoro-parity merge`): the same entry, no run."""
    from harness.history import HistoryError, record_run

    first = load_history(history_dir).runs[0]
    records = tmp_path / "records"
    for d in first.records:
        Record.from_dict(d).write(records)
    result = record_run(records, history_dir, junit_path=tmp_path / "junit.xml")
    h = load_history(history_dir)
    assert len(h.runs) == 4 and h.latest.id == result.run.id and h.latest.complete
    written = [Record.from_dict(d).to_dict() for d in first.records]  # today's schema: new fields' defaults
    dump = lambda d: json.dumps(d, sort_keys=True)  # noqa: E731
    assert sorted(map(dump, h.latest.records)) == sorted(map(dump, written))
    # after the strict run, the default profile's verdicts are back to pass: no regression
    assert result.regressions == [] and (tmp_path / "junit.xml").is_file()
    (records / "broken.json").write_text("{")
    with pytest.raises(HistoryError, match="broken.json"):
        record_run(records, history_dir)


@pytest.mark.slow
def test_make_nightly_twice_gives_two_entries_and_a_dashboard_with_both(tmp_path: Path):
    """The issue's acceptance check, on a small real selection (the seeded random model's tiny case:
    what is checked is the nightly's entries and dashboard, not the weights): two nightly runs in a
    row write two history entries, find no regression between them, and the dashboard shows both
    runs and a two-point trend for the item."""
    from harness import cli
    from harness.cases import write_case
    from tests.unit.conftest import shared_references

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    cache = shared_references(tmp_path / "cache", work=True)  # bert_encoder's program: as test_merge's
    argv = ["nightly", "--weights", "random:0", "--backend", "eager", "--step", "bert_encoder", "--case", "tiny",
            "--mode", "dynamic", "--report-dir", str(tmp_path / "reports"), "--dashboard", str(tmp_path / "dashboard"),
            "--no-upstream"]  # the bundles: tests/unit/test_upstream.py
    with pytest.MonkeyPatch.context() as mp:  # the CLI's command in this process: a child would pay its imports
        mp.setenv("KOKORO_PARITY_CASES", str(tmp_path / "cases"))
        mp.setenv("KOKORO_PARITY_CACHE", str(cache))
        for _ in range(2):
            assert cli.main(argv) == 0
    history = load_history(tmp_path / "reports" / "history")
    assert len(history.runs) == 2 and all(run.complete for run in history.runs)
    assert [len(run.records) for run in history.runs] == [1, 1]
    assert history.runs[0].records[0]["verdict"] == history.runs[1].records[0]["verdict"] == "pass"
    site = tmp_path / "dashboard"
    runs_page = (site / "runs.html").read_text()
    assert all(run.id in runs_page for run in history.runs)
    trends = (site / "trends.html").read_text()
    from harness.dashboard import _labels

    for label in _labels(history.runs):  # one x value per run on the item's trend
        assert label in trends or json.dumps(label)[1:-1] in trends, f"the trends page lacks run {label!r}"
    assert (site / "items" / "tiny-bert_encoder-eager-dynamic.html").is_file()
