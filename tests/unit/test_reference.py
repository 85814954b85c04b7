"""References: teacher-forced step traces, valid regions, submodule capture."""
from __future__ import annotations

import torch

from harness.cases import Bucket, Case
from harness.reference import capture_submodules, compute_traces
from harness.steps import get_step

CASE = Case(id="tiny", language="en-us", text="Hi.", phonemes="hˈI.", voice="jf_alpha",
            bucket=Bucket(tokens=16, frames=400))


def test_token_steps_dynamic_and_static(random_model):
    tr = compute_traces(random_model, CASE, steps=("bert", "bert_encoder", "duration_encoder", "duration"))
    n = tr.valid.tokens
    assert n == len("hˈI.") + 2
    assert tr.inputs("bert", "dynamic")["input_ids"].shape == (1, n)
    assert tr.inputs("bert", "static")["input_ids"].shape == (1, 16)
    assert tr.inputs("duration_encoder", "static")["text_mask"][0, n:].all()  # padding is masked
    assert tr.inputs("duration_encoder", "static")["input_lengths"].item() == n  # real length
    # float64 traces are the same steps on the same (cast) inputs
    assert tr.inputs("bert_encoder", "dynamic", "float64")["bert_dur"].dtype == torch.float64
    out32 = tr.outputs("duration_encoder", "dynamic", "float32")["d"].double()
    out64 = tr.outputs("duration_encoder", "dynamic", "float64")["d"]
    assert 0 < float((out32 - out64).norm() / out64.norm()) < 1e-5  # the fp32 noise floor
    # the static reference differs from the dynamic one on the valid region: the rewrite drift
    static = tr.valid_region("duration_encoder", "d", tr.outputs("duration_encoder", "static")["d"])
    assert static.shape == out32.shape and float((static - out32.float()).abs().max()) > 1e-4
    assert len(tr.pred_dur) == n and all(d >= 1 for d in tr.pred_dur)
    # kokoro pads into float32 zeros: the float64 references must not be rounded back to float32
    for (step, mode, dtype), (_, outputs) in tr.io.items():
        if dtype == "float64":
            assert all(t.dtype == torch.float64 for t in outputs.values()), (step, mode)


def test_capture_submodules_by_path(random_model):
    step = get_step("bert_encoder")
    module = step.module(random_model.kmodel)
    seen = capture_submodules(module, [torch.randn(1, 5, 768)])
    assert list(seen) == ["kmodel", "kmodel.bert_encoder"] or "kmodel.bert_encoder" in seen
    assert seen["kmodel.bert_encoder"].shape == (1, 5, 512)


def test_float64_references_leave_out_patches_that_only_rewrite_ops(random_model, tmp_path, monkeypatch):
    """A patch that writes the same function with other ops (`same_function`: the LSTM as a scan)
    changes a float64 run by rounding only: the float64 reference of a patch set is that of its
    function-changing patches alone (length_aware_lstm here), computed once for every set that
    shares them, and a set of only such patches reads the trace's own float64 outputs. Float32
    keeps every patch."""
    from harness import reference
    from harness.plumbing.cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    traces = compute_traces(random_model, CASE, steps=("bert", "bert_encoder", "duration_encoder"))
    built = []  # the patch sets a reference run was built for
    monkeypatch.setattr(reference, "apply_patches",
                        lambda km, names, real=reference.apply_patches: built.append(tuple(names)) or real(km, names))
    step, mode = "duration_encoder", "static"
    own = reference.variant_output(random_model, CASE, traces, step, mode, ("scan_lstm",), "float64")
    assert not built and own is not None
    assert all(torch.equal(own[k], traces.outputs(step, mode, "float64")[k]) for k in own)
    aware = reference.variant_output(random_model, CASE, traces, step, mode, ("length_aware_lstm",), "float64")
    scanned = reference.variant_output(random_model, CASE, traces, step, mode, ("length_aware_lstm", "scan_lstm"),
                                       "float64")
    assert len(built) == 1 and all(torch.equal(aware[k], scanned[k]) for k in aware)  # one float64 run
    assert not torch.equal(aware["d"], own["d"])  # length_aware_lstm changes the static function: its own run
    reference.variant_output(random_model, CASE, traces, step, mode, ("scan_lstm",), "float32")
    assert len(built) == 2 and "scan_lstm" in built[-1]  # float32 runs with every patch of the set


def test_reading_a_steps_inputs_runs_nothing(random_model, tmp_path, monkeypatch):
    """A step's inputs are forced from the chain: reading them computes none of the step's
    references (a patched item's float64 inputs used to cost a float64 run of the whole step), and
    they are the inputs its references are then computed from."""
    from harness.plumbing.cache import CACHE_ENV
    from harness.reference import load_traces

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    traces = load_traces(random_model, CASE)

    def step_entries():
        return list((tmp_path / "cache" / "traces").glob("*/io.pt"))

    for made, mode in enumerate(("dynamic", "static")):
        read = traces.inputs("bert_encoder", mode, "float64")
        assert len(step_entries()) == made
        traces.outputs("bert_encoder", mode, "float64")  # the step's references, computed now
        assert read.keys() == traces.inputs("bert_encoder", mode, "float64").keys()
        assert all(torch.equal(read[k], v) for k, v in traces.inputs("bert_encoder", mode, "float64").items())
    assert len(step_entries()) == 2
