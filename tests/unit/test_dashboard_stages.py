"""The dashboard's per-stage table of a port item (issue 21): a record with `stages` (the shape
harness/port/chain.py writes) gets the table on its item page, with the first stage whose local
error leaves its floor marked; a record without stages renders as before (no browser needed)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from harness.dashboard import build_dashboard, stage_table

FIXTURE = Path(__file__).parent / "data" / "nightly"
CONV_POST = "decoder.generator.conv_post:out"


def _judged(rel_l2: float, floor: float, ok: bool, kind: str, why: str = "") -> dict:
    """One tensor as chain.judge_tensor records it (harness.metrics.tensor.compare_to_floor + kind/ok/why)."""
    return {"rel_l2": rel_l2, "floor_rel_l2": floor, "floor_ratio": rel_l2 / floor, "max_abs": rel_l2,
            "snr_db": 20.0, "kind": kind, "ok": ok, "why": why or f"rel_l2 {rel_l2:.2e} vs floor {floor:.2e}"}


def _port_record(template: dict) -> dict:
    """The 7-stage chain with the vocoder exported times 1.1 (docs/own-port.md), three of its stages."""
    rows = [
        {"stage": "post_albert", "artifact": "post_albert.onnx", "precision": "float32",
         "outputs": {"duration": {"local": _judged(6.9e-8, 5.9e-8, True, "rounding-level (rel < 1e-6)"),
                                  "chained": _judged(1.3e-7, 5.9e-8, True, "rounding-level (rel < 1e-6)")},
                     "pred_dur": {"local": {"tokens": 8, "tokens_differ": 0, "ok": True, "kind": "durations",
                                            "why": "durations equal"},
                                  "chained": {"tokens": 8, "tokens_differ": 2, "ok": False, "kind": "durations",
                                              "why": "2 of 8 durations differ"}}},
         "local_ok": True, "chained_ok": False},
        {"stage": "vocoder", "artifact": "vocoder.onnx", "precision": "float32", "bucket": {"local": 256, "chained": 256},
         "outputs": {CONV_POST: {"local": _judged(0.1, 9.02e-4, False, "constant gain x1.1 (+0.83 dB)"),
                                 "chained": _judged(0.0999, 9.02e-4, False, "constant gain x1.1 (+0.83 dB)")}},
         "local_ok": False, "chained_ok": False},
        {"stage": "tail", "artifact": "tail.onnx", "precision": "float16",
         "outputs": {"audio": {"local": _judged(0.05, 0.0124, False, "noise-like (SNR 26.0 dB)"),
                               "chained": _judged(0.203, 0.0124, False, "noise-like (SNR 13.9 dB)")}},
         "local_ok": False, "chained_ok": False},  # a later stage that also leaves: not the first
    ]
    rec = {**template, "step": "port:kokoro-7stage", "backend": "port", "mode": "dynamic", "verdict": "fail",
           "reason": "first stage whose local error leaves its floor: 'vocoder'", "stages": rows,
           "metrics": {f"{r['stage']}:{t}": {k: v for k, v in o["chained"].items() if isinstance(v, float)}
                       for r in rows for t, o in r["outputs"].items()}, "bisect": {}, "audio": {}}
    return rec


def _site(tmp_path: Path, edit) -> tuple[Path, list[dict]]:
    reports = tmp_path / "reports"
    shutil.copytree(FIXTURE / "history", reports / "history")
    shutil.copytree(FIXTURE / "audio", reports / "audio")
    path = sorted((reports / "history").glob("*.json"))[-1]
    run = json.loads(path.read_text())
    edit(run["records"])
    path.write_text(json.dumps(run))
    return build_dashboard(reports / "history", reports / "dashboard", report_dir=reports), run["records"]


def _page(site: Path, rec: dict) -> str:
    return (site / "items" / f"{rec['case']}-{rec['step']}-{rec['backend']}-{rec['mode']}.html").read_text()


def _rows(page: str) -> list[str]:
    table = re.search(r'<table class="metrics stages" id="stage-table">.*?</table>', page, re.S)
    assert table, "no stage table"
    return re.findall(r"<tr class=\"stage-row[^\"]*\" data-stage=\"[^\"]+\">.*?</tr>", table.group(0), re.S)


def test_a_port_items_page_has_the_stage_table_with_the_first_leaving_stage_marked(tmp_path):
    site, recs = _site(tmp_path, lambda recs: recs.append(_port_record(recs[0])))
    page = _page(site, recs[-1])
    rows = _rows(page)
    assert len(rows) == 4  # one per stage output
    assert re.search(r'id="first-stage">vocoder<', page)
    marked = [r for r in rows if "first-leaving" in r]
    assert len(marked) == 1 and 'data-stage="vocoder"' in marked[0] and "first to leave its floor" in marked[0]
    assert not any("first-leaving" in r for r in rows if 'data-stage="tail"' in r)  # leaves too, but later
    vocoder = marked[0]
    assert CONV_POST in vocoder and "vocoder.onnx" in vocoder and "constant gain x1.1 (+0.83 dB)" in vocoder
    assert ">0.1<" in vocoder and "9.02e-04" in vocoder and "✗ leaves" in vocoder and "✗ fail" in vocoder
    assert ">256<" in vocoder  # the bucket both runs used
    tail = next(r for r in rows if 'data-stage="tail"' in r)
    assert "float16" in tail and "chained: noise-like (SNR 13.9 dB)" in tail
    durations = next(r for r in rows if "pred_dur" in r)
    assert "durations equal" in durations and "chained: 2 of 8 durations differ" in durations
    assert "✓ ok" in durations and "✗ fail" in durations
    assert 'id="extra"' not in page or '"stages"' not in page  # not dumped again under "Other fields"


def test_a_stage_table_without_a_leaving_stage_names_none_and_odd_rows_do_not_break_it(tmp_path):
    def edit(recs):
        rec = _port_record(recs[0])
        rec["stages"][1]["outputs"][CONV_POST]["local"].update(ok=True, rel_l2=9e-4)
        rec["stages"][1]["local_ok"] = True
        rec["stages"][2]["local_ok"] = True
        rec["stages"].append({"stage": "glue:aln"})  # a row the chain cut short: no outputs, no marks
        recs.append(rec)

    site, recs = _site(tmp_path, edit)
    page = _page(site, recs[-1])
    assert "no stage leaves its floor locally" in page and "first-leaving" not in page
    assert "no outputs recorded" in page and len(_rows(page)) == 5


def test_a_record_without_stages_renders_as_before(tmp_path):
    plain, before = _site(tmp_path / "plain", lambda recs: None)
    both, after = _site(tmp_path / "both", lambda recs: recs.append({**_port_record(recs[0]), "case": "ja"}))
    built = re.compile(r"<footer>built [^<]*</footer>")
    for rec in before:
        page = _page(plain, rec)
        assert 'id="stage-table"' not in page and 'id="stages"' not in page
        assert built.sub("", page) == built.sub("", _page(both, rec))
    assert stage_table({"stages": []}) is None and stage_table({}) is None and stage_table({"stages": "x"}) is None


def test_the_terminal_stage_table_marks_the_first_leaving_stage_and_the_buckets():
    from harness.record import Record
    from harness.report import item_table
    from harness.verdict import Verdict

    d = _port_record({"case": "tiny"})
    rec = Record(d["case"], d["step"], d["backend"], d["mode"], Verdict.FAIL, d["reason"], stages=d["stages"])
    lines = item_table(rec).splitlines()
    vocoder = next(line for line in lines if line.startswith("vocoder"))
    assert vocoder.startswith("vocoder [256]") and "DEFECT" in vocoder
    tail = next(line for line in lines if line.startswith("tail "))
    assert "DEFECT" in tail
    assert "defects (local error leaves its floor): vocoder (first), tail" in lines


def test_a_port_audit_with_lists_renders_and_a_step_stage_names_its_step(tmp_path):
    """A port item's audit holds the port (a mapping with a list of stages): the op-audit section
    sorts a mapping by value only when every value is a count. An e2e stage names its harness step."""
    def edit(recs):
        rec = _port_record(recs[0])
        rec["audit"] = {"port": {"name": "kokoro-7stage", "source": "port.yaml", "stages": [{"name": "vocoder"}]},
                        "ops": {"aten.conv1d": 3, "aten.add": 5}}
        rec["stages"][0] = {**rec["stages"][0], "artifact": None, "step": "duration_stage"}
        recs.append(rec)

    site, recs = _site(tmp_path, edit)
    page = _page(site, recs[-1])
    assert "<code>name</code>" in page and "kokoro-7stage" in page
    ops = re.search(r"<h4>ops</h4>\s*<div class=\"ops\">(.*?)</div>", page, re.S).group(1)
    assert ops.index("aten.add") < ops.index("aten.conv1d")  # counts: the largest first
    assert "step:duration_stage" in _rows(page)[0]
