"""Core ML conversions of the example splits (harness/port/coreml_splits.py): on the `tiny` case of
the random model, the 3-stage and 7-stage splits convert to .mlpackage files with their port file,
`port check` accepts it, the chain's item is SKIPPED off macOS (never passed), and a stage that
coremltools cannot convert is named with the converter's error and gets no file.

`pytest tests/unit/test_port_examples_coreml.py -m slow -s` prints each stage's conversion time."""
from __future__ import annotations

import platform
import re

import pytest

pytest.importorskip("coremltools")

from harness.port import coreml_splits, export_command, splits  # noqa: E402
from harness.port.portfile import load_port  # noqa: E402

DARWIN = platform.system() == "Darwin"


def test_stage_precisions_follow_the_public_port_and_overrides():
    seven = coreml_splits.precisions_for("kokoro-7stage")
    assert seven == {"albert": "float16", "post_albert": "float16", "prosody": "float16", "noise": "float32",
                     "vocoder": "float16", "tail": "float32"}
    assert set(coreml_splits.precisions_for("kokoro-3stage").values()) == {"float32"}
    assert coreml_splits.parse_precisions(["decoder=float16"], "kokoro-3stage")["decoder"] == "float16"
    with pytest.raises(ValueError, match=r"no stage 'vocoder' in kokoro-3stage; stages: duration, prosody, decoder"):
        coreml_splits.parse_precisions(["vocoder=float16"], "kokoro-3stage")
    with pytest.raises(ValueError, match=r"one of float32, float16"):
        coreml_splits.parse_precisions(["decoder=int8"], "kokoro-3stage")
    with pytest.raises(ValueError, match=r"expected STAGE=float32 or STAGE=float16"):
        coreml_splits.parse_precisions(["decoder"], "kokoro-3stage")


def test_the_export_command_takes_precision_only_for_core_ml(capsys):
    with pytest.raises(SystemExit):
        export_command.main("kokoro-3stage", "unused", ["--case", "tiny", "--precision", "decoder=float16"])
    assert "--precision, --no-workaround: only with --format coreml" in capsys.readouterr().err


def test_no_workaround_takes_the_coreml_backends_fixes():
    """A graph fix of `_inference_ir` is left out there; a patch-workaround drops its patch."""
    assert coreml_splits.workarounds_off(set()) == (set(), coreml_splits.COREML_PATCHES)
    assert coreml_splits.workarounds_off({"and_rename"}) == ({"and_rename"}, coreml_splits.COREML_PATCHES)
    assert coreml_splits.workarounds_off({"rsqrt_float_const"}) == (set(), coreml_splits.COREML_PATCHES[:-1])
    assert coreml_splits.workarounds_off({"lstm_converter"}) == ({"lstm_converter"}, coreml_splits.COREML_PATCHES)
    assert coreml_splits.workarounds_off({"all"})[1] == splits.EXPORT_PATCHES
    with pytest.raises(ValueError, match=r"--no-workaround bogus: not a Core ML workaround; known: alias_drop"):
        coreml_splits.workarounds_off({"bogus"})


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from harness.reference import module_captures
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("coreml"), run_s=300) as s:
        traces = s.traces("tiny")
        module_captures(s.model, s.cases["tiny"], traces, (splits.HAR, splits.CONV_POST))
        yield s, traces


@pytest.mark.slow
def test_a_stage_coremltools_cannot_convert_is_named_and_gets_no_file(tiny, tmp_path):
    """Without the coreml backends' `and_rename` fix, ExactSTFT's `&` of masks stays aten.__and__,
    which coremltools 9 cannot lower: the noise stage's error is the converter's, a package and a
    port file of an earlier run are removed (they are not this conversion's), no port file is written."""
    session, traces = tiny
    out = tmp_path / "k7"
    (out / "noise.mlpackage").mkdir(parents=True)  # left by an earlier run
    (out / coreml_splits.PORT_FILE).write_text("name: stale\n")
    lines = []
    port, results = coreml_splits.convert_split("kokoro-7stage", session.model, traces, out, log=lines.append,
                                                only={"noise"}, disabled={"and_rename"})
    assert port is None
    (result,) = results
    assert result.name == "noise" and not result.ok
    assert result.error.startswith("NotImplementedError: Unsupported fx node and_"), result.error
    assert result.error.endswith("kind __and__ (ops without a MIL lowering: {'__and__': 2})"), result.error
    assert f"{out / 'noise.mlpackage'}: coremltools cannot convert stage 'noise': {result.error}" in lines
    assert lines[-1] == ("no port-coreml.yaml: no package for stage(s) albert, post_albert, prosody, noise, "
                         "vocoder, tail")
    assert not (out / "noise.mlpackage").exists() and not (out / coreml_splits.PORT_FILE).exists()


@pytest.mark.slow
def test_the_3stage_split_converts_and_its_chain_is_skipped_off_macos(tiny, tmp_path):
    from harness.backends.prebuilt import describe
    from harness.cli import main
    from harness.port.chain import port_items, run_port_item
    from harness.verdict import Verdict

    session, traces = tiny
    port, results = coreml_splits.convert_split("kokoro-3stage", session.model, traces, tmp_path / "k3", log=print)
    assert [r.name for r in results] == ["duration", "prosody", "decoder"]
    assert all(r.ok for r in results), [r.error for r in results]
    assert port == tmp_path / "k3" / coreml_splits.PORT_FILE
    text = port.read_text()
    assert "converted to Core ML from random-seed0 for case 'tiny'" in text and "(6 tokens, 36 frames)" in text, text
    # Core ML I/O has no bool or int64: the port declares the package's float32 mask and int32 ids
    assert "text_mask: {tensor: text_mask, dtype: float32}  # Core ML I/O has no bool" in text
    assert "input_ids: {tensor: input_ids, dtype: int32}  # Core ML I/O has no int64" in text
    assert "dtype: float16" not in text  # every stage float32
    ins = {p.name: p for p in describe(tmp_path / "k3" / "duration.mlpackage")[0]}
    assert (ins["input_ids"].dtype, ins["input_ids"].shape) == ("int32", (1, 6))
    assert [p.name for p in describe(tmp_path / "k3" / "decoder.mlpackage")[1]] == ["audio"]

    assert main(["port", "check", str(port)]) == 0
    loaded = load_port(port)
    assert [(s.name, s.artifact, s.precision) for s in loaded.stages] == [
        ("duration", "duration.mlpackage", "float32"), ("prosody", "prosody.mlpackage", "float32"),
        ("decoder", "decoder.mlpackage", "float32")]
    assert loaded.stages[2].noise == "inputs"

    (item,) = port_items(session, [str(port)])
    rec = run_port_item(session, item)
    if DARWIN:
        assert rec.verdict is not Verdict.SKIPPED, rec.reason
    else:
        assert rec.verdict is Verdict.SKIPPED, rec.reason
        assert rec.reason == (f"stage 'duration' (duration.mlpackage): Core ML prediction needs macOS "
                              f"(this is {platform.system()})")
        assert rec.stages == []  # nothing judged, nothing passed


@pytest.mark.slow
def test_the_7stage_split_converts_in_the_public_ports_precisions(tiny, tmp_path):
    from harness.cli import main

    session, traces = tiny
    port, results = coreml_splits.convert_split("kokoro-7stage", session.model, traces, tmp_path / "k7", log=print)
    assert all(r.ok for r in results), [r.error for r in results]
    assert main(["port", "check", str(port)]) == 0
    precisions = {s.name: s.precision for s in load_port(port).stages}
    assert precisions == coreml_splits.precisions_for("kokoro-7stage")
    text = port.read_text()
    assert re.search(r"har: decoder.generator.noise_convs.0:in\n", text), text  # noise: float32
    # a FLOAT16 stage's inputs and outputs are float16 in the package, declared in the port file
    assert "bert_dur: {tensor: bert_dur, dtype: float16}  # a FLOAT16 stage's I/O" in text
    # even the ids and the mask: coremltools gives a FLOAT16 stage float16 inputs throughout
    assert "input_ids: {tensor: input_ids, dtype: float16}  # a FLOAT16 stage's I/O" in text
    assert "x: {tensor: decoder.generator.conv_post:out, dtype: float16}  # a FLOAT16 stage's I/O" in text
    assert "    inputs:\n      x: decoder.generator.conv_post:out\n" in text  # the float32 tail
    assert "# Alignment (host glue, the harness's own)" in text
