"""scan_lstm as the default LSTM of the xnnpack and portable backends, and the control-flow
partitioner that puts the scan body into the XNNPACK delegate (issue 19 part 1).

- only xnnpack and portable apply scan_lstm by default; `--no-workaround scan_lstm` gives the
  unrolled program back, `--no-workaround unrolled_lstm` on xnnpack gives aten.lstm (both go);
- the partitioner is part of xnnpack's artifact key, so an artifact lowered by the stock
  partitioner is not reused;
- lowered by the backend, a scan program has a delegate call inside the scan body (none with the
  partitioner switched off), the audit counts the body's nodes, the output is at the fp32 floor,
  and the repro runner lowers the same way.
"""
from __future__ import annotations

import copy

import pytest
import torch

from harness.backends import backend_names, get_backend, set_disabled_workarounds

SCAN_DEFAULT = {"xnnpack", "portable"}


@pytest.fixture
def no_workaround(monkeypatch):
    """Switch workarounds off for this test only (the variable is restored afterwards)."""
    from harness.backends import NO_WORKAROUND_ENV

    monkeypatch.delenv(NO_WORKAROUND_ENV, raising=False)

    def switch(*names):
        set_disabled_workarounds(names)
        monkeypatch.setenv(NO_WORKAROUND_ENV, ",".join(names))

    return switch


def test_scan_lstm_is_a_default_of_xnnpack_and_portable_only():
    for name in ("eager", "xnnpack", "portable", "xnnpack-fp16", "et-coreml", "et-mps", "tvm", "onnxruntime",
                 "tvm-onnx", "coreml-fp32", "coreml-fp16", "fp16"):
        assert name in backend_names()
        patches = get_backend(name).patches
        assert ("scan_lstm" in patches) == (name in SCAN_DEFAULT), (name, patches)
    for name in SCAN_DEFAULT:  # the cell it loops over is there too (scan_lstm is registered after it)
        assert "unrolled_lstm" in get_backend(name).patches
        assert "scan_lstm" in get_backend(name).workarounds


def test_no_workaround_takes_the_lstm_back_to_unrolled_or_aten(no_workaround):
    from harness.runner import Session, workarounds_of

    session = Session()
    xnnpack, portable = get_backend("xnnpack"), get_backend("portable")
    assert {"unrolled_lstm", "scan_lstm"} <= set(session.patches_for(xnnpack))
    no_workaround("scan_lstm")
    assert "scan_lstm" not in session.patches_for(xnnpack) and "unrolled_lstm" in session.patches_for(xnnpack)
    assert "scan_lstm" not in session.patches_for(portable) and "unrolled_lstm" in session.patches_for(portable)
    no_workaround("unrolled_lstm")  # aten.lstm, the defect unrolled_lstm hides: no scan of its cell either
    assert not {"unrolled_lstm", "scan_lstm"} & set(session.patches_for(xnnpack))
    assert workarounds_of(xnnpack)["disabled"] == ["scan_lstm", "unrolled_lstm"]
    assert {"unrolled_lstm", "scan_lstm"} <= set(session.patches_for(portable))  # not workarounds there


def test_the_partitioner_is_in_the_artifact_key(no_workaround):
    from harness.runner import Session

    xnnpack = get_backend("xnnpack")
    on, patches = xnnpack.artifact_key("p"), Session().patches_for(xnnpack)
    assert "partitioner=control_flow" in xnnpack.version()
    for other in ("portable", "et-coreml", "et-mps"):  # their own partitioners (or none)
        assert "partitioner=control_flow" not in get_backend(other).version(), other
    no_workaround("control_flow_partitioner")
    assert xnnpack.artifact_key("p") != on
    assert "no-workaround=control_flow_partitioner" in xnnpack.version()
    assert Session().patches_for(xnnpack) == patches  # a compile setting: the program stays


def test_program_keys_change_for_lstm_steps_only(no_workaround):
    from harness.programs import program_key
    from harness.runner import Session

    session, xnnpack = Session(), get_backend("xnnpack")
    inputs = {"x": torch.zeros(1, 4)}
    scan = {s: program_key(s, inputs, session.patches_for(xnnpack), "d")[0] for s in ("f0n", "decoder")}
    no_workaround("scan_lstm")
    unrolled = {s: program_key(s, inputs, session.patches_for(xnnpack), "d")[0] for s in ("f0n", "decoder")}
    assert scan["f0n"] != unrolled["f0n"]
    assert scan["decoder"] == unrolled["decoder"]  # scan_lstm cannot change the decoder: its program is shared


# ---- lowering a scan program with the backend -----------------------------------------------------

def _scan_program(tmp_path):
    """A small bidirectional LengthAwareLSTM(impl="scan") exported over 8 steps, saved as the
    backend takes it, with its packed float64 reference and the float32 eager error (the floor)."""
    pytest.importorskip("executorch")
    from harness.patches.length_aware_lstm import LengthAwareLSTM, packed_lstm_reference

    torch.manual_seed(0)
    lstm = torch.nn.LSTM(16, 8, batch_first=True, bidirectional=True).eval()

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = LengthAwareLSTM(lstm, impl="scan")

        def forward(self, x, lengths):
            return self.lstm(x, lengths)

    x = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(5))
    lengths = torch.tensor([6])
    with torch.no_grad():
        program = torch.export.export(Wrapper().eval(), (x, lengths), strict=False)
        eager = Wrapper().eval()(x, lengths)
        ref64, _ = packed_lstm_reference(copy.deepcopy(lstm).double(), x.double(), lengths)
    path = tmp_path / "program.pt2"
    torch.export.save(program, str(path))
    return path, program, [x, lengths], ref64, rel(eager, ref64)


def rel(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


def test_xnnpack_lowering_delegates_the_scan_body(tmp_path, no_workaround):
    """The backend's own compile: with the control-flow partitioner the scan body holds a delegate
    (audit: delegated subgraphs in bodies), without it none, and the body's nodes are counted
    either way (on portable kernels: in ops_outside_delegate); both artifacts run at the fp32 floor with the padded steps exactly zero."""
    path, _, inputs, ref64, floor = _scan_program(tmp_path)
    audits = {}
    for name in ("control_flow", "stock"):
        if name == "stock":
            no_workaround("control_flow_partitioner")
        backend = get_backend("xnnpack")
        out = tmp_path / name
        out.mkdir()
        audits[name] = backend.compile(path, out)
        y = backend.run(out / backend.artifact_name, inputs)[0]
        assert rel(y, ref64) <= 3 * floor + 1e-7, (name, rel(y, ref64), floor)
        assert torch.count_nonzero(y[0, 6:]) == 0, name
    on, off = audits["control_flow"], audits["stock"]
    assert on["control_flow_bodies"] == off["control_flow_bodies"] == 1
    assert on["delegated_subgraphs_in_bodies"] >= 1 and off["delegated_subgraphs_in_bodies"] == 0
    assert on["delegate_coverage"] > off["delegate_coverage"]
    assert "aten_bmm_default" in off["ops_outside_delegate"]  # the body's cell, counted on portable kernels
    assert "aten_bmm_default" not in on["ops_outside_delegate"], on["ops_outside_delegate"]


def test_repro_runner_lowers_with_the_control_flow_partitioner(tmp_path, no_workaround):
    """repro.py carries the partitioner's source and needs nothing of this harness; with the
    workaround off it uses the stock partitioner, as the backend does."""
    import ast

    _, program, inputs, ref64, floor = _scan_program(tmp_path)
    source = get_backend("xnnpack").repro_source()
    imported = {n.module.split(".")[0] for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name.split(".")[0] for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert imported <= {"executorch", "torch"}, imported
    assert "class XnnpackControlFlowPartitioner" in source
    namespace: dict = {"torch": torch}
    exec(compile(source, "repro.py", "exec"), namespace)  # noqa: S102 - the runner repro.py would run
    y = namespace["run_backend"](program, inputs)[0]
    assert rel(y, ref64) <= 3 * floor + 1e-7
    no_workaround("control_flow_partitioner")
    stock = get_backend("xnnpack").repro_source()
    assert "XnnpackControlFlowPartitioner" not in stock and "[XnnpackPartitioner()]" in stock


# ---- a real step: the tiny case, random weights ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_session(tmp_path_factory):
    pytest.importorskip("executorch")
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("scan"), compile_s=900) as s:
        yield s


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xnnpack", "portable"])
def test_lstm_step_with_the_default_patches_passes_with_its_scan_body_delegated(tiny_session, backend, monkeypatch):
    """f0n (predictor.shared: one bidirectional LSTM) static on the tiny case, with the backend's
    default patches: the item passes (its error within the fp32 floor rule) and, on xnnpack, the
    lowered scan body holds a delegate call."""
    from harness.backends import NO_WORKAROUND_ENV
    from harness.runner import Item
    from harness.verdict import Verdict

    monkeypatch.delenv(NO_WORKAROUND_ENV, raising=False)  # the defaults, whatever an earlier test switched off

    rec = tiny_session.run(Item("tiny", "f0n", backend, "static"))
    assert rec.verdict is Verdict.PASS, (rec.reason, rec.metrics)
    assert "scan_lstm" in rec.patches and "scan_lstm" in rec.workarounds["applied"]
    if backend == "xnnpack":
        assert rec.audit["control_flow_bodies"] >= 1
        assert rec.audit["delegated_subgraphs_in_bodies"] >= 1, rec.audit
        assert "control_flow_partitioner" in rec.workarounds["applied"]
