"""LengthAwareLSTM against Kokoro's packed LSTM (pack_padded_sequence -> nn.LSTM -> pad_packed).

Error metric: ``rel`` is the norm-wise relative error ||y - ref|| / ||ref||. Two correct float32
LSTM implementations do not agree bit for bit: on CPU, nn.LSTM's own packed, unpacked and oneDNN
paths differ by up to ~1e-6 of max|ref| in single elements (GEMM blocking changes with the batch
composition of each step), and each is ~8e-7 from a float64 truth. So the float32 checks use the
norm-wise 1e-6 and bound the worst element at 4e-6 of max|ref|; the float64 checks use 1e-12.
"""
from __future__ import annotations


import pytest
import torch
from torch import nn

from harness.patches.length_aware_lstm import (
    LengthAwareLSTM,
    lengths_to_mask,
    packed_lstm_reference,
    reverse_within_length,
)

KOKORO = (640, 256)  # d_hid + style_dim -> d_hid // 2, as in Kokoro-82M
SMALL = (5, 3)
T = 9
LENGTHS = {1: [6], 4: [7, 3, 5, 1]}
IMPLS = ("aten", "unrolled", "scan")


def rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).norm() / ref.norm()).item()


def max_rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y - ref).abs().max() / ref.abs().max()).item()


def make(sizes, bidirectional=True, bias=True, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    lstm = nn.LSTM(sizes[0], sizes[1], 1, batch_first=True, bidirectional=bidirectional, bias=bias)
    return lstm.to(dtype).eval()


def inputs(B, C, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g, dtype=dtype)
    return x, torch.tensor(LENGTHS[B], dtype=torch.int64)


# -- parity with the packed reference ---------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("sizes", [KOKORO, SMALL], ids=["kokoro", "small"])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bi", "uni"])
def test_matches_packed_float32(impl, B, sizes, bidirectional):
    lstm = make(sizes, bidirectional)
    x, lengths = inputs(B, sizes[0])
    with torch.no_grad():
        ref, _ = packed_lstm_reference(lstm, x, lengths)
        y = LengthAwareLSTM(lstm, impl)(x, lengths)
    assert y.shape == (B, T, sizes[1] * (2 if bidirectional else 1))
    assert rel(y, ref) <= 1e-6
    assert max_rel(y, ref) <= 4e-6
    pad = ~lengths_to_mask(lengths, T)
    assert torch.count_nonzero(y[pad]) == 0  # padded steps exactly zero


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize("sizes", [KOKORO, SMALL], ids=["kokoro", "small"])
def test_matches_packed_float64(impl, B, sizes):
    lstm = make(sizes)
    module = LengthAwareLSTM(lstm, impl).double()  # shared parameters: converts `lstm` too
    assert lstm.weight_ih_l0.dtype == torch.float64
    x, lengths = inputs(B, sizes[0], dtype=torch.float64)
    with torch.no_grad():
        ref, _ = packed_lstm_reference(lstm, x, lengths)
        y = module(x, lengths)
    assert y.dtype == torch.float64
    assert rel(y, ref) <= 1e-12
    assert max_rel(y, ref) <= 1e-12
    assert torch.count_nonzero(y[~lengths_to_mask(lengths, T)]) == 0


def test_naive_static_run_does_not_match():
    """The failure this module exists for: nn.LSTM on the padded input, outputs masked."""
    lstm = make(KOKORO)
    x, lengths = inputs(4, KOKORO[0])
    with torch.no_grad():
        ref, _ = packed_lstm_reference(lstm, x, lengths)
        naive = lstm(x)[0] * lengths_to_mask(lengths, T).unsqueeze(-1)
        H = KOKORO[1]
        # The forward direction is causal, so only the reverse half goes wrong ...
        assert rel(naive[..., :H], ref[..., :H]) <= 1e-6
        assert rel(naive[..., H:], ref[..., H:]) > 1e-2
        assert rel(naive, ref) > 1e-3
        # ... and only for sequences shorter than T (B=1 with full length is fine).
        full = torch.full((1,), T)
        ref_full, _ = packed_lstm_reference(lstm, x[:1], full)
        assert rel(lstm(x[:1])[0], ref_full) <= 1e-6


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_content_is_ignored(impl):
    lstm = make(SMALL)
    x, lengths = inputs(4, SMALL[0])
    pad = ~lengths_to_mask(lengths, T)
    dirty = x.clone()
    dirty[pad] = float("nan")
    dirty[1, -1] = float("inf")
    module = LengthAwareLSTM(lstm, impl)
    with torch.no_grad():
        assert torch.equal(module(dirty, lengths), module(x, lengths))


@pytest.mark.parametrize("impl", IMPLS)
def test_initial_state(impl):
    lstm = make(SMALL)
    x, lengths = inputs(4, SMALL[0])
    g = torch.Generator().manual_seed(7)
    hx = (torch.randn(2, 4, SMALL[1], generator=g), torch.randn(2, 4, SMALL[1], generator=g))
    with torch.no_grad():
        ref, _ = packed_lstm_reference(lstm, x, lengths, hx)
        y = LengthAwareLSTM(lstm, impl)(x, lengths, hx)
    assert rel(y, ref) <= 1e-6


@pytest.mark.parametrize("impl", ["unrolled", "scan"])
@pytest.mark.parametrize("sizes", [KOKORO, SMALL], ids=["kokoro", "small"])
@pytest.mark.parametrize("bidirectional", [True, False], ids=["bi", "uni"])
def test_final_state(sizes, bidirectional, impl):
    lstm = make(sizes, bidirectional)
    x, lengths = inputs(4, sizes[0])
    with torch.no_grad():
        ref, (h_ref, c_ref) = packed_lstm_reference(lstm, x, lengths)
        y, (h, c) = LengthAwareLSTM(lstm, "aten" if impl == "unrolled" else impl).forward_with_state(x, lengths)
    assert rel(y, ref) <= 1e-6
    assert h.shape == h_ref.shape and c.shape == c_ref.shape
    assert rel(h, h_ref) <= 1e-6
    assert rel(c, c_ref) <= 1e-6


def test_no_bias():
    lstm = make(SMALL, bias=False)
    x, lengths = inputs(4, SMALL[0])
    with torch.no_grad():
        ref, _ = packed_lstm_reference(lstm, x, lengths)
        for impl in IMPLS:
            assert rel(LengthAwareLSTM(lstm, impl)(x, lengths), ref) <= 1e-6


# -- parameters and helpers -------------------------------------------------------------------


def test_parameters_are_shared_under_lstm_names():
    lstm = make(SMALL)
    module = LengthAwareLSTM(lstm)
    assert list(module.state_dict()) == list(lstm.state_dict())
    for name, p in lstm.named_parameters():
        assert getattr(module, name) is p
    # A Kokoro checkpoint's LSTM weights load straight in.
    other = make(SMALL, seed=3)
    module.load_state_dict(other.state_dict())
    assert torch.equal(lstm.weight_hh_l0_reverse, other.weight_hh_l0_reverse)


def test_rejects_unsupported_lstms():
    with pytest.raises(ValueError):
        LengthAwareLSTM(nn.LSTM(4, 3, num_layers=2, batch_first=True))
    with pytest.raises(ValueError):
        LengthAwareLSTM(nn.LSTM(4, 3, batch_first=False))
    with pytest.raises(ValueError):
        LengthAwareLSTM(nn.LSTM(4, 3, batch_first=True, proj_size=2))


def test_rejects_bad_lengths_in_eager():
    module = LengthAwareLSTM(make(SMALL))
    x, _ = inputs(4, SMALL[0])
    for bad in ([7, 3, 5, 0], [7, 3, 5, T + 1]):
        with pytest.raises(ValueError):
            module(x, torch.tensor(bad))


def test_helpers():
    lengths = torch.tensor([3, 1, 4])
    mask = lengths_to_mask(lengths, 4)
    assert mask.tolist() == [[True, True, True, False], [True, False, False, False], [True] * 4]
    x = torch.arange(12.0).view(3, 4, 1)
    r = reverse_within_length(x, lengths)
    assert r[..., 0].tolist() == [[2, 1, 0, 3], [4, 5, 6, 7], [11, 10, 9, 8]]
    assert torch.equal(reverse_within_length(r, lengths), x)


# -- torch.export -----------------------------------------------------------------------------


class _Wrapper(nn.Module):
    def __init__(self, lstm: nn.LSTM, impl: str):
        super().__init__()
        self.lstm = LengthAwareLSTM(lstm, impl)

    def forward(self, x, lengths):
        return self.lstm(x, lengths)


def _ops(ep) -> set[str]:
    return {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("impl", IMPLS)
def test_torch_export_static(impl):
    lstm = make(KOKORO)
    model = _Wrapper(lstm, impl).eval()
    Tx = 16
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, Tx, KOKORO[0], generator=g)
    ep = torch.export.export(model, (x, torch.tensor([11])), strict=False)
    ops = _ops(ep)
    assert not any("pack" in op for op in ops)
    assert ("aten.lstm.input" in ops) == (impl == "aten")
    assert "aten.gather.default" in ops and "aten.where.self" in ops
    decomposed = ep.run_decompositions()  # core ATen, what ExecuTorch's to_edge sees
    assert "aten.lstm.input" not in _ops(decomposed)
    # lengths is a runtime input: a different length through the same program.
    for n in (11, 4, Tx):
        lengths = torch.tensor([n])
        with torch.no_grad():
            eager = model(x, lengths)
            ref, _ = packed_lstm_reference(lstm, x, lengths)
        for prog in (ep, decomposed):
            y = prog.module()(x, lengths)
            assert max_rel(y, eager) <= 1e-6
            assert rel(y, ref) <= 1e-6
            assert torch.count_nonzero(y[0, n:]) == 0


def test_unrolled_impl_stays_in_few_xnnpack_partitions():
    """Finding 6: ExecuTorch's decomposition of aten.lstm leaves split_with_sizes_copy / select_copy
    / where in every time step, which the XNNPACK partitioner does not take, so each step is its own
    delegate subgraph (T + 3). The unrolled impl is written with ops XNNPACK takes: 3, for any T."""
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(0)
    lstm = nn.LSTM(16, 8, batch_first=True, bidirectional=True).eval()
    T = 6

    class Wrap(nn.Module):
        def __init__(self, impl):
            super().__init__()
            self.lstm = LengthAwareLSTM(lstm, impl=impl)

        def forward(self, x, lengths):
            return self.lstm(x, lengths)

    x, lengths = torch.randn(1, T, 16), torch.tensor([4])
    subgraphs = {}
    for impl in ("aten", "unrolled"):
        with torch.no_grad():
            program = torch.export.export(Wrap(impl), (x, lengths), strict=False)
        lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        subgraphs[impl] = get_delegation_info(lowered.exported_program().graph_module).num_delegated_subgraphs
    assert subgraphs["aten"] >= T and subgraphs["unrolled"] <= 3, subgraphs


# -- impl="scan": the cell once, whatever T ----------------------------------------------------


@pytest.mark.parametrize("bidirectional", [True, False], ids=["bi", "uni"])
def test_scan_equals_unrolled_bit_for_bit(bidirectional):
    """One cell function for both: the same ops in the same order, so the same bits in eager."""
    lstm = make(KOKORO, bidirectional)
    x, lengths = inputs(4, KOKORO[0])
    with torch.no_grad():
        y_u, (h_u, c_u) = LengthAwareLSTM(lstm, "unrolled").forward_with_state(x, lengths)
        y_s, (h_s, c_s) = LengthAwareLSTM(lstm, "scan").forward_with_state(x, lengths)
    assert torch.equal(y_s, y_u) and torch.equal(h_s, h_u) and torch.equal(c_s, c_u)


def _export(impl: str, Tx: int, sizes=SMALL, lstm=None):
    lstm = lstm if lstm is not None else make(sizes)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, Tx, sizes[0], generator=g)
    with torch.no_grad():
        return torch.export.export(_Wrapper(lstm, impl).eval(), (x, torch.tensor([Tx - 1])), strict=False), x


def _node_count(gm) -> int:
    """call_function nodes of a graph and of the bodies its higher-order ops call."""
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function":
            n += 1
        elif node.op == "get_attr" and isinstance(getattr(gm, node.target, None), torch.fx.GraphModule):
            n += _node_count(getattr(gm, node.target))
    return n


def test_scan_graph_does_not_grow_with_T():
    """The point of impl="scan": the exported graph is the same size at 8 and 64 steps (the
    unrolled one grows with T), and its one `scan` node runs the cell."""
    sizes = {impl: [_node_count(_export(impl, Tx)[0].graph_module) for Tx in (8, 64)]
             for impl in ("scan", "unrolled")}
    assert sizes["scan"][0] == sizes["scan"][1], sizes
    assert sizes["unrolled"][1] > sizes["unrolled"][0] + 50 * 5, sizes
    program = _export("scan", 8)[0]
    scans = [n for n in program.graph.nodes if n.target is torch.ops.higher_order.scan]
    assert len(scans) == 1 and "aten.lstm.input" not in _ops(program)


def test_scan_export_is_right_when_h0_and_c0_are_one_tensor():
    """torch 2.13 exports a scan whose two carries are one tensor wrongly (the exported program
    mixes them up: rel error 0.17 on Kokoro's shapes). Zeros for h0 and c0 are one tensor by
    default, and a caller may pass the same tensor twice; the carries are cloned first."""
    lstm = make(SMALL)
    Tx = 10
    g = torch.Generator().manual_seed(8)
    x, h0 = torch.randn(1, Tx, SMALL[0], generator=g), torch.randn(2, 1, SMALL[1], generator=g)

    class WithState(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = LengthAwareLSTM(lstm, "scan")

        def forward(self, x, lengths, h):
            return self.lstm(x, lengths, (h, h))

    lengths = torch.tensor([7])
    with torch.no_grad():
        ep = torch.export.export(WithState().eval(), (x, lengths, h0), strict=False)
        ref, _ = packed_lstm_reference(lstm, x, lengths, (h0, h0))
        default_ep, _ = _export("scan", Tx, lstm=lstm)
        default_ref, _ = packed_lstm_reference(lstm, x, lengths)
    assert rel(ep.module()(x, lengths, h0), ref) <= 1e-6
    assert rel(default_ep.module()(x, lengths), default_ref) <= 1e-6


def test_scan_lowers_to_executorch_with_its_body_delegated():
    """ExecuTorch emits the scan as a loop; XnnpackPartitioner leaves its body to portable kernels,
    XnnpackControlFlowPartitioner puts it in an XNNPACK delegate. Both programs run and give the
    packed result at the fp32 floor, and the padded steps are exactly zero."""
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.graph_module import get_control_flow_submodules
    from executorch.runtime import Runtime

    from harness.backends.control_flow import XnnpackControlFlowPartitioner

    lstm = make((16, 8))
    Tx, n = 8, 5
    program, x = _export("scan", Tx, sizes=(16, 8), lstm=lstm)
    lengths = torch.tensor([n])
    with torch.no_grad():
        ref, _ = packed_lstm_reference(lstm, x, lengths)
    delegated_bodies = {}
    for name, partitioner in (("stock", XnnpackPartitioner()), ("control_flow", XnnpackControlFlowPartitioner())):
        edge = to_edge_transform_and_lower(program, partitioner=[partitioner])
        bodies = [body for _, body, _ in get_control_flow_submodules(edge.exported_program().graph_module)]
        assert len(bodies) == 1, name
        delegated_bodies[name] = sum("executorch_call_delegate" in str(node.target) for node in bodies[0].graph.nodes)
        buffer = edge.to_executorch().buffer
        y = Runtime.get().load_program(buffer).load_method("forward").execute([x, lengths])[0]
        assert rel(y, ref) <= 2e-6, name
        assert torch.count_nonzero(y[0, n:]) == 0
    assert delegated_bodies == {"stock": 0, "control_flow": 1}
