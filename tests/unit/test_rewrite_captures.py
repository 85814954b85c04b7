"""Every mapped module of a rewrite gets a row: each is captured in a step that runs it (without
MLX: the captures are the reference's side)."""
from __future__ import annotations

import pytest

from harness.model import load_random
from harness.rewrite import resolve_modules
from harness.rewrite import captures
from harness.rewrite.mlx_audio import MlxAudio

from .conftest import tiny_session_at

DURATION_PATH = ("predictor.text_encoder", "predictor.text_encoder.lstms.0", "predictor.text_encoder.lstms.1",
                 "predictor.lstm", "predictor.duration_proj")


def test_the_duration_path_is_captured_in_the_steps_that_run_it():
    """`f0n`'s prefix is `predictor`, but it runs only the shared LSTM, F0, N and their
    projections: the duration path stays in `duration_encoder` and `duration` even when F0 blocks
    are mapped too (it used to go to `f0n`, never ran, and had no row), and a generator module
    still comes from the decoder's run when the decoder is mapped."""
    paths = tuple(n for n, _ in load_random(0).kmodel.named_modules() if n)
    mapped = [m.path for m in resolve_modules(MlxAudio(), paths, "mlx-audio")]
    steps = captures.steps_for(mapped)
    assert {p: steps[p] for p in DURATION_PATH} == {
        "predictor.text_encoder": "duration_encoder", "predictor.text_encoder.lstms.0": "duration_encoder",
        "predictor.text_encoder.lstms.1": "duration_encoder", "predictor.lstm": "duration",
        "predictor.duration_proj": "duration"}
    assert steps["predictor.F0.0"] == "f0n" and steps["decoder.generator.conv_post"] == "decoder"


@pytest.mark.slow
def test_each_mapped_module_is_consumed_once_and_a_module_never_run_is_an_error(tmp_path, monkeypatch):
    """module_io hands on every path it was given, each once (ALBERT's shared layer runs 12 times);
    a path its step never runs is an error, never a missing row."""
    with tiny_session_at(tmp_path) as session:
        km32, km64 = captures.reference_models(session.model.kmodel)
        traces = session.traces("tiny")
        paths = [*DURATION_PATH, "predictor.F0.0", "predictor.F0_proj",
                 "bert.encoder.albert_layer_groups.0.albert_layers.0.ffn"]
        got = []
        captures.module_io(km32, km64, traces, paths, lambda io: got.append(io.path))
        assert sorted(got) == sorted(paths)

        monkeypatch.setattr(captures, "steps_for", lambda ps: {p: "f0n" for p in ps})  # the old assignment
        with pytest.raises(RuntimeError, match="never ran mapped module.*predictor.lstm"):
            captures.module_io(km32, km64, traces, ["predictor.F0.0", "predictor.lstm"], lambda io: None)
