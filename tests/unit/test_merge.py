"""`kokoro-parity merge` loses nothing: every file an item wrote reaches the merged dir, records'
paths are rewritten to resolve there, the history entry sums the shards' work and time, and the
dashboard built from it has its audio players and repro links (harness/merge.py)."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from harness.dashboard import build_dashboard
from harness.history import item_seconds, read_run, record_run, work_counts
from harness.merge import merge_shards, relocate
from harness.metrics.audio import write_wav
from harness.plumbing.files import atomic_write_json
from harness.record import Record, real_time
from harness.verdict import Verdict
from tests.unit.conftest import shared_references

REPO = Path(__file__).resolve().parents[2]


def make_shard(root: Path, name: str, step: str, *, bundle: bool = False, counts: dict | None = None) -> Path:
    """A report dir as the runner writes it: a record, its WAVs, its run dir and log, and (as
    harness.bisect does) a repro bundle named by the absolute path it had on the machine that ran it."""
    d = root / name
    iid = f"tiny-{step}-eager-dynamic"
    rec = Record("tiny", step, "eager", "dynamic", Verdict.FAIL if bundle else Verdict.PASS,
                 timings={"export_s": 1.5, "compile_s": 2.0, "run_s": 0.5, "run_job_s": 3.0})
    t = np.linspace(0, 1, 2400)
    for role, wav in (("reference", np.sin(2e3 * t)), ("backend", np.sin(2e3 * t) * 0.99)):
        write_wav(d / "audio" / iid / f"{role}.wav", wav)
        rec.audio[role] = f"audio/{iid}/{role}.wav"
    (d / "runs" / iid).mkdir(parents=True)
    (d / "runs" / iid / "log.txt").write_text(f"log of {iid}\n")
    if bundle:
        (d / "repro" / iid).mkdir(parents=True)
        (d / "repro" / iid / "repro.py").write_text("print('repro')\n")
        rec.bisect = {"status": "localized", "seconds": 4.0,
                      "repro": {"path": f"/home/runner/work/reports/{name}/repro/{iid}", "bytes": 15, "n_ops": 1}}
    rec.write(d / "records")
    if counts:
        atomic_write_json(d / "counts" / "main.json", counts)
    (d / "history").mkdir(exist_ok=True)  # derived from records: a shard's own is not merged
    (d / "history" / "old.json").write_text("{}")
    return d


def test_merge_carries_every_file_and_the_entry_sums_the_shards(tmp_path):
    one = make_shard(tmp_path, "shard-1", "generator", counts={"exports": 1, "compiles": 1, "runs": 1})
    two = make_shard(tmp_path, "shard-2", "decoder", bundle=True)  # no counts: what its records show
    out = tmp_path / "reports"
    result = merge_shards([one, two], out)
    assert result.n_records == 2
    for shard in (one, two):
        for p in shard.rglob("*"):
            rel = p.relative_to(shard)
            if p.is_file() and rel.parts[0] not in ("history", "records", "counts"):
                assert (out / rel).read_bytes() == p.read_bytes(), rel
    assert not (out / "history" / "old.json").exists()
    bisected = json.loads((out / "records" / "tiny-decoder-eager-dynamic.json").read_text())
    assert bisected["bisect"]["repro"]["path"] == "repro/tiny-decoder-eager-dynamic"
    assert bisected["audio"]["backend"] == "audio/tiny-decoder-eager-dynamic/backend.wav"

    entry = record_run(out / "records", out / "history").run
    assert entry.counts == {"exports": 2, "compiles": 2, "runs": 2}  # shard-1's file + shard-2's timings
    assert entry.duration_s == pytest.approx(6.5 + 6.5 + 4.0)
    assert [s["records"] for s in entry.selection["shards"]] == [1, 1]

    site = build_dashboard(out / "history", out / "dashboard", report_dir=out)
    for iid in ("tiny-generator-eager-dynamic", "tiny-decoder-eager-dynamic"):
        page = (site / "items" / f"{iid}.html").read_text()
        assert "missing:" not in page
        players = re.findall(r'<audio controls preload="metadata" src="([^"]+)"', page)
        assert len(players) == 2 and all((site / "items" / p).is_file() for p in players)
        assert (site / "items" / re.search(r'id="spectrogram" src="([^"]+)"', page).group(1)).is_file()
    page = (site / "items" / "tiny-decoder-eager-dynamic.html").read_text()
    href = re.search(r'id="repro-link" href="([^"]+)"', page).group(1)
    assert ((site / "items" / href) / "repro.py").is_file()


def test_merge_refuses_what_would_lose_or_mix_results(tmp_path):
    one = make_shard(tmp_path, "a", "generator")
    same_item = make_shard(tmp_path / "b", "a", "generator")
    with pytest.raises(ValueError, match="is in two shards"):
        merge_shards([one, same_item], tmp_path / "out1")
    other = make_shard(tmp_path, "c", "decoder")
    (other / "notes.txt").write_text("c")
    (one / "notes.txt").write_text("a")
    with pytest.raises(ValueError, match="notes.txt differs between shards"):
        merge_shards([one, other], tmp_path / "out2")
    assert not (tmp_path / "out2").exists()  # nothing written on an error
    (other / "notes.txt").unlink()
    (one / "notes.txt").unlink()
    stale = tmp_path / "out3"
    make_shard(tmp_path, "out3", "bert")  # an earlier run's records: they would be summed in
    with pytest.raises(ValueError, match="already holds tiny-bert-eager-dynamic.json"):
        merge_shards([one, other], stale)
    merge_shards([one, other], tmp_path / "out4")
    merge_shards([one, other], tmp_path / "out4")  # the same merge again: the same result
    with pytest.raises(FileNotFoundError, match="no records/ directory"):
        merge_shards([tmp_path / "nothing"], tmp_path / "out5")


def test_merge_leaves_out_a_killed_items_leftovers_that_a_resumed_shard_finished(tmp_path):
    """A shard killed mid-item leaves that item's run dir and no record; the resumed shard re-ran
    it. The leftovers are not a conflict: the finished item's files win, the rest are reported. A
    killed item that no shard finished keeps its leftovers (the only trace of the kill)."""
    killed = make_shard(tmp_path, "first", "bert")
    (killed / "runs" / "tiny-generator-eager-dynamic").mkdir(parents=True)
    (killed / "runs" / "tiny-generator-eager-dynamic" / "job.json").write_text('{"attempt": 1}')
    (killed / "runs" / "tiny-decoder-eager-dynamic").mkdir(parents=True)
    (killed / "runs" / "tiny-decoder-eager-dynamic" / "job.json").write_text('{"attempt": 1}')
    resumed = make_shard(tmp_path, "resumed", "generator")
    (resumed / "runs" / "tiny-generator-eager-dynamic" / "job.json").write_text('{"attempt": 2}')
    out = tmp_path / "merged"
    result = merge_shards([killed, resumed], out)
    assert result.dropped == {str(killed): ["tiny-generator-eager-dynamic"]}
    assert (out / "runs" / "tiny-generator-eager-dynamic" / "job.json").read_text() == '{"attempt": 2}'
    assert (out / "runs" / "tiny-generator-eager-dynamic" / "log.txt").is_file()
    assert (out / "runs" / "tiny-decoder-eager-dynamic" / "job.json").read_text() == '{"attempt": 1}'
    assert json.loads((out / "merge.json").read_text())["dropped"] == result.dropped
    # the resumed shard's own record is the one merged: two records, no conflict
    assert sorted(p.name for p in (out / "records").glob("*.json")) == [
        "tiny-bert-eager-dynamic.json", "tiny-generator-eager-dynamic.json"]


def test_merge_later_wins_takes_a_rerun_item_from_the_later_shard(tmp_path):
    """A nightly re-runs a failed or stale item into a new shard: with `later_wins` the last shard
    given supplies that item (record, run dir, WAVs) and the earlier one's copy, its repro bundle
    included, is left out and reported, never mixed in; the earlier shard's work still counts."""
    first = make_shard(tmp_path, "first", "decoder", bundle=True, counts={"exports": 1, "compiles": 1, "runs": 1})
    (first / "runs" / "tiny-decoder-eager-dynamic" / "log.txt").write_text("the first run\n")
    make_shard(tmp_path, "first", "bert")  # a second item of the first shard, kept
    rerun = make_shard(tmp_path, "rerun", "decoder", counts={"exports": 0, "compiles": 0, "runs": 1})
    with pytest.raises(ValueError, match="--later-wins"):
        merge_shards([first, rerun], tmp_path / "refused")
    out = tmp_path / "merged"
    result = merge_shards([first, rerun], out, later_wins=True)
    assert result.superseded == {str(first): ["tiny-decoder-eager-dynamic"]} and result.dropped == {}
    rec = json.loads((out / "records" / "tiny-decoder-eager-dynamic.json").read_text())
    assert rec["verdict"] == "pass" and not rec["bisect"]  # the re-run's record, not the first's FAIL
    assert (out / "runs" / "tiny-decoder-eager-dynamic" / "log.txt").read_text() == "log of tiny-decoder-eager-dynamic\n"
    assert not (out / "repro" / "tiny-decoder-eager-dynamic").exists()
    assert (out / "records" / "tiny-bert-eager-dynamic.json").is_file()
    assert json.loads((out / "merge.json").read_text())["superseded"] == result.superseded
    entry = record_run(out / "records", out / "history").run
    assert entry.counts == {"exports": 1, "compiles": 1, "runs": 2}
    assert len(entry.records) == 2


def test_relocate_rewrites_only_paths_of_the_shards_files():
    files = {"repro/x", "repro/x/repro.py", "audio/x/backend.wav"}
    rec = {"a": "/ci/reports/shard-3/repro/x", "b": ["reports/audio/x/backend.wav"], "c": "repro/y",
           "d": "see /ci/repro/x\nline two", "e": "x"}
    assert relocate(rec, files) == {"a": "repro/x", "b": ["audio/x/backend.wav"], "c": "repro/y",
                                    "d": "see /ci/repro/x\nline two", "e": "x"}


def test_item_work_counts_every_stage_and_the_bisection():
    rec = {"timings": {"duration_stage.export_s": 1.0, "duration_stage.compile_s": 2.0, "duration_stage.run_s": 0.5,
                       "duration_stage.run_job_s": 1.0, "synthesizer64.compile_s": 3.0, "synthesizer64.run_job_s": 2.0,
                       "compile_wait_s": 9.0}, "bisect": {"seconds": 10.0}}
    assert item_seconds(rec) == pytest.approx(19.0)
    assert work_counts([rec]) == {"exports": 1, "compiles": 2, "runs": 2}


def test_real_time_factor():
    assert real_time(2.0, 4.0) == {"rtf": 0.5, "run_s": 2.0, "audio_s": 4.0}
    assert real_time(None, 4.0) == {} and real_time(1.0, 0.0) == {}


# ---- slow: shards made by real runs of the tiny case ------------------------------------------

@pytest.mark.slow
def test_merged_shards_of_real_runs_give_a_complete_dashboard(tmp_path, monkeypatch):
    """~5 min on 2 shared cores: shard 1 runs two audio items (generator, e2e) on eager, shard 2 a faulty backend's
    failing item and its bisection (repro bundle), each with the seeded random model and the tiny
    case; merged with the CLI, the entry from `nightly --from-records` and the dashboard."""
    from harness import cli
    from harness.bisect import bisect_item
    from harness.cases import load_cases, write_case
    from harness.report import item_table, summary_table
    from harness.runner import Item, Session

    from .faulty_backend import FAULT_ENV

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(shared_references(tmp_path / "cache", work=True)))
    monkeypatch.setenv("KOKORO_PARITY_EXTRA_BACKENDS", "faulty-eager=tests.unit.faulty_backend:FaultyEager")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv(FAULT_ENV, "op=aten.linear.default,kind=scale,factor=1.5")

    def session(name):
        s = Session(weights="random:0", case_ids=["tiny"], report_dir=tmp_path / name)
        s._cases = {c.id: c for c in load_cases(tmp_path / "cases")}
        return s

    one = session("shard-1")
    audio = [one.run(Item("tiny", step, "eager", "dynamic")) for step in ("generator", "e2e")]
    for rec in audio:
        assert rec.verdict.value == "pass", item_table(rec)
        assert rec.real_time["rtf"] == pytest.approx(rec.real_time["run_s"] / rec.real_time["audio_s"])
        jobs = sum(v for k, v in rec.timings.items() if k.endswith("run_job_s"))  # the runs' child processes
        assert rec.real_time["audio_s"] > 0.1 and 0 < rec.real_time["run_s"] <= jobs, rec.timings
        assert "real-time factor" in item_table(rec)
    assert audio[0].real_time["run_s"] == audio[0].timings["run_s"]
    e2e = audio[1]
    assert e2e.real_time["run_s"] == pytest.approx(  # the app's runs: the port chain's chained run per stage
        e2e.timings["duration_stage.local.run_s"] + e2e.timings["synthesizer.chained.run_s"])
    assert summary_table(audio).count(" RTF ") == 2
    atomic_write_json(one.report_dir / "counts" / "main.json", dict(one.counts))  # as the pytest plugin does

    two = session("shard-2")
    item = Item("tiny", "bert_encoder", "faulty-eager", "dynamic")
    failing = two.run(item)
    assert failing.verdict.value == "fail"
    bisect_item(two, item, failing, depth=0, verify=False)
    assert failing.bisect["status"] == "localized" and Path(failing.bisect["repro"]["path"]).is_dir()

    out = tmp_path / "merged"  # the CLI's commands, in this process (a child would only pay its imports again)
    assert cli.main(["merge", str(one.report_dir), str(two.report_dir), "--out", str(out)]) == 0
    assert cli.main(["nightly", "--from-records", str(out / "records"), f"--report-dir={out}",
                     "--dashboard", str(out / "dashboard")]) == 0
    entry = read_run(next((out / "history").glob("*.json")))
    runs = one.counts["runs"] + sum(k.endswith("run_job_s") for k in failing.timings)
    assert entry.counts["runs"] == runs >= 4  # generator 1, e2e 3 (duration stage, synthesizer local and chained), the failing item 1
    records = [*audio, failing]
    assert entry.duration_s == pytest.approx(sum(item_seconds(r.to_dict()) for r in records), abs=0.01)
    assert entry.duration_s > sum(r.timings.get("run_job_s", 0) for r in records) > 0

    site = out / "dashboard"
    for rec in audio:
        page = (site / "items" / f"{rec.item_id}.html").read_text()
        players = re.findall(r'<audio controls preload="metadata" src="([^"]+)"', page)
        assert len(players) >= 2 and all((site / "items" / p).is_file() for p in players), page
        assert "missing:" not in page and 'id="rtf"' in page
    page = (site / "items" / f"{failing.item_id}.html").read_text()
    href = re.search(r'id="repro-link" href="([^"]+)"', page).group(1)
    bundle = (site / "items" / href).resolve()
    assert bundle.is_relative_to(out.resolve()) and {"repro.py", "program.pt2", "inputs.pt"} <= {
        p.name for p in bundle.iterdir()}
    for shard in (one.report_dir, two.report_dir):  # every file an item wrote is in the merged dir
        for p in shard.rglob("*"):
            rel = p.relative_to(shard)
            if p.is_file() and rel.parts[0] not in ("records", "counts"):
                assert (out / rel).is_file(), rel
