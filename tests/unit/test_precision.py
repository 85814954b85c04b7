"""harness.precision: the float16 floor, the shippable bar, and the float32-island search, on small
programs with a known float16 failure (a running sum past 65,504, a large reduction)."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn as nn

from harness.precision.float16 import Float16Mode, Mixed
from harness.precision.islands import keep_float32_graph, keep_tag, not_in_program, patches_for, read_keep_list
from harness.precision.search import Target, candidates, evaluate, module_audit, search, write_keep_list
from harness.steps import Step, Tensor
from harness.verdict import Tolerance, Verdict, judge_outputs, shippable
from tests.unit.conftest import shared_references


class Phase(nn.Module):
    """SineGen's trouble in miniature: a running sum (a phase) that grows past float16's 65,504
    before it is wrapped; what leaves the module (its sine) is small."""

    def forward(self, f):
        return torch.sin(torch.remainder(torch.cumsum(f, dim=-1), 2 * math.pi))


class Toy(nn.Module):
    """pre -> phase (running sum, overflows float16) -> post; its output reads as durations."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.pre = nn.Linear(4, 4)
        self.phase = Phase()
        self.post = nn.Linear(4, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.rand(p.shape, generator=g) * 0.5)

    def forward(self, x):
        # 20 or 21 per step (exact in every precision): the sum passes 65,504 after ~3,200 steps
        steps = 20.0 + (x > 0).to(x.dtype)
        sine = self.phase(steps.transpose(1, 2))  # [1, 4, T]
        y = self.post(sine.transpose(1, 2) + 0.1 * self.pre(x)).squeeze(-1)
        return 4.0 + 2.0 * torch.tanh(y).clamp(-0.2, 0.2)


STEP = Step("toy", lambda km: km, (Tensor("x"),), (Tensor("duration", {1: "tokens"}),), "duration")


@pytest.fixture(scope="module")
def toy():
    model = Toy().eval()
    x = torch.linspace(-1, 1, 4 * 4000).reshape(1, 4000, 4)
    with torch.no_grad():
        fp64 = {"duration": Toy.forward(model.double(), x.double()).detach()}
    model.float()
    return model, x, fp64


def _target(toy) -> Target:
    model, x, fp64 = toy
    return Target("toy", STEP, model, [x], fp64, lambda name, t: t)


def test_float16_overflows_and_the_kept_module_fixes_it(toy):
    model, x, fp64 = toy
    half = Mixed(model)(x)
    assert not torch.isfinite(half).all()  # the running sum overflows: inf, then NaN through sin
    kept = Mixed(model, ["phase"])(x)
    assert torch.isfinite(kept).all()
    assert float((kept.double() - fp64["duration"]).abs().max()) < 0.05
    with pytest.raises(KeyError, match="no module nope"):
        Mixed(model, ["nope"])


def test_emulated_float16_matches_pytorch_float16_kernels(toy):
    model, x, _ = toy
    native = Mixed(model, ["phase"], emulate=False)(x)
    emulated = Mixed(model, ["phase"], emulate=True)(x)
    assert torch.allclose(native, emulated, atol=4e-3)  # one float16 ulp at 4.0
    with Float16Mode() as mode:  # hard-coded float32 becomes float16, as the fp16 backend's rewrite does
        assert torch.zeros(3, dtype=torch.float32).dtype == torch.float16
        assert torch.ones(2).float().dtype == torch.float16
        mode.region.append(torch.float32)
        assert torch.ones(2, dtype=torch.float16).dtype == torch.float32


def test_a_large_reduction_overflows_float16():
    x = torch.ones(1, 100_000)
    with torch.no_grad():
        out = Mixed(nn.Identity())(x.sum(-1, keepdim=True))  # summed in float32: fine
        with Float16Mode(emulate=True):
            total = x.sum()
    assert torch.isfinite(out).all() and math.isinf(float(total))


def test_audit_names_the_running_sum_first(toy):
    model, x, _ = toy
    rows = module_audit(model, [x], depth=2)
    assert rows[0]["module"] == "phase" and math.isinf(rows[0]["local_rel_l2"])
    assert {r["module"] for r in rows} == {"pre", "phase", "post"}
    assert candidates(rows, "")[0] == "phase"


def test_search_finds_the_one_module_to_keep_in_float32(toy, tmp_path):
    tol = Tolerance()
    before = evaluate(_target(toy), [], tol)
    assert before.shippable is False and "non-finite" in before.why
    result = search([_target(toy)], tol, depth=2, top_k=3)
    assert result.keep == ["phase"] and result.reached
    assert result.after[0].shippable and result.after[0].badness == 0
    assert result.share["params"] == 0 and result.share["params_total"] == 25
    paths = write_keep_list(result, tmp_path)
    assert read_keep_list(paths["keep_list"]) == ["phase"]
    assert json.loads(paths["keep_list"].read_text())["with_patch"] == []  # no module a patch makes
    src = paths["op_selector"].read_text()
    assert "KEEP_FP32 = ['phase']" in src and "def op_selector_for" in src
    compile(src, "op_selector.py", "exec")


def test_keep_list_errors_name_the_file(tmp_path, monkeypatch):
    bad = tmp_path / "keep.json"
    bad.write_text('{"keep_fp32": "decoder"}')
    with pytest.raises(ValueError, match="keep.json.*list of module paths"):
        read_keep_list(bad)
    monkeypatch.delenv("KOKORO_PARITY_KEEP_FP32", raising=False)
    assert read_keep_list() == [] and keep_tag([]) == ""


def test_fp16_backend_version_follows_the_keep_list(tmp_path, monkeypatch):
    from harness.backends import get_backend, precision_of

    b = get_backend("fp16")
    assert precision_of(b) == "float16" and precision_of(get_backend("coreml-fp16")) == "float16"
    assert precision_of(get_backend("eager")) == "float32"
    plain = b.version()
    keep = tmp_path / "keep.json"
    keep.write_text(json.dumps({"keep_fp32": ["decoder.generator.m_source"]}))
    monkeypatch.setenv("KOKORO_PARITY_KEEP_FP32", str(keep))
    assert b.version() != plain and "keep-fp32=" in b.version()


def test_exported_program_with_a_float32_island(toy):
    """The fp16 backend's form: the exported graph in float16, the kept module's nodes in float32."""
    from harness.backends.fp16 import _to_dtype

    model, x, fp64 = toy
    program = torch.export.export(copy.deepcopy(model), (x,))  # _to_dtype casts the program's parameters
    half = _to_dtype(program.module(), torch.float16)
    with torch.no_grad():
        assert not torch.isfinite(half(x.half())).all()
        mixed = keep_float32_graph(_to_dtype(program.module(), torch.float16), program.module(), ["phase"])
        out = mixed(x).float()  # with islands the graph takes float32 inputs
    assert torch.isfinite(out).all()
    assert float((out.double() - fp64["duration"]).abs().max()) < 0.05


def test_coreml_op_selector_keeps_the_island_in_float32(toy):
    ct = pytest.importorskip("coremltools")
    from coremltools.converters.mil.mil import types

    from harness.precision.islands import op_selector_for

    model, x, _ = toy
    program = torch.export.export(copy.deepcopy(model), (x[:, :64],)).run_decompositions({})
    selector, n_kept = op_selector_for(program, ["phase"])
    assert n_kept >= 1
    mlmodel = ct.convert(program, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS17,
                         compute_precision=ct.transform.FP16ComputePrecision(op_selector=selector),
                         skip_model_load=True)
    ops = list(mlmodel._mil_program.functions["main"].operations)
    dtype = {op.op_type: op.outputs[0].dtype for op in ops if op.outputs}
    assert dtype["cumsum"] == types.fp32  # the running sum stays float32
    assert dtype["linear"] == types.fp16  # the rest is float16


class _Refs:
    def __init__(self, ref, fp32, fp16):
        self.fp64, self.fp32, self.fp16 = {"y": ref}, {"y": fp32}, {"y": fp16}
        self.plain32, self.dynamic32, self.variant = {"y": fp32}, None, ()


def test_a_float16_backend_at_its_floor_passes_within_the_float16_floor():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(1, 1000, generator=g, dtype=torch.float64)
    fp32, fp16 = ref.float().double(), ref.half().double()
    backend = ref.half().float()  # as good as float16 allows
    refs = _Refs(ref, fp32, fp16)
    tol = Tolerance()
    as32 = judge_outputs(["y"], [backend], refs, lambda n, t: t, tol, precision="float32")
    assert as32.verdict is Verdict.FAIL and "fp32 floor" in as32.reason
    as16 = judge_outputs(["y"], [backend], refs, lambda n, t: t, tol, precision="float16")
    assert as16.verdict is Verdict.PASS and "float16 floor" in as16.reason
    m = as16.metrics["y"]
    assert m["floor_precision"] == "float16" and m["floor_rel_l2"] == m["fp16_floor_rel_l2"] > m["fp32_floor_rel_l2"]
    assert as16.shippable is None  # neither audio nor durations


def test_nan_never_passes_nor_ships():
    ref = torch.ones(1, 10, dtype=torch.float64)
    nan = torch.full((1, 10), math.nan)
    refs = _Refs(ref, ref, nan.double())  # float16 eager itself is NaN: no floor
    j = judge_outputs(["y"], [nan], refs, lambda n, t: t, Tolerance(), precision="float16")
    assert j.verdict is Verdict.FAIL and "non-finite" in j.reason
    # float32 islands: finite where float16 eager is not (en_long's vocoder): better than the floor
    j = judge_outputs(["y"], [ref.float() + 0.01], refs, lambda n, t: t, Tolerance(), precision="float16")
    assert j.verdict is Verdict.PASS and "finite where float16 eager is not" in j.reason
    ok, why = shippable(Tolerance(), durations={"duration": (nan[0], ref[0])})
    assert ok is False and "non-finite" in why
    ok, why = shippable(Tolerance(), audio={"audio": {"pesq": math.nan, "mcd_db": 0.1, "rms_ratio_db": 0.0}})
    assert ok is False


def test_shippable_bars():
    tol = Tolerance(min_pesq=4.0, max_mcd_db=0.5, max_level_db=1.0)
    good = {"pesq": 4.3, "mcd_db": 0.2, "rms_ratio_db": 0.1}
    assert shippable(tol, audio={"audio": good})[0] is True
    assert shippable(tol, audio={"audio": {**good, "rms_ratio_db": 1.5}}) == (False, "audio: level +1.50 dB outside +-1.0 dB")
    assert shippable(tol, audio={"audio": {**good, "pesq": 3.1}})[0] is False
    dur = torch.tensor([1.2, 2.6, 0.2])
    assert shippable(tol, durations={"duration": (dur + 0.1, dur)})[0] is True  # same rounding, 0.2 -> clamped 1
    assert shippable(tol, durations={"duration": (dur + 0.3, dur)})[0] is False
    assert shippable(tol) == (None, "no audio or duration output")


def test_the_float16_floor_of_a_step_is_computed_once_and_judges_float16(random_model, tmp_path, monkeypatch):
    """reference.references_for(precision="float16"): float16 eager's outputs, cached; a float16
    backend exactly at that floor passes within it, and its durations are the shippable bar."""
    from harness.cases import Bucket, Case
    from harness.reference import compute_traces, references_for

    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(tmp_path / "cache"))
    case = Case(id="tiny", language="en-us", text="Hi.", phonemes="hˈI.", voice="jf_alpha",
                bucket=Bucket(tokens=16, frames=400))
    traces = compute_traces(random_model, case, steps=("duration",))
    refs = references_for(random_model, case, traces, "duration", "dynamic", [], precision="float16")
    fp16, fp32, fp64 = refs.fp16["duration"], refs.fp32["duration"], refs.fp64["duration"]
    assert torch.isfinite(fp16).all() and fp16.dtype == torch.float32
    err = lambda t: float((t.double() - fp64).norm() / fp64.norm())  # noqa: E731
    assert err(fp16) > 10 * err(fp32) > 0  # float16's floor is far above float32's
    again = references_for(random_model, case, traces, "duration", "dynamic", [], precision="float16")
    assert torch.equal(again.fp16["duration"], fp16)  # from the cache
    assert references_for(random_model, case, traces, "duration", "dynamic", []).fp16 is None
    valid = lambda n, t: traces.valid_region("duration", n, t)  # noqa: E731
    j = judge_outputs(["duration"], [fp16], refs, valid, Tolerance(), precision="float16")
    assert j.verdict is Verdict.PASS and j.metrics["duration"]["floor_ratio"] == 1.0
    assert j.shippable is not None and "rounded durations" in j.shippable_reason


def test_tables_say_within_the_float16_floor_and_shippable():
    from harness.record import Record
    from harness.report import item_table, summary_table

    m = {"rel_l2": 0.14, "floor_rel_l2": 0.985, "floor_ratio": 0.142, "fp16_floor_rel_l2": 0.985,
         "fp32_floor_rel_l2": 0.007, "floor_precision": "float16", "nan_rate": 0.0}
    rec = Record("en_short", "decoder", "fp16", "dynamic", Verdict.PASS, reason="audio: rel_l2 ...",
                 metrics={"audio": m}, audio_metrics={"audio": {"pesq": 4.52, "mcd_db": 0.82}},
                 precision="float16", shippable=False, shippable_reason="audio: MCD 0.82 dB > 0.5 dB")
    assert "float16: within the float16 floor, not shippable (audio: MCD 0.82 dB > 0.5 dB)" in item_table(rec)
    cell = summary_table([rec]).splitlines()[-1]
    assert "PASS rel 0.14 (0.142x fp16 floor) PESQ 4.52 not shippable" in cell
    assert Record.from_dict(rec.to_dict()).shippable is False  # the new fields round-trip
    old = {k: v for k, v in rec.to_dict().items() if k not in ("precision", "shippable", "shippable_reason")}
    assert Record.from_dict(old).precision == "float32"  # records written before them still load
    # en_long: float16 eager is NaN (SineGen overflows), so no float16 floor to be a multiple of
    long = Record.from_dict({**rec.to_dict(), "metrics": {"audio": {**m, "floor_ratio": float("nan")}},
                             "shippable": True})
    assert "PASS rel 0.14 (fp16 floor non-finite) PESQ 4.52 shippable" in summary_table([long]).splitlines()[-1]


@pytest.mark.slow
def test_xnnpack_fp16_lowers_a_float16_program(tmp_path):
    """The phone CPU's float16 route: the program cast to float16 and re-exported (a dynamic length
    kept dynamic), lowered with XNNPACK; runs on float32 inputs and returns float32."""
    pytest.importorskip("executorch")
    from harness.backends import get_backend, precision_of

    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 4)

        def forward(self, x):
            return torch.relu(self.proj(x)).float()  # a hard-coded float32 becomes float16 too

    torch.manual_seed(0)
    model = Small().eval()
    x = torch.randn(1, 6, 8)
    program = torch.export.export(model, (x,), dynamic_shapes=({1: torch.export.Dim("t", min=2, max=64)},))
    torch.export.save(program, tmp_path / "program.pt2")
    b = get_backend("xnnpack-fp16")
    assert precision_of(b) == "float16"
    audit = b.compile(tmp_path / "program.pt2", tmp_path)
    assert audit["program_dtype"] == "float16" and audit["delegated_nodes"] > 0
    longer = torch.randn(1, 11, 8)  # another length: the re-export kept the dimension dynamic
    out = b.run(tmp_path / b.artifact_name, [longer])[0]
    assert out.dtype == torch.float32 and out.shape == (1, 11, 4)
    expected = model(longer)
    assert 0 < float((out - expected).abs().max()) < 1e-2  # float16, not float32


# ---- islands: their own float32 weights, float32 inputs through data movement, the vocoder's STFTs --------

class ReadsItsInput(nn.Module):
    """A phase integrated straight from the step's input through a view (Generator's `f0[:, None]`
    before SineGen): a float32 island must read the input unrounded, or the phase drifts."""

    def __init__(self):
        super().__init__()
        self.phase = Phase()
        self.gain = nn.Linear(1, 1)
        with torch.no_grad():
            self.gain.weight.fill_(1 + 2 ** -13)  # not a float16 number
            self.gain.bias.zero_()

    def forward(self, f):
        wave = self.phase(f[:, None, :])  # [1, 1, T]
        return self.gain(wave.transpose(1, 2)).squeeze(-1)


def test_an_island_reads_inputs_unrounded_and_its_own_float32_weights():
    model = ReadsItsInput().eval()
    f = 0.05 + 1e-3 * torch.rand(1, 3000, generator=torch.Generator().manual_seed(0))  # not float16 numbers
    with torch.no_grad():
        exact = model(f)
        kept = Mixed(model, ["phase", "gain"], emulate=True)(f)
        phase_only = Mixed(model, ["phase"], emulate=True)(f)
    assert float((kept - exact).abs().max()) < 1e-6  # the view passes f through in float32; gain's weight is float32
    assert float((phase_only - exact).abs().max()) > 1e-4  # gain in float16: its input and weight rounded


def test_the_fp16_backend_island_reads_the_input_through_the_view_in_float32():
    from harness.backends.fp16 import _to_dtype
    from harness.precision.islands import island_nodes

    model = ReadsItsInput().eval()
    f = 0.05 + 1e-3 * torch.rand(1, 3000, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(copy.deepcopy(model), (f,))
    island = island_nodes(program.graph, ["phase"])
    assert any(n.target == torch.ops.aten.unsqueeze.default for n in island)  # the view joined the island
    assert not any(n.target == torch.ops.aten.linear.default for n in island)
    with torch.no_grad():
        exact = model(f)
        full = copy.deepcopy(program.module())  # as the backend does: _to_dtype casts the shared parameters
        mixed = keep_float32_graph(_to_dtype(program.module(), torch.float16), full, ["phase", "gain"])
        out = mixed(f).float()
        assert float((out - exact).abs().max()) < 1e-6
        # a module of another program (an e2e keep-list names both programs' modules): skipped, listed
        assert not_in_program(program.graph, ["phase", "nope"]) == ["nope"]
        skipped = keep_float32_graph(_to_dtype(program.module(), torch.float16), full, ["phase", "gain", "nope"])
        assert torch.allclose(skipped(f).float(), out)
        with pytest.raises(ValueError, match="no node of decoder.generator.stft.analysis.*--with-patch stft_islands"):
            keep_float32_graph(_to_dtype(program.module(), torch.float16), full,
                               ["phase", "decoder.generator.stft.analysis"])


class SharedView(nn.Module):
    """An island's output read through a view in the step's own code by a float16 module and by
    another island: Kokoro's F0 (`predictor.F0_proj` -> squeeze in the e2e step -> `decoder.F0_conv`
    in float16, and SineGen's running phase in float32)."""

    def __init__(self):
        super().__init__()
        self.proj, self.side, self.phase = nn.Linear(1, 1), nn.Linear(1, 1), Phase()
        with torch.no_grad():
            self.proj.weight.fill_(1 + 2 ** -13)  # not a float16 number
            self.proj.bias.zero_()

    def forward(self, f):
        f0 = self.proj(f[..., None]).squeeze(-1)  # the squeeze is no module's: float16 code
        return self.phase(f0[:, None, :]), self.side(f0[..., None])


def test_a_view_read_by_an_island_and_a_float16_module_stays_float32():
    from harness.backends.fp16 import _to_dtype
    from harness.precision.islands import island_nodes

    model = SharedView().eval()
    f = 0.05 + 1e-3 * torch.rand(1, 3000, generator=torch.Generator().manual_seed(0))
    program = torch.export.export(copy.deepcopy(model), (f,))
    island = island_nodes(program.graph, ["proj", "phase"])
    assert any(n.target == torch.ops.aten.squeeze.dim for n in island)  # read by side (float16) too
    with torch.no_grad():
        exact = model(f)[0]
        emulated = Mixed(model, ["proj", "phase"], emulate=True)(f)[0]
        full = copy.deepcopy(program.module())
        backend = keep_float32_graph(_to_dtype(program.module(), torch.float16), full, ["proj", "phase"])(f)[0]
    # the backend's island reads f0 as the emulation's does: unrounded
    assert float((backend.float() - exact).abs().max()) < 1e-5
    assert float((emulated.float() - exact).abs().max()) < 1e-5


@pytest.fixture(scope="module")
def tiny_generator():
    """Kokoro's own Generator, small, with random weights, in a KModel-shaped holder."""
    from kokoro.istftnet import Generator

    torch.manual_seed(0)
    holder = nn.Module()
    holder.decoder = nn.Module()
    with torch.no_grad():  # weight_norm's computed weights must be leaves for the patches' deepcopy
        holder.decoder.generator = Generator(8, [3], [2], 8, [[1, 3, 5]], [4], 8, 2, disable_complex=True).eval()
    return holder


class _Gen(nn.Module):
    def __init__(self, kmodel):
        super().__init__()
        self.kmodel = kmodel

    def forward(self, x, s, f0, rand_ini, sine_noise, source_noise):
        from harness.patches import provide_noise

        with provide_noise(dict(rand_ini=rand_ini, sine_noise=sine_noise, source_noise=source_noise)):
            return self.kmodel.decoder.generator(x, s, f0)


def test_stft_islands_is_bit_exact_and_names_the_two_stfts(tiny_generator):
    from harness.precision.islands import node_module_path
    from harness.patches import apply_patches, sample_noise

    base = ("noise_as_input", "fold_weight_norm", "custom_stft", "stft_phase_where")
    plain, split = apply_patches(tiny_generator, base), apply_patches(tiny_generator, (*base, "stft_islands"))
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(1, 8, 10, generator=g), torch.randn(1, 8, generator=g), 200 * torch.rand(1, 10, generator=g),
              *sample_noise(0, 40).values())
    with torch.no_grad():
        expected = _Gen(plain)(*inputs)
        assert torch.equal(_Gen(split)(*inputs), expected)
        assert torch.equal(_Gen(copy.deepcopy(split))(*inputs), expected)  # copies call their own halves
        program = torch.export.export(_Gen(split).eval(), inputs, strict=False)
    paths = {node_module_path(n) for n in program.graph.nodes if n.op == "call_function"}
    assert {"decoder.generator.stft.analysis", "decoder.generator.stft.synthesis"} <= paths
    stft = split.decoder.generator.stft
    assert "weight_forward_imag" in dict(stft.analysis.named_buffers())
    assert [n for n, _ in stft.named_buffers(recurse=False)] == ["window"]  # the DFT weights moved to the halves
    kept = Mixed(_Gen(split), ["decoder.generator.stft.analysis"], emulate=True)
    assert torch.isfinite(kept(*inputs)).all()
    assert patches_for(["decoder.generator.stft.analysis"]) == ["stft_islands"]
    assert patches_for(["decoder.generator.m_source.l_sin_gen"]) == patches_for(["decoder.generator"]) == []


def test_verify_judges_a_given_set_without_a_search(toy, tmp_path):
    from harness.precision.search import verify

    tol = Tolerance()
    fixed = verify([_target(toy)], ["phase"], tol)
    assert fixed.reached and fixed.keep == ["phase"] and fixed.audit == [] and fixed.rounds == []
    assert fixed.before[0].shippable is False and fixed.after[0].shippable
    assert not verify([_target(toy)], ["post"], tol).reached  # the wrong island: still overflows
    assert read_keep_list(write_keep_list(fixed, tmp_path)["keep_list"]) == ["phase"]


@pytest.mark.slow
def test_e2e_targets_are_the_two_stages_judged_as_the_e2e_item_does(random_model, tmp_path, monkeypatch):
    """`precision --step e2e`: per case the duration stage (judged by its rounded durations) and the
    synthesizer on the reference's alignment (judged by its audio); the shares count only the
    parameters of modules that ran."""
    from harness.cases import write_case
    from harness.precision.search import share_of, step_label, targets_for, verify

    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(shared_references(tmp_path / "cache")))
    monkeypatch.setenv("KOKORO_PARITY_CASES", str(tmp_path / "cases"))
    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    targets = targets_for(random_model, ["tiny"], "e2e")
    assert [(t.case, t.step.name) for t in targets] == [("tiny:duration_stage", "duration_stage"),
                                                        ("tiny:synthesizer", "synthesizer")]
    assert step_label(targets) == "e2e" and targets[1].fp64["audio"].dtype == torch.float64
    result = verify(targets, ["decoder.generator.m_source"], Tolerance())
    dur, synth = result.after
    assert "rounded durations" in dur.why and set(synth.metrics["audio"]) >= {"pesq", "mcd_db", "rms_ratio_db"}
    text_side = share_of(targets[0], ["bert"])
    assert 0 < text_side["params_share"] < 1 and text_side["params_total"] < sum(
        p.numel() for p in random_model.kmodel.parameters())  # the duration stage's own, not the KModel's
    with pytest.raises(ValueError, match="dynamic mode only"):
        targets_for(random_model, ["tiny"], "e2e", mode="static")
    # the synthesizer is fed the float16 duration stage's `d` run with the same set (the item's chained
    # run), memoized per the part of the set that the duration stage runs; float32 `d` only when the
    # float16 durations round differently (the item's local run)
    from harness.precision.search import fed_inputs

    synth = targets[1]
    i = synth.step.input_names.index("d")
    fed, how = fed_inputs(synth, ["decoder.generator.m_source"], emulate=True)
    assert "chained" in how and "fed the float16 duration stage's d" in synth_why(result)
    assert not torch.equal(fed[i], synth.inputs[i]) and torch.allclose(fed[i], synth.inputs[i], rtol=0.05, atol=0.05)
    assert fed[i].half().float().equal(fed[i])  # float16 values, as the float16 stage hands them on
    assert list(synth.fed) == [frozenset()]  # m_source is not in the duration stage: d computed once
    fed_bert, _ = fed_inputs(synth, ["bert", "decoder.generator.m_source"], emulate=True)
    assert frozenset({"bert"}) in synth.fed and not torch.equal(fed_bert[i], fed[i])
    synth.fed[frozenset()] = None  # as if float16 durations rounded differently
    assert fed_inputs(synth, [], emulate=True) == (synth.inputs, "reference d (the float16 durations round "
                                                   "differently: the item's local run)")


def synth_why(result) -> str:
    return result.after[1].why


def test_a_kept_module_keeps_the_children_that_step_code_calls_directly():
    """F0NStep calls predictor.shared and predictor.F0 without predictor.forward: keeping `predictor`
    must keep them (the backends tag nodes by module path, so their kept parent keeps them there)."""

    class Parent(nn.Module):
        def __init__(self):
            super().__init__()
            self.phase = Phase()

    class Caller(nn.Module):
        def __init__(self):
            super().__init__()
            self.parent = Parent()

        def forward(self, f):
            return self.parent.phase(f)  # not through Parent.forward

    f = torch.full((1, 4000), 21.0)  # the running sum reaches 84,000: past float16's 65,504
    assert not torch.isfinite(Mixed(Caller(), [], emulate=True)(f)).all()
    kept = Mixed(Caller(), ["parent"], emulate=True)(f)
    assert torch.isfinite(kept).all() and torch.allclose(kept, Caller()(f), atol=1e-3)


class Scale(nn.Module):
    """x * 2: exact in float16 on a float16 input, so keeping it alone changes nothing."""

    def forward(self, x):
        return 2.0 * x


class ChainToy(nn.Module):
    """SineGen's F0 chain in miniature: b -> a -> phase. The phase integrates a(b(x)); float16
    rounds x at the first float16 module it enters, and keeping `a` or `b` alone leaves that rounding
    where it was: only the whole chain, kept with the phase, is exact."""

    def __init__(self):
        super().__init__()
        self.b, self.a = Scale(), Scale()
        self.phase = nn.Identity()

    def forward(self, x):
        return self.phase(self.a(self.b(x)))


class Integrate(nn.Module):
    """Durations 4..8 from a running sum that passes 65,504 (overflows float16); on multiples of
    1/128 the sum and its remainder are exact in float32, so float32 matches float64 exactly."""

    def forward(self, f):
        return 4.0 + torch.remainder(torch.cumsum(f, dim=-1), 4.0)


def test_search_keeps_a_whole_upstream_chain_that_no_single_module_fixes():
    from harness.precision.search import block_of, upstream

    model = ChainToy().eval()
    model.phase = Integrate()
    x = (5.0 + (torch.arange(4000) % 512) / 512).reshape(1, 4000)  # odd 512ths: not float16-representable
    with torch.no_grad():
        fp64 = {"duration": model.double()(x.double()).detach()}
    model.float()
    target = Target("chain", Step("chain", lambda km: km, (Tensor("x"),), (Tensor("duration", {1: "tokens"}),),
                                  "duration"), model, [x], fp64, lambda name, t: t)
    tol = Tolerance()
    assert not evaluate(target, ["phase"], tol).shippable
    assert evaluate(target, ["phase", "a"], tol).badness == evaluate(target, ["phase", "b"], tol).badness > 0
    rows = module_audit(model, [x], depth=2)
    assert upstream(["phase"], rows, "") == ["a", "b"]
    assert block_of("predictor.F0.1.conv1") == "predictor.F0.1" and block_of("predictor.shared") == "predictor.shared"
    result = search([target], tol, depth=2, top_k=3)
    assert result.reached and result.keep == ["a", "b", "phase"]
    assert any(r["chosen"] == "a,b" for r in result.rounds)


def test_enclosing_names_the_parent_whose_own_code_runs_between_kept_children():
    from harness.precision.search import enclosing

    children = {"decoder.generator": ["decoder.generator.m_source", "decoder.generator.stft",
                                      "decoder.generator.resblocks"],
                "decoder.generator.stft": ["decoder.generator.stft.analysis", "decoder.generator.stft.synthesis"],
                "decoder": ["decoder.generator", "decoder.encode"]}
    keep = ["predictor", "decoder.generator.m_source", "decoder.generator.stft.analysis",
            "decoder.generator.stft.synthesis"]
    # stft's children are all kept (nothing of its own left); predictor and the generator share only the root
    assert enclosing(keep, children, "") == ["decoder.generator", "decoder"]  # innermost first
    assert enclosing(["decoder.generator.m_source"], children, "") == []


def test_search_goes_on_from_a_given_set_and_judges_cheap_cases_first():
    model = ChainToy().eval()
    model.phase = Integrate()
    x = (5.0 + (torch.arange(4000) % 512) / 512).reshape(1, 4000)
    with torch.no_grad():
        fp64 = {"duration": model.double()(x.double()).detach()}
    model.float()
    step = Step("chain", lambda km: km, (Tensor("x"),), (Tensor("duration", {1: "tokens"}),), "duration")
    target = Target("chain", step, model, [x], fp64, lambda name, t: t)
    lines = []
    result = search([target], Tolerance(), depth=2, top_k=3, start=["phase"], log=lines.append)
    assert result.reached and result.keep == ["a", "b", "phase"]
    assert result.rounds[0]["chosen"] == "a,b"  # from `phase` on: no round spent finding it again
    assert result.before[0].shippable is False


def test_node_module_path_is_the_kmodel_path_inside_an_e2e_stages_wrappers():
    """The synthesizer holds the KModel inside wrappers of its own (`decoder.kmodel.decoder...`):
    a keep-list names KModel paths, so the islands must find `decoder.generator` there too."""
    from harness.precision.islands import island_nodes, node_module_path, not_in_program

    class KModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = nn.Sequential()
            self.decoder.generator = nn.Linear(4, 4)

    class Wrapper(nn.Module):  # as SynthesizerStep's `decoder`: holds the KModel, calls a part of it
        def __init__(self, km):
            super().__init__()
            self.kmodel = km

        def forward(self, x):
            return self.kmodel.decoder.generator(x).relu()

    class Stage(nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = Wrapper(KModel())

        def forward(self, x):
            return self.decoder(x) * 2

    program = torch.export.export(Stage().eval(), (torch.randn(1, 4),))
    paths = {node_module_path(n) for n in program.graph.nodes if n.op == "call_function"}
    assert "decoder.generator" in paths and not any("kmodel" in p for p in paths)
    assert not_in_program(program.graph, ["decoder.generator"]) == []
    assert island_nodes(program.graph, ["decoder.generator"])
