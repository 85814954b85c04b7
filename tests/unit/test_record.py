"""The record as typed data: version 1 files load, version 2 round-trips, NaN stays NaN, a malformed
file names itself and its field, and docs/record.schema.json is the models' schema."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness.plumbing.errors import UsageError
from harness.record import (SCHEMA, NoiseBand, OnnxStages, PortChain, Record, StageRow, Unlocalized, ZeroNoise,
                            read_records)
from harness.report import item_table
from harness.verdict import Verdict

REPO = Path(__file__).resolve().parents[2]
NIGHTLY = Path(__file__).parent / "data" / "nightly" / "history"


def _v1_records() -> list[dict]:
    return [r for p in sorted(NIGHTLY.glob("*.json")) for r in json.loads(p.read_text())["records"]]


def test_version_1_records_load_as_version_2(tmp_path: Path):
    old = _v1_records()
    assert old and {r["schema"] for r in old} == {"kokoro-parity/record/1"}
    for i, d in enumerate(old):
        (tmp_path / f"{i:03}.json").write_text(json.dumps(d))
    records = read_records(tmp_path)
    assert len(records) == len(old)
    for rec, d in zip(records, old):
        assert rec.schema_ == SCHEMA and rec.verdict is Verdict(d["verdict"]) and rec.bisect is None
        assert rec.metrics.keys() == d["metrics"].keys()
        again = rec.to_dict()
        assert {k: again[k] for k in d if k != "schema"} == {k: v for k, v in d.items() if k != "schema"}


def _port_record() -> Record:
    judged = {"ok": False, "why": "NaN: 3 of 3 values non-finite", "kind": "nan", "rel_l2": math.nan,
              "floor_rel_l2": 2e-6}
    rec = Record("tiny", "port:two", "port", "dynamic", Verdict.FAIL, "voc:audio: NaN",
                 metrics={"voc:audio": {"rel_l2": math.nan, "snr_db": math.inf, "new_nonfinite": 3, "ok": False}})
    rec.stages.append(StageRow(stage="voc", outputs={"audio": {"local": judged, "chained": judged}}, local_ok=False))
    rec.bands["pesq"] = NoiseBand(value=math.nan, band=(3.9, 4.5), ok=False, direction="higher", why="outside", k=4)
    rec.bands["zero_noise"] = ZeroNoise(rel_l2=0.3, snr_db=10.0, kind="noise")
    rec.audit.input_mapping = {"x": "asr"}
    rec.audit["xnnpack_runtime"] = "cpu"  # a backend's own key
    rec.bisect = PortChain(port="two", stages={"voc": Unlocalized(error="judged whole"),
                                               "prosody": OnnxStages(artifact="p.onnx", port_stage="prosody", names="n", stages=[],
                                                                       first_stage="m")})
    return rec


def test_version_2_round_trips_with_its_types_and_nan_as_nan(tmp_path: Path):
    rec = _port_record()
    path = rec.write(tmp_path)
    text = path.read_text()
    assert '"rel_l2": "nan"' in text and '"snr_db": "inf"' in text
    d = json.loads(text, parse_constant=pytest.fail)  # strict JSON: no bare NaN or Infinity
    assert d["schema"] == SCHEMA and d["bisect"]["kind"] == "port-chain" and d["bisect"]["stages"]["voc"] == {
        "error": "judged whole"}
    assert d["bands"]["zero_noise"] == {"rel_l2": 0.3, "snr_db": 10.0, "kind": "noise"}  # only the keys set
    assert d["audit"] == {"input_mapping": {"x": "asr"}, "xnnpack_runtime": "cpu"}
    (back,) = read_records(tmp_path)
    assert back.to_dict() == d
    rel = back.metrics["voc:audio"]["rel_l2"]
    assert isinstance(rel, float) and math.isnan(rel) and rel != rel  # a NaN never compares equal, never passes
    assert back.metrics["voc:audio"]["snr_db"] == math.inf and back.metrics["voc:audio"]["new_nonfinite"] == 3
    assert back.metrics["voc:audio"]["ok"] is False
    assert math.isnan(back.stages[0].outputs["audio"].local.rel_l2) and not back.stages[0].local_ok
    assert isinstance(back.bands["pesq"], NoiseBand) and isinstance(back.bands["zero_noise"], ZeroNoise)
    assert isinstance(back.bisect, PortChain) and isinstance(back.bisect.stages["voc"], Unlocalized)
    assert isinstance(back.bisect.stages["prosody"], OnnxStages) and back.bisect.stages["prosody"].first_stage == "m"
    assert "localized inside the chain 'two'" in item_table(back)


def test_no_localization_is_written_as_an_empty_object():
    rec = Record("c", "decoder", "eager", "dynamic", Verdict.PASS)
    assert rec.bisect is None and rec.to_dict()["bisect"] == {}
    rec.bisect = {"status": "error", "message": "m"}  # a dict assigned is typed on assignment
    assert rec.bisect.status == "error" and "bisect: could not run: m" in item_table(rec)


@pytest.mark.parametrize("field, value, named", [
    ("metrics", {"out": {"rel_l2": [1]}}, "metrics.out.rel_l2"),
    ("stages", [{"outputs": {}}], "stages.0.stage"),
    ("bands", {"pesq": {"value": 1.0}}, "bands.pesq"),
    ("verdict", "great", "verdict"),
])
def test_a_malformed_record_names_its_file_and_field(tmp_path: Path, field: str, value, named: str):
    d = Record("c", "decoder", "eager", "dynamic", Verdict.PASS).to_dict()
    (tmp_path / "bad.json").write_text(json.dumps({**d, field: value}))
    with pytest.raises(UsageError, match="bad.json: malformed record, field " + named.replace(".", r"\.")):
        read_records(tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps({**d, "schema": "kokoro-parity/record/0"}))
    with pytest.raises(UsageError, match="bad.json: record schema 'kokoro-parity/record/0'"):
        read_records(tmp_path)


def test_the_documented_schema_is_the_models():
    written = json.loads((REPO / "docs" / "record.schema.json").read_text())
    assert written == Record.model_json_schema(), \
        "regenerate: python -c 'import json; from harness.record import Record; " \
        "print(json.dumps(Record.model_json_schema(), indent=1))' > docs/record.schema.json"
