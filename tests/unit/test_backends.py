"""Backends of issue 7: registry and entry points, op audits, frontend-gap patches, crash and
timeout isolation, the fp16 activation audit, Core ML's compile-only outcome, and `--artifact`."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.backends import backend_names, compile_job, get_backend
from harness.plumbing.jobs import run_job
from tests.unit.conftest import shared_references

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = Path(__file__).resolve().parent / "example_backend"
BUILTIN = ("eager", "xnnpack", "portable", "tvm", "onnxruntime", "tvm-onnx", "coreml-fp32", "coreml-fp16", "fp16")


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def export(module: nn.Module, args: tuple, path: Path) -> Path:
    with torch.no_grad():
        torch.export.save(torch.export.export(module.eval(), args, strict=False), str(path))
    return path


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(6, 4)

    def forward(self, x, y):
        return self.proj(x) * 2, y.sum(-1)


@pytest.fixture(scope="session")
def small_program(tmp_path_factory) -> tuple[Path, tuple]:
    args = (torch.randn(1, 3, 6), torch.randn(2, 5))
    return export(Small(), args, tmp_path_factory.mktemp("prog") / "program.pt2"), args


@pytest.fixture(scope="module")
def example_backends(tmp_path_factory):
    """The example package installed as a user would (pip, no network), into a directory that
    this process and its child jobs both see: entry points found through sys.path/PYTHONPATH."""
    import shutil

    source, target = tmp_path_factory.mktemp("src") / "example_backend", tmp_path_factory.mktemp("site")
    shutil.copytree(EXAMPLE, source)  # setuptools builds in the source tree: keep the repo clean
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(source)], check=True, cwd=source)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(target))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
        yield target


# ---- registry ---------------------------------------------------------------------------

def test_builtin_backends_are_registered_and_say_whether_they_can_run():
    names = backend_names()
    for name in BUILTIN:
        assert name in names
        b = get_backend(name)
        assert b.name == name and b.description
        ok, why = b.available()
        assert ok or why
        assert b.version()


def test_tvm_version_names_the_distribution():
    pytest.importorskip("tvm")
    assert get_backend("tvm").version().startswith("apache-tvm==")


def test_entry_point_backend_is_found_in_process_and_in_the_cli(example_backends):
    names = backend_names()
    assert {"example-interpreter", "example-segfault", "example-hang"} <= set(names)
    assert get_backend("example-interpreter").available() == (True, "")
    out = subprocess.run([sys.executable, "-m", "harness.cli", "backends"], capture_output=True, text=True,
                         check=True, cwd=REPO, env=os.environ.copy()).stdout
    assert "example-interpreter" in out and "available" in out


def test_entry_point_backend_compiles_and_runs_in_child_jobs(example_backends, small_program, tmp_path):
    program, args = small_program
    result = run_job("harness.backends:compile_job", dict(backend="example-interpreter", program_path=str(program),
                                                          out_dir=str(tmp_path)), tmp_path, timeout=300)
    assert result.ok, result.error + result.log_tail
    assert result.value["audit"] == {"example": "copied the program"}
    torch.save(list(args), tmp_path / "inputs.pt")
    ran = run_job("harness.backends:run_artifact_job", dict(backend="example-interpreter", artifact_path=str(tmp_path / "program.pt2"),
                                                   inputs_path=str(tmp_path / "inputs.pt"),
                                                   outputs_path=str(tmp_path / "outputs.pt")), tmp_path / "run", timeout=300)
    assert ran.ok, ran.error
    out = torch.load(tmp_path / "outputs.pt")
    expected = Small()(*args)
    assert all(torch.allclose(o, e) for o, e in zip(out, expected))


# ---- crash and time limits --------------------------------------------------------------

def test_a_segfaulting_compile_is_a_crash_with_its_signal(example_backends, small_program, tmp_path):
    program, _ = small_program
    result = run_job("harness.backends:compile_job", dict(backend="example-segfault", program_path=str(program),
                                                          out_dir=str(tmp_path)), tmp_path, timeout=300)
    assert result.status == "crashed"
    assert "SIGSEGV" in result.error


def test_a_hanging_compile_is_a_timeout(example_backends, small_program, tmp_path):
    program, _ = small_program
    result = run_job("harness.backends:compile_job", dict(backend="example-hang", program_path=str(program),
                                                          out_dir=str(tmp_path)), tmp_path, timeout=8)
    assert result.status == "timeout"
    assert result.seconds < 60


# ---- op audits ---------------------------------------------------------------------------

class Exotic(nn.Module):
    def forward(self, x):
        return torch.special.bessel_j0(x) + 1


@pytest.fixture(scope="session")
def exotic_program(tmp_path_factory):
    return torch.export.load(str(export(Exotic(), (torch.randn(3),), tmp_path_factory.mktemp("ex") / "p.pt2")))


def test_executorch_audit_lists_ops_outside_core_aten(exotic_program):
    from harness.backends.executorch import _core_aten_violations

    assert _core_aten_violations(exotic_program.run_decompositions()) == {"aten.special_bessel_j0.default": 1}


def test_tvm_audit_lists_ops_without_a_converter(exotic_program):
    pytest.importorskip("tvm")
    from harness.backends.tvm import frontend_gaps

    assert frontend_gaps(exotic_program)["ops_without_converter"] == {"special_bessel_j0.default": 1}


def test_onnx_audit_lists_ops_the_exporter_cannot_translate(exotic_program):
    from harness.backends.onnx import exporter_gaps

    gaps = exporter_gaps(exotic_program)["ops_without_onnx_translation"]
    assert any("bessel_j0" in k for k in gaps), gaps


def test_coreml_audit_lists_ops_without_a_mil_lowering(exotic_program):
    pytest.importorskip("coremltools")
    from harness.backends.coreml import _inference_ir, mil_gaps

    assert mil_gaps(_inference_ir(exotic_program))["ops_without_mil_lowering"] == {"special_bessel_j0": 1}


class NewOnes(nn.Module):
    """What ALBERT does with its attention mask."""
    def forward(self, x):
        return x * x.new_ones(x.shape)


def test_coreml_gets_torchs_decomposition_of_ops_it_cannot_lower(tmp_path):
    """coremltools 9: 'Unsupported fx node new_ones' (bert). The backend decomposes ops without a
    MIL lowering that torch can decompose; the raw inference IR still has the gap."""
    ct = pytest.importorskip("coremltools")
    from harness.backends.coreml import _inference_ir, mil_gaps

    with torch.no_grad():
        program = torch.export.export(NewOnes(), (torch.randn(2, 3),), strict=False)
    raw = program.run_decompositions({})
    assert mil_gaps(raw)["ops_without_mil_lowering"] == {"new_ones": 1}
    with pytest.raises(Exception, match="new_ones"):
        ct.convert(raw, convert_to="mlprogram", skip_model_load=True)
    assert mil_gaps(_inference_ir(program))["ops_without_mil_lowering"] == {}
    ct.convert(_inference_ir(program), convert_to="mlprogram", skip_model_load=True)


class MaskAnd(nn.Module):
    def forward(self, a, b):
        return torch.where((a == 0) & (b < 0), torch.full_like(a, 3.0), a + b)


def test_a_failed_compile_keeps_its_audit(tmp_path):
    """coremltools 9 has no lowering for special_bessel_j0: the compile fails, the audit says why."""
    pytest.importorskip("coremltools")
    program = export(Exotic(), (torch.randn(3),), tmp_path / "p.pt2")
    result = run_job("harness.backends:compile_job", dict(backend="coreml-fp32", program_path=str(program),
                                                          out_dir=str(tmp_path / "out")), tmp_path / "job", timeout=600)
    assert result.status == "error"
    assert "bessel_j0" in result.error
    assert result.value["audit"]["ops_without_mil_lowering"] == {"special_bessel_j0": 1}


def test_coreml_takes_and_of_masks_as_bitwise_and(tmp_path):
    """coremltools 9: 'Unsupported fx node and_1, kind __and__' (bert's attention mask); the backend
    renames it to bitwise_and, which it lowers, and the raw IR still shows the gap."""
    ct = pytest.importorskip("coremltools")
    from harness.backends.coreml import _inference_ir, mil_gaps

    with torch.no_grad():
        program = torch.export.export(MaskAnd(), (torch.randn(4), torch.randn(4)), strict=False)
    assert mil_gaps(program.run_decompositions({}))["ops_without_mil_lowering"] == {"__and__": 1}
    ir = _inference_ir(program)
    assert mil_gaps(ir)["ops_without_mil_lowering"] == {}
    a, b = torch.tensor([0.0, 0.0, 1.0, -1.0]), torch.tensor([-1.0, 1.0, -1.0, -2.0])
    assert torch.equal(ir.module()(a, b), MaskAnd()(a, b))
    ct.convert(ir, convert_to="mlprogram", skip_model_load=True)


class WholeTableSlice(nn.Module):
    """ALBERT's `position_ids[:, :seq_len]`: with a bucket as long as the table it exports as alias."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.arange(8.0).unsqueeze(0))

    def forward(self, x):
        return x + self.pos[:, : x.shape[1]]


def test_coreml_drops_identity_alias_views(tmp_path):
    """coremltools 9: 'Unsupported fx node alias, kind alias' (en_long's bert in the 512-token
    bucket); the backend drops the identity view, and the result is the same."""
    ct = pytest.importorskip("coremltools")
    from harness.backends.coreml import _inference_ir, mil_gaps

    x = torch.randn(1, 8)
    with torch.no_grad():
        program = torch.export.export(WholeTableSlice(), (x,), strict=False)
    assert mil_gaps(program.run_decompositions({}))["ops_without_mil_lowering"] == {"alias": 1}
    ir = _inference_ir(program)
    assert mil_gaps(ir)["ops_without_mil_lowering"] == {}
    assert torch.equal(ir.module()(x), WholeTableSlice()(x))
    ct.convert(ir, convert_to="mlprogram", skip_model_load=True)


def test_coreml_converts_lstms_to_its_own_lstm_op_in_a_graph_flat_in_T():
    """coremltools 9: 'Unsupported fx node lstm, kind lstm.input'. With `lstm_converter` a plain
    bidirectional nn.LSTM (dynamic items) is one MIL `lstm` op and a length-aware one (static items:
    one aten.lstm per direction) two, the same ops at every length; without it torch's decomposition
    writes the cell out per step (`decompose_unlowered`), and without both, the defect."""
    ct = pytest.importorskip("coremltools")
    from harness.backends.coreml import _inference_ir, _lstm_converter
    from harness.patches.length_aware_lstm import LengthAwareLSTM

    def mil_ops(T, length_aware, disabled=()):
        torch.manual_seed(0)
        lstm = nn.LSTM(16, 8, 1, batch_first=True, bidirectional=True)
        module, args = (lstm, (torch.randn(1, T, 16),))
        if length_aware:
            module, args = LengthAwareLSTM(lstm, impl="aten"), (*args, torch.tensor([T - 2]))
        with torch.no_grad():
            program = torch.export.export(module.eval(), args, strict=False)
        model = ct.convert(_inference_ir(program, disabled), convert_to="mlprogram", skip_model_load=True)
        return Counter(op.type for f in model.get_spec().mlProgram.functions.values()
                       for block in f.block_specializations.values() for op in block.operations if op.type != "const")

    try:
        for length_aware, n_lstm in ((False, 1), (True, 2)):
            short = mil_ops(8, length_aware)
            assert short["lstm"] == n_lstm and mil_ops(96, length_aware) == short
        written_out = mil_ops(8, True, {"lstm_converter"})
        assert "lstm" not in written_out and sum(mil_ops(16, True, {"lstm_converter"}).values()) > sum(written_out.values())
        with pytest.raises(NotImplementedError, match="Unsupported fx node lstm"):
            mil_ops(8, True, {"lstm_converter", "decompose_unlowered"})
    finally:
        _lstm_converter(True)


class RsqrtInt(nn.Module):
    def __init__(self, patched: bool):
        super().__init__()
        self.patched = patched

    def forward(self, x):
        return x * torch.rsqrt(torch.tensor(2.0 if self.patched else 2))


def test_coreml_rejects_rsqrt_of_an_int_constant_and_takes_the_patched_one(tmp_path):
    """kokoro's AdainResBlk1d: when the first conversion passes, coremltools fixed it."""
    ct = pytest.importorskip("coremltools")
    x = torch.randn(1, 3)
    for patched in (False, True):
        with torch.no_grad():
            program = torch.export.export(RsqrtInt(patched), (x,), strict=False).run_decompositions({})
        if not patched:
            with pytest.raises(ValueError, match=r'Op "rsqrt".*got tensor\[int32\]'):
                ct.convert(program, convert_to="mlprogram", skip_model_load=True)
        else:
            ct.convert(program, convert_to="mlprogram", skip_model_load=True)
    assert torch.equal(RsqrtInt(True)(x), RsqrtInt(False)(x))


# ---- Core ML: compiled here, predicted only on macOS -------------------------------------

@pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS Core ML runs")
def test_coreml_compiles_on_linux_and_says_why_it_cannot_run(small_program, tmp_path):
    pytest.importorskip("coremltools")
    program, _ = small_program
    b = get_backend("coreml-fp16")
    ok, why = b.runnable()
    assert not ok and "macOS" in why
    meta = compile_job("coreml-fp16", str(program), str(tmp_path))
    assert (tmp_path / "model.mlpackage").is_dir() and meta["artifact_bytes"] > 0
    assert meta["audit"]["compute_precision"] == "FLOAT16" and meta["audit"]["ops_without_mil_lowering"] == {}
    assert meta["audit"]["inputs"] == ["x", "y"]


# ---- fp16: activations against 65,504 ----------------------------------------------------

class Loud(nn.Module):
    def __init__(self):
        super().__init__()
        self.quiet = nn.Linear(4, 4)
        self.big = nn.Linear(4, 4)
        with torch.no_grad():  # quiet: the identity (|x| 1); big: 4e5 from ones, over float16's range
            self.quiet.weight.copy_(torch.eye(4))
            self.quiet.bias.zero_()
            self.big.weight.fill_(1e5)
            self.big.bias.zero_()

    def forward(self, x):
        return self.big(self.quiet(x)).sum(-1, keepdim=True) / 1e5


def test_fp16_reports_activations_over_the_float16_limit(tmp_path):
    x = torch.ones(1, 4)
    program = export(Loud(), (x,), tmp_path / "p.pt2")
    b = get_backend("fp16")
    b.compile(program, tmp_path)
    (out,) = b.run(tmp_path / b.artifact_name, [x])
    audit = b.run_audit
    assert audit["fp16_max"] == 65504.0
    assert "big" in audit["modules_over_fp16_max"] and "quiet" not in audit["modules_over_fp16_max"]
    assert audit["largest_activation"] > 65504.0
    assert audit["fp16_first_nonfinite"] and "big" in audit["fp16_first_nonfinite"]
    assert not torch.isfinite(out).all()  # and the output shows it: the verdict fails it


def test_fp16_runs_the_program_in_half_precision(small_program, tmp_path):
    program, args = small_program
    b = get_backend("fp16")
    b.compile(program, tmp_path)
    out = b.run(tmp_path / b.artifact_name, list(args))
    expected = Small()(*args)
    for o, e in zip(out, expected):
        assert o.dtype == torch.float32
        assert 1e-5 < rel(o, e) < 1e-2  # float16 rounding: visible, small


# ---- frontend-gap patches ---------------------------------------------------------------

def decode(model, inputs, noise):
    from harness.patches import provide_noise

    asr, f0, n, s, _ = inputs
    with torch.no_grad(), provide_noise(noise):
        return model.decoder(asr, f0, n, s)


@pytest.mark.parametrize("name", ["stft_phase_where", "rsqrt_float_const"])
def test_frontend_gap_patches_match_eager(random_model, decoder_inputs, name):
    from harness.patches import PATCHES, apply_patches, sample_noise

    noise = sample_noise(3, 600 * decoder_inputs[-1])
    base = apply_patches(random_model.kmodel, ["noise_as_input", "custom_stft"])
    patched = apply_patches(random_model.kmodel, ["noise_as_input", "custom_stft", name])
    assert PATCHES[name].preserves_semantics
    assert name in patched._parity_patches
    assert rel(decode(patched, decoder_inputs, noise), decode(base, decoder_inputs, noise)) < 1e-6


def test_frontend_gap_patches_match_eager_in_float64(random_model, decoder_inputs):
    """The variant references run them in float64 too."""
    from harness.patches import apply_patches, sample_noise, to_float64

    names = ["noise_as_input", "custom_stft"]
    noise = {k: v.double() for k, v in sample_noise(3, 600 * decoder_inputs[-1]).items()}
    inputs = tuple(t.double() if isinstance(t, torch.Tensor) else t for t in decoder_inputs)
    base = to_float64(apply_patches(random_model.kmodel, names))
    patched = to_float64(apply_patches(random_model.kmodel, [*names, "stft_phase_where", "rsqrt_float_const"]))
    assert rel(decode(patched, inputs, noise), decode(base, inputs, noise)) < 1e-12


class Stft(nn.Module):
    def __init__(self, patched: bool):
        super().__init__()
        import types

        from kokoro.custom_stft import CustomSTFT

        from harness.patches.frontends import _custom_stft_transform

        self.stft = CustomSTFT(filter_length=20, hop_length=5, win_length=20)
        if patched:
            self.stft.transform = types.MethodType(_custom_stft_transform, self.stft)

    def forward(self, w):
        return self.stft.transform(w)


class Interp(nn.Module):
    def forward(self, x):
        return F.interpolate(x, scale_factor=30, mode="linear")


def _tvm_build_and_run(module, args, convert_map=None):
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program

    with torch.no_grad():
        mod = from_exported_program(torch.export.export(module, args, strict=False), custom_convert_map=convert_map)
    vm = relax.VirtualMachine(relax.build(mod, target="llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a.numpy()) for a in args])
    outs = out if not hasattr(out, "numpy") else [out]
    return [torch.from_numpy(np.array(o.numpy())) for o in outs]


def test_tvm_rejects_the_boolean_index_put_and_takes_the_patched_stft():
    """When this starts failing at the first step, TVM fixed the gap: the patch can go."""
    pytest.importorskip("tvm")
    w = torch.randn(1, 400)
    with pytest.raises(Exception, match="IndexPut requires each index tensor to have integer dtype"):
        _tvm_build_and_run(Stft(patched=False).eval(), (w,))
    got = _tvm_build_and_run(Stft(patched=True).eval(), (w,))
    expected = Stft(patched=False)(w)
    assert rel(got[0], expected[0]) < 1e-5  # magnitude
    assert rel(got[1], expected[1]) < 1e-4  # phase (atan2)


def test_tvm_fails_one_sided_int_clamps_and_the_backends_converter_fixes_them():
    """TVM lowers `int64.clamp(max=n)` (torch's linear interpolation) to clip(-inf, n) and fails;
    the backend's clamp converter is exact. When the first step passes, TVM fixed it."""
    pytest.importorskip("tvm")
    from harness.backends.tvm import CONVERTER_FIXES

    x = torch.randn(1, 2, 16)
    with pytest.raises(Exception, match="Cannot convert infinity to BigInt"):
        _tvm_build_and_run(Interp(), (x,))
    (got,) = _tvm_build_and_run(Interp(), (x,), CONVERTER_FIXES)
    assert rel(got, F.interpolate(x, scale_factor=30, mode="linear")) < 1e-6


# ---- --artifact: mapping ----------------------------------------------------------------

def test_map_inputs_by_name_by_loose_name_and_by_position():
    from harness.artifacts import Port, map_inputs

    inputs = {"asr": torch.zeros(1, 512, 10), "F0_pred": torch.zeros(1, 20)}
    assert map_inputs([Port("F0_pred", (1, 20)), Port("asr", (1, 512, 10))], inputs) == ["F0_pred", "asr"]
    assert map_inputs([Port("f0-pred", (1, "n")), Port("ASR", None)], inputs) == ["F0_pred", "asr"]
    assert map_inputs([Port(None, (1, 512, 10)), Port(None, (1, 20))], inputs) == ["asr", "F0_pred"]


def test_map_inputs_says_clearly_what_does_not_fit():
    from harness.artifacts import ArtifactMismatch, Port, map_inputs

    inputs = {"asr": torch.zeros(1, 512, 10), "F0_pred": torch.zeros(1, 20)}
    with pytest.raises(ArtifactMismatch, match=r"artifact input 'asr' has shape \[1, 512, 99\], the step's 'asr' has \[1, 512, 10\]"):
        map_inputs([Port("asr", (1, 512, 99)), Port("F0_pred", (1, 20))], inputs)
    with pytest.raises(ArtifactMismatch, match=r"takes 1 inputs .* the step gives 2"):
        map_inputs([Port("asr", (1, 512, 10))], inputs)


def test_parse_spec_rejects_what_it_cannot_use(tmp_path):
    from harness.artifacts import parse_spec

    (tmp_path / "m.onnx").write_bytes(b"")
    (tmp_path / "m.bin").write_bytes(b"")
    assert parse_spec(f"decoder={tmp_path / 'm.onnx'}") == ("decoder", str(tmp_path / "m.onnx"))
    with pytest.raises(ValueError, match="STEP=PATH"):
        parse_spec("decoder")
    with pytest.raises(ValueError, match="unknown step"):
        parse_spec(f"vocoder={tmp_path / 'm.onnx'}")
    with pytest.raises(ValueError, match="unknown artifact type"):
        parse_spec(f"decoder={tmp_path / 'm.bin'}")
    with pytest.raises(FileNotFoundError):
        parse_spec(f"decoder={tmp_path / 'missing.onnx'}")


@pytest.fixture(scope="session")
def user_artifacts(small_program, tmp_path_factory):
    """A .onnx and a .pte as a user would make them from the same small module."""
    program, args = small_program
    out = tmp_path_factory.mktemp("user")
    torch.onnx.export(Small().eval(), args, str(out / "small.onnx"), dynamo=True, input_names=["x", "y"])
    from executorch.exir import to_edge_transform_and_lower

    et = to_edge_transform_and_lower(torch.export.load(str(program))).to_executorch()
    (out / "small.pte").write_bytes(et.buffer)
    return out


@pytest.mark.parametrize("name", ["small.onnx", "small.pte"])
def test_user_artifacts_are_described_and_run(user_artifacts, small_program, name):
    from harness.artifacts import describe, map_inputs, run_artifact

    _, args = small_program
    ports, n_out = describe(user_artifacts / name)
    assert n_out == 2 and [p.shape for p in ports] == [(1, 3, 6), (2, 5)]
    inputs = {"y": args[1], "x": args[0]}  # the step's order differs: mapping must not care when names exist
    order = map_inputs(ports, {"x": args[0], "y": args[1]})
    got = run_artifact(user_artifacts / name, [inputs[n] for n in order])
    for g, e in zip(got, Small()(*args)):
        assert rel(g, e) < 1e-6


# ---- items through the runner (slow: traces of a tiny case on the random model) ----------

@pytest.fixture(scope="module")
def tiny_session(tmp_path_factory, example_backends):
    """A Session on the seeded random model and a short case (speed 4, so few frames), with its
    own cache: items run end to end (export, compile, run, verdict) in child processes."""
    from tests.unit.conftest import tiny_session_at

    with tiny_session_at(tmp_path_factory.mktemp("tiny"), work=False, compile_s=600) as s:
        yield s


@pytest.mark.slow
def test_a_crashing_item_is_recorded_and_the_next_item_runs(tiny_session):
    from harness.record import read_records
    from harness.runner import Item, Limits
    from harness.verdict import Verdict

    crashed = tiny_session.run(Item("tiny", "bert_encoder", "example-segfault", "dynamic"))
    assert crashed.verdict is Verdict.CRASHED and "SIGSEGV" in crashed.reason
    after = tiny_session.run(Item("tiny", "bert_encoder", "example-interpreter", "dynamic"))
    assert after.verdict is Verdict.PASS, after.reason
    limits, tiny_session.limits = tiny_session.limits, Limits(compile_s=8)
    try:
        hung = tiny_session.run(Item("tiny", "bert_encoder", "example-hang", "dynamic"))
    finally:
        tiny_session.limits = limits
    assert hung.verdict is Verdict.TIMEOUT and "no result after 8 s" in hung.reason
    written = {r.backend: r.verdict for r in read_records(tiny_session.report_dir / "records")}
    assert written["example-segfault"] is Verdict.CRASHED and written["example-hang"] is Verdict.TIMEOUT


@pytest.mark.slow
def test_a_local_run_gets_a_process_started_before_its_compile(tiny_session, monkeypatch):
    """The run's process imports torch and the runtime while the artifact compiles (issue 19's
    harness/bare target)."""
    from harness.plumbing import worker
    from harness.runner import Item, run_preload
    from harness.verdict import Verdict

    started = []
    real = worker.prestart
    monkeypatch.setattr(worker, "prestart", lambda preload: (started.append(preload), real(preload)))
    rec = tiny_session.run(Item("tiny", "text_encoder", "example-interpreter", "dynamic"))
    assert rec.verdict is Verdict.PASS, rec.reason
    assert started == [run_preload(get_backend("example-interpreter"))] and worker._SPARE is None  # used


@pytest.mark.slow
def test_reuse_runs_judges_the_saved_outputs_again_without_running(tiny_session):
    """`--reuse-runs` (issue 19's warm matrix): a local run whose artifact and inputs ran before is
    not run again, even once its program and artifact are pruned from the cache, but its saved
    outputs are judged again, so a corrupted output still fails."""
    import shutil

    import torch

    from harness.backends import get_backend
    from harness.plumbing import cache
    from harness.programs import program_key
    from harness.runner import Item
    from harness.verdict import Verdict

    item = Item("tiny", "text_encoder", "example-interpreter", "static")
    first = tiny_session.run(item)
    assert first.verdict is Verdict.PASS and first.cache["run"] == "miss", first.reason
    runs = tiny_session.counts["runs"]
    assert tiny_session.run(item).cache["run"] == "miss" and tiny_session.counts["runs"] == runs + 1  # flag off: runs
    tiny_session.reuse_runs = True
    try:
        reused = tiny_session.run(item)
        assert reused.cache["run"] == "hit" and tiny_session.counts["runs"] == runs + 1
        assert reused.verdict is Verdict.PASS and reused.metrics == first.metrics
        assert reused.timings["run_s"] == first.timings["run_s"]  # the stored run's own figures
        # the program and the artifact let go by a capped cache: the saved run is found by its keys alone
        r = tiny_session.resolve(item)
        program, _ = program_key(item.step, r.traces.inputs(item.step, item.mode, "float32"), r.patches,
                                 tiny_session.model.digest)
        for kind, key in (("programs", program), ("artifacts", get_backend(item.backend).artifact_key(program))):
            shutil.rmtree(cache.entry(kind, key))
        work = (tiny_session.counts["exports"], tiny_session.counts["compiles"], tiny_session.counts["runs"])
        bare = tiny_session.run(item)
        assert (tiny_session.counts["exports"], tiny_session.counts["compiles"], tiny_session.counts["runs"]) == work
        assert bare.cache == {"program": "not needed", "artifact": "not needed", "run": "hit"}
        assert bare.verdict is Verdict.PASS and bare.metrics == first.metrics
        assert bare.audit == first.audit and bare.artifact_bytes == first.artifact_bytes  # kept with the run
        tiny_session.reuse_only = True  # --reuse-only: what the cache does not hold is SKIPPED, no work done
        assert tiny_session.run(item).verdict is Verdict.PASS
        never = Item("tiny", "bert", "example-interpreter", "dynamic")  # no other test of this module runs it
        cold = tiny_session.run(never)
        assert cold.verdict is Verdict.SKIPPED and cold.reason.startswith("not warm: bert would export here")
        assert (tiny_session.counts["exports"], tiny_session.counts["compiles"], tiny_session.counts["runs"]) == work
        tiny_session.reuse_only = False
        other = tiny_session.run(never)  # without --reuse-only, a run not saved runs
        assert other.cache["run"] == "miss" and tiny_session.counts["runs"] == runs + 2
        saved = [e / "outputs.pt" for e in (cache.cache_dir() / "runs").iterdir() if (e / ".complete").exists()]
        for path in saved:  # every saved output made NaN: judged again, they must fail
            torch.save([torch.full_like(t, float("nan")) for t in torch.load(path, weights_only=True)], path)
        spoiled = tiny_session.run(item)
        assert spoiled.cache["run"] == "hit" and spoiled.verdict is Verdict.FAIL
    finally:
        tiny_session.reuse_runs = tiny_session.reuse_only = False


@pytest.mark.slow
def test_a_compile_estimated_past_the_limit_is_skipped_before_it_starts(tiny_session, monkeypatch):
    """A backend whose frontend writes every node out (`compile_time`) skips a program whose
    estimate passes the compile limit, saying the figures and how to lift it; under the limit, or
    once its artifact is in the cache, it compiles and runs."""
    from harness.backends.cost import EXPORTED_NODES, CostLaw
    from harness.runner import Item, Limits
    from harness.verdict import Verdict

    cls = type(get_backend("example-interpreter"))
    item = Item("tiny", "duration", "example-interpreter", "static")
    monkeypatch.setattr(cls, "compile_time", CostLaw(EXPORTED_NODES, "s", ((1, 1.0), (2, 64.0))))  # days
    skipped = tiny_session.run(item)
    assert skipped.verdict is Verdict.SKIPPED, skipped.reason
    assert ("not compiled: example-interpreter's compile grows as the exported nodes to the power 6.00 "
            "(measured: 1.0 s at 1, 64.0 s at 2 exported nodes; docs/performance.md)") in skipped.reason
    assert "over the compile limit of 10.0 min (--time-limit compile=SECONDS to try)" in skipped.reason
    assert "compile_s" not in skipped.timings  # nothing was compiled
    limits, tiny_session.limits = tiny_session.limits, Limits(compile_s=10 ** 30)
    try:
        ran = tiny_session.run(item)
    finally:
        tiny_session.limits = limits
    assert ran.verdict is Verdict.PASS and ran.timings["compile_s"] > 0, ran.reason
    assert tiny_session.run(item).verdict is Verdict.PASS  # cached now: costs nothing, never skipped


@pytest.mark.slow
def test_compile_memory_and_run_time_laws_skip_in_their_own_sizes(tiny_session, monkeypatch):
    """TVM writes an LSTM out per step (compile memory grows with its steps), portable runs the
    vocoder slower than real time: each law reads its own size of the program (the longest
    LSTM's steps, the seconds of audio), and a program without that size is never skipped by it."""
    from harness.backends.cost import AUDIO_SECONDS, LSTM_STEPS, CostLaw
    from harness.runner import Item, Limits
    from harness.verdict import Verdict

    cls = type(get_backend("example-interpreter"))
    monkeypatch.setattr(cls, "compile_memory", CostLaw(LSTM_STEPS, "GB", ((1, 1.0), (2, 2.0), (4, 8.0)),
                                                       form="quadratic"))
    monkeypatch.setattr(tiny_session, "limits", Limits(compile_gb=100.0))
    # f0n's LSTM runs over the 128-frame bucket: about 10,800 GB; duration's over 8 tokens: 36 GB
    f0n = tiny_session.run(Item("tiny", "f0n", "example-interpreter", "static"))
    assert f0n.verdict is Verdict.SKIPPED and "compile_s" not in f0n.timings, f0n.reason
    assert ("not compiled: example-interpreter's compile memory grows with the square of the LSTM steps "
            "(measured: 1.0 GB at 1, 2.0 GB at 2, 8.0 GB at 4 LSTM steps;") in f0n.reason
    assert "so this program's 128 LSTM steps would need about" in f0n.reason
    assert "over the compile memory limit of 100.0 GB (--memory-limit GB to try)" in f0n.reason
    assert tiny_session.run(Item("tiny", "duration", "example-interpreter", "static")).verdict is Verdict.PASS
    assert tiny_session.run(Item("tiny", "bert_encoder", "example-interpreter", "static")).verdict is Verdict.PASS

    monkeypatch.setattr(cls, "compile_memory", None)
    monkeypatch.setattr(cls, "run_time", CostLaw(AUDIO_SECONDS, "s", ((0.1, 1000.0), (0.2, 2000.0))))
    decoder = tiny_session.run(Item("tiny", "decoder", "example-interpreter", "static"))
    assert decoder.verdict is Verdict.SKIPPED and "compile_s" not in decoder.timings, decoder.reason
    assert decoder.reason.startswith("not run: example-interpreter's run grows as the seconds of audio to the power")
    assert "seconds of audio would take about" in decoder.reason and "over the run limit of 15.0 min" in decoder.reason
    assert tiny_session.run(Item("tiny", "f0n", "example-interpreter", "static")).verdict is Verdict.PASS


@pytest.mark.slow
@pytest.mark.skipif(platform.system() == "Darwin", reason="on macOS Core ML runs")
def test_coreml_item_is_skipped_with_its_conversion_recorded(tiny_session):
    pytest.importorskip("coremltools")
    from harness.runner import Item
    from harness.verdict import Verdict

    rec = tiny_session.run(Item("tiny", "bert_encoder", "coreml-fp32", "dynamic"))
    assert rec.verdict is Verdict.SKIPPED and "compiled; Core ML prediction needs macOS" in rec.reason
    assert rec.audit["ops_without_mil_lowering"] == {} and rec.audit["mil_ops"]
    assert rec.artifact_bytes and rec.timings["compile_s"] > 0


@pytest.mark.slow
def test_artifact_items_judge_a_users_onnx_and_pte(tiny_session, tmp_path):
    from executorch.exir import to_edge_transform_and_lower

    from harness.artifacts import ArtifactItem, check_artifact
    from harness.patches import apply_patches
    from harness.steps import get_step
    from harness.verdict import Verdict

    inputs = tiny_session.traces("tiny").inputs("bert_encoder", "dynamic", "float32")
    step = get_step("bert_encoder").module(apply_patches(tiny_session.model.kmodel, ["dropout_identity"]))
    args = tuple(inputs.values())
    torch.onnx.export(step, args, str(tmp_path / "enc.onnx"), dynamo=True, input_names=list(inputs))
    with torch.no_grad():
        program = torch.export.export(step, args, strict=False)
    (tmp_path / "enc.pte").write_bytes(to_edge_transform_and_lower(program).to_executorch().buffer)
    for name in ("enc.onnx", "enc.pte"):
        rec = check_artifact(tiny_session, ArtifactItem("tiny", "bert_encoder", str(tmp_path / name), "dynamic"))
        assert rec.verdict is Verdict.PASS, rec.reason
        assert rec.metrics["d_en"]["rel_l2"] < 1e-5
        other = check_artifact(tiny_session, ArtifactItem("tiny", "bert_encoder", str(tmp_path / name), "static"))
        if tuple(inputs["bert_dur"].shape) != tuple(tiny_session.traces("tiny").inputs("bert_encoder", "static", "float32")["bert_dur"].shape):
            assert other.verdict is Verdict.SKIPPED and "fit the dynamic mode" in other.reason
    wrong = check_artifact(tiny_session, ArtifactItem("tiny", "decoder", str(tmp_path / "enc.onnx"), "dynamic"))
    assert wrong.verdict is Verdict.RUN_ERROR and "does not fit step 'decoder'" in wrong.reason


def test_failing_items_show_their_audit():
    from harness.record import Record
    from harness.report import item_table
    from harness.verdict import Verdict

    rec = Record("c", "decoder", "coreml-fp16", "static", Verdict.COMPILE_ERROR, reason="NotImplementedError: x",
                 audit={"ops_without_mil_lowering": {"__and__": 1}, "ops_without_converter": {},
                        "largest_activation": 7e4, "largest_activation_of_fp16_max": 1.07,
                        "modules_over_fp16_max": ["decoder.generator"], "fp16_first_nonfinite": "add_3 in decoder"})
    table = item_table(rec)
    assert "ops without a Core ML (MIL) lowering: __and__ x1" in table
    assert "TVM converter" not in table
    assert "over it: decoder.generator" in table and "first non-finite in float16: add_3 in decoder" in table


@pytest.mark.slow
def test_programs_hold_only_the_parts_their_step_reads(tmp_path):
    """An e2e item on the control backend exports both stages without Kokoro's unused parts (each
    program used to carry all 82M parameters) and still passes. Its programs are the test run's
    shared ones (the merge test runs the same item), so every program of the two stages there,
    this item's among them, is checked."""
    import json

    from harness.cases import load_cases, write_case
    from harness.plumbing.cache import CACHE_ENV, cache_dir
    from harness.runner import Item, Session
    from harness.verdict import Verdict

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(shared_references(tmp_path / "cache", work=True)))
        session = Session(weights="random:0", case_ids=["tiny"], report_dir=tmp_path / "reports")
        session._cases = {c.id: c for c in load_cases(tmp_path / "cases")}
        rec = session.run(Item("tiny", "e2e", "eager", "dynamic"))
        assert rec.verdict is Verdict.PASS, rec.reason
        dropped = {}
        for result in (cache_dir() / "programs").glob("*/result.json"):
            job = json.loads((result.parent / "job.json").read_text())["kwargs"]
            parts = json.loads(result.read_text())["value"]["dropped"]
            dropped.setdefault(job["step"], set()).add(tuple(sorted(parts)))
    assert dropped["duration_stage"] == {("decoder", "text_encoder")}
    assert dropped["synthesizer"] == {("bert", "bert_encoder")}
