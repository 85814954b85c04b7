"""The `length_aware_lstm` patch: a static (padded) step computes what packed Kokoro computes on the
exact lengths, for every LSTM step, at batch 1 and for batches of different lengths; plain
no-packing does not (so these tests can fail)."""
from __future__ import annotations

import pytest
import torch

from harness.patches import PATCHES, apply_patches
from harness.steps import get_step


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def models(random_model):
    return {name: apply_patches(random_model.kmodel, patches) for name, patches in {
        "kokoro": [], "padded": ["no_packing"], "length_aware": ["no_packing", "length_aware_lstm"]}.items()}


def encoders_only(kmodel):
    """A shallow copy of `kmodel` without the decoder and BERT (two thirds of its parameters), which
    the duration encoder and text encoder steps do not read: what `apply_patches` deep-copies."""
    import copy

    slim = copy.copy(kmodel)
    slim._modules = {k: v for k, v in kmodel._modules.items() if k in ("predictor", "text_encoder")}
    return slim


def batch_inputs(lengths, T, g):
    B = len(lengths)
    L = torch.tensor(lengths)
    mask = torch.arange(T)[None, :] >= L[:, None]
    ids = torch.randint(1, 170, (B, T), generator=g).masked_fill(mask, 0)
    return L, mask, ids


def test_declared_as_preserving():
    assert PATCHES["length_aware_lstm"].preserves_semantics


@pytest.mark.parametrize("lengths", [[9], [9, 4, 6]])
def test_duration_encoder_and_text_encoder(models, lengths):
    """Kokoro's own packed forward handles batches, so the reference is Kokoro at the same batch."""
    g = torch.Generator().manual_seed(0)
    T = 13
    L, mask, ids = batch_inputs(lengths, T, g)
    d_en = torch.randn(len(lengths), 512, T, generator=g).masked_fill(mask[:, None, :], 0)
    s = torch.randn(len(lengths), 128, generator=g)
    with torch.no_grad():
        for step, args in (("duration_encoder", (d_en, s, L, mask)), ("text_encoder", (ids, L, mask))):
            st = get_step(step)
            ref = st.module(models["kokoro"])(*args)
            la = st.module(models["length_aware"])(*args)
            pad = st.module(models["padded"])(*args)
            for b, n in enumerate(lengths):
                valid = (slice(b, b + 1), slice(None, n)) if step == "duration_encoder" else (slice(b, b + 1), slice(None), slice(None, n))
                assert rel(la[valid], ref[valid]) < 1e-6, (step, b)
            if min(lengths) < T:
                assert rel(pad, ref) > 1e-3, step


@pytest.mark.parametrize("step", ["duration"])
def test_unpacked_lstms_on_a_bucket_equal_the_exact_run(models, step):
    """predictor.lstm runs unpacked in Kokoro on the exact length: on a padded bucket only the
    length-aware LSTM gives the same valid outputs (batch of three lengths)."""
    g = torch.Generator().manual_seed(1)
    st = get_step(step)
    lengths, T = [11, 5, 8], 16
    outs = {}
    for name in ("length_aware", "padded"):
        xs, exact = [], []
        for n in lengths:
            if step == "duration":
                x = torch.randn(1, n, 640, generator=g)
                args_exact = (x, torch.tensor([n]), torch.tensor([1.0]))
                xs.append(torch.nn.functional.pad(x, (0, 0, 0, T - n)))
            else:
                x = torch.randn(1, 640, n, generator=g)
                args_exact = (x, torch.randn(1, 128, generator=torch.Generator().manual_seed(9)), torch.tensor([n]))
                xs.append(torch.nn.functional.pad(x, (0, T - n)))
            with torch.no_grad():
                exact.append(st.module(models["kokoro"])(*args_exact))
        s = torch.randn(1, 128, generator=torch.Generator().manual_seed(9)).expand(len(lengths), -1)
        batch = torch.cat(xs)
        L = torch.tensor(lengths)
        args = (batch, L, torch.ones(1)) if step == "duration" else (batch, s, L)
        with torch.no_grad():
            got = st.module(models[name])(*args)
        got = got if isinstance(got, tuple) else (got,)
        exact_t = [e if isinstance(e, tuple) else (e,) for e in exact]
        outs[name] = max(rel(got[k][b:b + 1, : (n if step == "duration" else 2 * n)], exact_t[b][k])
                         for b, n in enumerate(lengths) for k in range(len(got)))
    assert outs["length_aware"] < 1e-5
    assert outs["padded"] > max(1e-4, 10 * outs["length_aware"])


def test_length_aware_steps_export(models):
    """torch.export takes the patched duration encoder at a fixed bucket; lengths stay an input."""
    st = get_step("duration_encoder")
    g = torch.Generator().manual_seed(2)
    T = 10
    L, mask, _ = batch_inputs([7], T, g)
    args = (torch.randn(1, 512, T, generator=g), torch.randn(1, 128, generator=g), L, mask)
    module = st.module(apply_patches(models["kokoro"], ["no_packing", "length_aware_lstm", "dropout_identity"]))
    with torch.no_grad():
        program = torch.export.export(module, args, strict=False)
        assert rel(program.module()(*args), module(*args)) < 1e-6
        L2, mask2, _ = batch_inputs([4], T, g)
        args2 = (args[0], args[1], L2, mask2)
        assert rel(program.module()(*args2)[:, :4], st.module(models["kokoro"])(args[0][..., :4], args[1], L2, mask2[:, :4])) < 1e-6


def test_f0n_shared_lstm_on_a_frame_bucket(models):
    """predictor.shared (in F0Ntrain) on a frame bucket: length-aware equals the exact run for a
    batch of three lengths. (The AdaIN blocks after it still normalize over the padded frames:
    the f0n step as a whole keeps a rewrite drift: docs/findings.md.)"""
    g = torch.Generator().manual_seed(5)
    lengths, T = [12, 5, 9], 16
    xs = [torch.randn(1, n, 640, generator=g) for n in lengths]
    batch = torch.cat([torch.nn.functional.pad(x, (0, 0, 0, T - x.shape[1])) for x in xs])
    L = torch.tensor(lengths)
    with torch.no_grad():
        la = models["length_aware"].predictor.shared(batch, L)
        pad = models["padded"].predictor.shared(batch)[0]
        for b, x in enumerate(xs):
            exact = models["kokoro"].predictor.shared(x)[0]
            assert rel(la[b:b + 1, : lengths[b]], exact) < 1e-6
        assert max(rel(pad[b:b + 1, : n], models["kokoro"].predictor.shared(x)[0])
                   for b, (n, x) in enumerate(zip(lengths, xs))) > 1e-3


@pytest.mark.parametrize("base", [["no_packing"], ["no_packing", "length_aware_lstm"]])
def test_unrolled_lstm_keeps_the_semantics_and_leaves_no_aten_lstm(models, base):
    """`unrolled_lstm` (for converters without an LSTM lowering) computes what the LSTM it replaces
    computes, padded or length-aware, and its export has no aten.lstm left (the plain one has)."""
    assert PATCHES["unrolled_lstm"].preserves_semantics
    g = torch.Generator().manual_seed(3)
    T = 12
    L, mask, ids = batch_inputs([8], T, g)
    d_en = torch.randn(1, 512, T, generator=g).masked_fill(mask[:, None, :], 0)
    args = (d_en, torch.randn(1, 128, generator=g), L, mask)
    st = get_step("duration_encoder")
    km = encoders_only(models["kokoro"])
    plain = st.module(apply_patches(km, base + ["dropout_identity"]))
    unrolled = st.module(apply_patches(km, base + ["dropout_identity", "unrolled_lstm"]))
    with torch.no_grad():
        assert rel(unrolled(*args), plain(*args)) < 1e-6
        for text_args in ((ids, L, mask),):
            te = get_step("text_encoder")
            a = te.module(apply_patches(km, base + ["unrolled_lstm"]))(*text_args)
            assert rel(a, te.module(apply_patches(km, base))(*text_args)) < 1e-6
        lstm_ops = {}
        for name, module in (("plain", plain), ("unrolled", unrolled)):
            program = torch.export.export(module, args, strict=False).run_decompositions({})
            lstm_ops[name] = sum("lstm" in str(n.target) for n in program.graph.nodes if n.op == "call_function")
    assert lstm_ops["plain"] > 0 and lstm_ops["unrolled"] == 0


@pytest.mark.parametrize("base", [["no_packing"], ["no_packing", "length_aware_lstm"]])
def test_scan_lstm_keeps_the_semantics_and_wins_over_unrolled(models, base):
    """`scan_lstm` computes what the LSTM it replaces computes, padded or length-aware; asked for
    beside a backend's `unrolled_lstm`, every LSTM runs as a scan (it is registered after it)."""
    from harness.patches.length_aware_lstm import LengthAwareLSTM

    assert PATCHES["scan_lstm"].preserves_semantics
    g = torch.Generator().manual_seed(4)
    T = 12
    L, mask, ids = batch_inputs([8], T, g)
    d_en = torch.randn(1, 512, T, generator=g).masked_fill(mask[:, None, :], 0)
    args = (d_en, torch.randn(1, 128, generator=g), L, mask)
    st, te = get_step("duration_encoder"), get_step("text_encoder")
    plain = apply_patches(models["kokoro"], base + ["dropout_identity"])
    scan = apply_patches(models["kokoro"], base + ["dropout_identity", "unrolled_lstm", "scan_lstm"])
    assert {m.impl for m in scan.modules() if isinstance(m, LengthAwareLSTM)} == {"scan"}
    with torch.no_grad():
        assert rel(st.module(scan)(*args), st.module(plain)(*args)) < 1e-6
        assert rel(te.module(scan)(ids, L, mask), te.module(plain)(ids, L, mask)) < 1e-6
