"""The `length_aware_norm` patch: on a padded frame bucket, f0n and the whole synthesizer compute,
for each sequence of a batch of different lengths, what Kokoro computes on its exact frames; the
same model without the patch does not (so these tests can fail). Random weights, small shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.patches.length_aware_norm import masked_instance_norm
from harness.patches import PATCHES, apply_patches, sample_noise
from harness.steps import get_step

STATIC = ["noise_as_input", "dropout_identity", "no_packing", "length_aware_lstm"]
TOL = 2e-5  # fp32: the patched and exact runs sum in different orders (measured ~1e-6)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


class _Models(dict):
    """Patched copies of the random model, built on first use (each is a deep copy)."""

    RECIPES = {"kokoro": ["noise_as_input", "dropout_identity"],
               "kokoro_custom_stft": ["noise_as_input", "dropout_identity", "custom_stft"],
               "static": STATIC,
               "patched": [*STATIC, "length_aware_norm"],
               "patched_custom_stft": [*STATIC, "custom_stft", "length_aware_norm"]}

    def __init__(self, kmodel):
        super().__init__()
        self.kmodel = kmodel

    def __missing__(self, name):
        self[name] = apply_patches(self.kmodel, self.RECIPES[name])
        return self[name]


@pytest.fixture(scope="module")
def models(random_model):
    return _Models(random_model.kmodel)


def test_declared_as_preserving():
    p = PATCHES["length_aware_norm"]
    assert p.preserves_semantics and set(p.affects) == {"f0n", "synthesizer"}


def test_masked_instance_norm_equals_instance_norm_on_the_valid_frames():
    g = torch.Generator().manual_seed(3)
    norm = torch.nn.InstanceNorm1d(6, affine=True)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6, generator=g))
        norm.bias.copy_(torch.randn(6, generator=g))
    x = torch.randn(2, 6, 11, generator=g)
    x[1, :, 7:] = 1e4  # padding that would swamp the statistics
    got = masked_instance_norm(norm, x, torch.tensor([11, 7]))
    assert rel(got[:1], norm(x[:1])) < 1e-6
    assert rel(got[1:, :, :7], norm(x[1:, :, :7])) < 1e-6


def f0n_batch(lengths, T, seed=5):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(1, 640, n, generator=g) for n in lengths]
    s = torch.randn(len(lengths), 128, generator=g)
    return xs, s, torch.cat([F.pad(x, (0, T - x.shape[-1])) for x in xs]), torch.tensor(lengths)


def test_f0n_on_a_bucket_equals_the_exact_runs(models):
    """Batch of three lengths on a 16-frame bucket: each sequence's F0/N equal Kokoro's on its exact
    frames, the padded F0/N are zero; without the patch the valid region differs."""
    lengths, T = [12, 5, 9], 16
    xs, s, batch, L = f0n_batch(lengths, T)
    st = get_step("f0n")
    with torch.no_grad():
        patched = st.module(models["patched"])(batch, s, L)
        static = st.module(models["static"])(batch, s, L)
        exact = [st.module(models["kokoro"])(x, s[b:b + 1], torch.tensor([n]))
                 for b, (x, n) in enumerate(zip(xs, lengths))]
    for k in range(2):  # F0, N
        for b, n in enumerate(lengths):
            assert rel(patched[k][b:b + 1, : 2 * n], exact[b][k]) < TOL, (k, b)
            assert torch.all(patched[k][b, 2 * n:] == 0)
        assert max(rel(static[k][b:b + 1, : 2 * n], exact[b][k]) for b, n in enumerate(lengths)) > 1e-2


def test_without_lengths_the_modules_are_kokoros(models):
    """The standalone decoder step has no frame lengths: the patched decoder is Kokoro's, bit for bit."""
    g = torch.Generator().manual_seed(1)
    frames = 5
    asr, s = torch.randn(1, 512, frames, generator=g), torch.randn(1, 128, generator=g)
    f0, n = 150 + 50 * torch.rand(1, 2 * frames, generator=g), torch.randn(1, 2 * frames, generator=g)
    noise = sample_noise(0, frames * 600)
    st = get_step("decoder")
    with torch.no_grad():
        a = st.module(models["patched"])(asr, f0, n, s, *noise.values())
        b = st.module(models["kokoro"])(asr, f0, n, s, *noise.values())
    assert torch.equal(a, b)


def synthesizer_batch(tokens, frames, T_tok, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(tokens)
    L_tok = torch.tensor(tokens)
    mask = torch.arange(T_tok)[None] >= L_tok[:, None]
    aln = torch.zeros(B, T_tok, T)
    for b, (nt, nf) in enumerate(zip(tokens, frames)):
        dur = torch.full((nt,), nf // nt)
        dur[: nf - int(dur.sum())] += 1
        aln[b, torch.repeat_interleave(torch.arange(nt), dur), torch.arange(nf)] = 1
    noise = sample_noise(3, T * 600, batch=B)
    return dict(d=torch.randn(B, T_tok, 640, generator=g), aln=aln,
                input_ids=torch.randint(1, 170, (B, T_tok), generator=g).masked_fill(mask, 0),
                input_lengths=L_tok, text_mask=mask, s_pred=torch.randn(B, 128, generator=g),
                s_dec=torch.randn(B, 128, generator=g), frame_lengths=torch.tensor(frames), **noise)


def exact_inputs(batch, b, nt, nf):
    n = nf * 600
    one = {k: v[b:b + 1] for k, v in batch.items()}
    one.update(d=one["d"][:, :nt], aln=one["aln"][:, :nt, :nf], input_ids=one["input_ids"][:, :nt],
               text_mask=one["text_mask"][:, :nt], sine_noise=one["sine_noise"][:, :n],
               source_noise=one["source_noise"][:, :n])
    return one


@pytest.mark.parametrize("stft", ["torch", "custom_stft"])
def test_synthesizer_on_a_bucket_equals_the_exact_runs(models, stft):
    """The whole synthesizer (f0n, decoder, generator with SineGen, STFT and iSTFT) on an 8-frame
    bucket, three sequences: each one's audio equals Kokoro's on its exact frames, padding is silent."""
    tokens, frames, T_tok, T = [4, 2, 3], [6, 3, 5], 5, 8
    batch = synthesizer_batch(tokens, frames, T_tok, T)
    suffix = "" if stft == "torch" else "_custom_stft"
    st = get_step("synthesizer")
    with torch.no_grad():
        patched = st.module(models["patched" + suffix])(*batch.values())
        exact = [st.module(models["kokoro" + suffix])(*exact_inputs(batch, b, nt, nf).values())
                 for b, (nt, nf) in enumerate(zip(tokens, frames))]
        static = None
        if stft == "torch":
            static = st.module(models["static"])(*batch.values())
    for b, nf in enumerate(frames):
        n = nf * 600
        assert rel(patched[b:b + 1, :n], exact[b]) < TOL, b
        assert torch.all(patched[b, n:] == 0)
    if static is not None:
        assert max(rel(static[b:b + 1, : nf * 600], exact[b]) for b, nf in enumerate(frames)) > 1e-2


def test_patched_f0n_exports_with_lengths_as_input(models):
    """torch.export (strict=False, as harness.programs) takes the patched f0n at a fixed bucket; the
    program run with other lengths still equals the exact runs, so the lengths are a runtime input."""
    lengths, T = [12, 5, 9], 16
    xs, s, batch, L = f0n_batch(lengths, T)
    module = get_step("f0n").module(models["patched"])
    with torch.no_grad():
        program = torch.export.export(module, (batch, s, L), strict=False)
        # The masked statistics are plain sum/where/rsqrt: no InstanceNorm (batch_norm) op is left.
        ops = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
        assert not [op for op in ops if "batch_norm" in op or "instance_norm" in op]
        other = [7, 16, 3]
        xs2, s2, batch2, L2 = f0n_batch(other, T, seed=6)
        got = program.module()(batch2, s2, L2)
        for b, n in enumerate(other):
            exact = get_step("f0n").module(models["kokoro"])(xs2[b], s2[b:b + 1], torch.tensor([n]))
            assert rel(got[0][b:b + 1, : 2 * n], exact[0]) < TOL
            assert rel(got[1][b:b + 1, : 2 * n], exact[1]) < TOL


@pytest.mark.slow
def test_patched_synthesizer_exports(models):
    """The patched synthesizer (CustomSTFT, as the exporting backends use it) exports at a bucket."""
    tokens, frames, T_tok, T = [4, 2], [6, 3], 5, 8
    batch = synthesizer_batch(tokens, frames, T_tok, T)
    module = get_step("synthesizer").module(models["patched_custom_stft"])
    with torch.no_grad():
        program = torch.export.export(module, tuple(batch.values()), strict=False)
        assert rel(program.module()(*batch.values()), module(*batch.values())) < 1e-6
