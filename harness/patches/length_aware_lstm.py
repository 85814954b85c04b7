"""Packed-sequence LSTM semantics with static shapes, for exporting Kokoro's LSTMs.

Kokoro runs its bidirectional LSTMs (TextEncoder.lstm, DurationEncoder.lstms[0, 2, 4],
ProsodyPredictor.lstm) on ``pack_padded_sequence``, so padding never enters the recurrence. A
static export (torch.export with a fixed bucket length T) cannot use PackedSequence. Running the
LSTM on the padded tensor is wrong in the reverse direction: it starts at step T-1 and reads the
padding before the valid steps, and its state carries that into every valid output. Masking the
outputs afterwards cannot undo that.

``LengthAwareLSTM`` gives the packed result with static-shape ops only:

* forward direction: a plain unidirectional LSTM over the padded input. It is causal, so the
  outputs at t < length never see the padding; the outputs at t >= length are set to zero.
* reverse direction: each sequence is reversed *within its own length* (one ``gather`` with
  ``idx = where(t < len, len - 1 - t, t)``), run through a unidirectional LSTM that uses the
  reverse weights, zeroed after the length, and reversed back with the same index (it is its own
  inverse). The padding stays after the valid steps, so again it cannot reach a valid output.

Padded outputs are exactly zero, as ``pad_packed_sequence`` gives (``torch.where`` on the inputs,
so NaN or Inf in the padding does not leak either).

Three implementations, the same maths:

* ``impl="aten"`` (default): ``torch.lstm`` per direction. ``torch.export`` keeps it as one
  ``aten.lstm.input`` node per direction; ``run_decompositions()`` (what ExecuTorch's ``to_edge``
  does) unrolls it into addmm/sigmoid/tanh per time step. Returns outputs only.
* ``impl="unrolled"``: the cell written out step by step, both directions batched through
  ``bmm``, with the state frozen after each sequence's last valid step. No ``aten.lstm`` in the
  graph, and only ops that XNNPACK delegates inside the loop (3 delegate subgraphs instead of
  T + 3). ``forward_with_state`` uses this path (or the scan one with impl="scan"), because only
  there are the final states (h_n, c_n) at each sequence's last valid step available (aten.lstm
  does not expose the cell state per step, so c_n is not cheap there). Kokoro discards them.
* ``impl="scan"``: the same cell (one shared function, so the same ops in the same order: equal
  to the unrolled path bit for bit in eager) as the body of torch's ``scan`` higher-order op over
  the time steps, with the per-step masks among the scanned inputs. The graph holds the cell once,
  whatever T, so export, lowering time and lowering memory stay flat as the bucket grows, where
  the unrolled graph grows with T (XNNPACK: 8.6 GB of lowering peak for f0n at 384 frames).
  ExecuTorch 1.5.1 emits ``scan`` as a loop; its XnnpackPartitioner does not look inside the
  body, so the cell runs on portable kernels unless the partitioner of
  ``harness.backends.control_flow`` is used. onnxruntime takes it (an ONNX ``Scan``); TVM Relax
  and coremltools 9 do not convert ``scan``. Measured in docs/performance.md ("LSTM cost against
  T"). The initial states are cloned before the scan: torch 2.13 exports a scan whose two carries
  are one tensor (h0 = c0 = zeros) wrongly.

The parameters are the original ``nn.LSTM``'s own Parameter objects (shared, not copied) and are
registered under the same names (``weight_ih_l0``, ``weight_ih_l0_reverse``, ...), so a Kokoro
checkpoint's state dict loads into a module where the nn.LSTM has been swapped for this one.
Note that ``.double()``/``.to()`` on either module then converts the shared parameters of both.

T must be static in an export with any implementation: in torch 2.13 tracing ``aten.lstm``
unrolls it over T and specializes T (a plain nn.LSTM fails with a dynamic T in the same way), the
unrolled path loops over ``range(T)``, and the scan path's masks are built for that T. B may be
anything; lengths is a runtime input.

Lengths must satisfy 1 <= length <= T (as pack_padded_sequence requires); this is checked in
eager mode only, since a value check cannot be traced. While tracing, lengths are clamped to
[0, T] so that the gather index can never go out of bounds; a length of 0 gives zero outputs.
"""
from __future__ import annotations

from typing import Optional, Tuple

from torch._higher_order_ops.scan import scan

IMPLS = ("aten", "unrolled", "scan")

import torch
from torch import Tensor, nn

__all__ = [
    "LengthAwareLSTM",
    "lengths_to_mask",
    "reverse_within_length",
    "packed_lstm_reference",
]


def lengths_to_mask(lengths: Tensor, T: int) -> Tensor:
    """Bool mask [B, T], True at valid steps (t < lengths[b]).

    Kokoro's own ``text_mask`` is the opposite convention (True at padding).
    """
    t = torch.arange(T, device=lengths.device, dtype=lengths.dtype)
    return t.unsqueeze(0) < lengths.unsqueeze(1)


def _reverse_index(lengths: Tensor, T: int) -> Tensor:
    """[B, T] int64 index that reverses each row within its length and leaves the tail in place."""
    if lengths.dtype != torch.int64:
        lengths = lengths.to(torch.int64)
    t = torch.arange(T, device=lengths.device, dtype=torch.int64).unsqueeze(0)
    L = lengths.unsqueeze(1)
    return torch.where(t < L, L - 1 - t, t)


def reverse_within_length(x: Tensor, lengths: Tensor) -> Tensor:
    """Reverse x [B, T, C] along T within each sequence's length; padded steps stay where they are.

    Its own inverse: ``reverse_within_length(reverse_within_length(x, l), l) == x``.
    """
    idx = _reverse_index(lengths, x.shape[1])
    return torch.gather(x, 1, idx.unsqueeze(-1).expand(-1, -1, x.shape[2]))


def _tracing() -> bool:
    return (
        torch.compiler.is_exporting()
        or torch.compiler.is_compiling()
        or torch.jit.is_tracing()
        or torch.jit.is_scripting()
    )


class LengthAwareLSTM(nn.Module):
    """Single-layer, batch_first nn.LSTM with pack_padded_sequence semantics, static shapes only.

    ``forward(x [B, T, C], lengths [B] int64, hx=None) -> output [B, T, H * dirs]`` equals
    ``pad_packed_sequence(lstm(pack_padded_sequence(x, lengths, batch_first=True,
    enforce_sorted=False)), batch_first=True, total_length=T)[0]``.

    ``hx`` is an optional (h0, c0), each [dirs, B, H] in the caller's batch order (as nn.LSTM
    takes it with a PackedSequence); zeros when None.
    """

    def __init__(self, lstm: nn.LSTM, impl: str = "aten"):
        super().__init__()
        if not isinstance(lstm, nn.LSTM):
            raise TypeError(f"expected nn.LSTM, got {type(lstm).__name__}")
        if lstm.num_layers != 1:
            raise ValueError("only single-layer LSTMs are supported")
        if not lstm.batch_first:
            raise ValueError("only batch_first=True is supported")
        if lstm.proj_size:
            raise ValueError("proj_size > 0 is not supported")
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, not {impl!r}")
        self.impl = impl
        self.input_size = lstm.input_size
        self.hidden_size = lstm.hidden_size
        self.bidirectional = lstm.bidirectional
        self.bias = lstm.bias
        self.num_directions = 2 if lstm.bidirectional else 1
        # Share the very same Parameter objects, under nn.LSTM's own names.
        self._weight_names = list(lstm._flat_weights_names)
        for name in self._weight_names:
            setattr(self, name, getattr(lstm, name))

    @classmethod
    def from_lstm(cls, lstm: nn.LSTM, impl: str = "aten") -> "LengthAwareLSTM":
        return cls(lstm, impl=impl)

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, bidirectional={self.bidirectional}, "
                f"bias={self.bias}, impl={self.impl!r}")

    # -- parameters -----------------------------------------------------------------------------

    def _direction_params(self, d: int) -> list[Tensor]:
        suffix = "_reverse" if d == 1 else ""
        names = ["weight_ih_l0", "weight_hh_l0"] + (["bias_ih_l0", "bias_hh_l0"] if self.bias else [])
        return [getattr(self, n + suffix) for n in names]

    # -- checks ---------------------------------------------------------------------------------

    def _check(self, x: Tensor, lengths: Tensor, hx: Optional[Tuple[Tensor, Tensor]]) -> Tensor:
        if x.dim() != 3 or x.shape[2] != self.input_size:
            raise ValueError(f"x must be [B, T, {self.input_size}], got {tuple(x.shape)}")
        if lengths.dim() != 1 or lengths.shape[0] != x.shape[0]:
            raise ValueError(f"lengths must be [B={x.shape[0]}], got {tuple(lengths.shape)}")
        if hx is not None:
            want = (self.num_directions, x.shape[0], self.hidden_size)
            for h in hx:
                if tuple(h.shape) != want:
                    raise ValueError(f"hx tensors must be {want}, got {tuple(h.shape)}")
        if lengths.dtype != torch.int64:
            lengths = lengths.to(torch.int64)
        if _tracing():
            return lengths.clamp(0, x.shape[1])
        if lengths.numel() and (int(lengths.min()) < 1 or int(lengths.max()) > x.shape[1]):
            raise ValueError(f"lengths must lie in [1, T={x.shape[1]}], got {lengths.tolist()}")
        return lengths

    def _initial_state(self, x: Tensor, hx: Optional[Tuple[Tensor, Tensor]]) -> Tuple[Tensor, Tensor]:
        if hx is None:
            z = x.new_zeros(self.num_directions, x.shape[0], self.hidden_size)
            return z, z
        return hx[0].to(x.dtype), hx[1].to(x.dtype)

    # -- forward --------------------------------------------------------------------------------

    def forward(self, x: Tensor, lengths: Tensor,
                hx: Optional[Tuple[Tensor, Tensor]] = None) -> Tensor:
        lengths = self._check(x, lengths, hx)
        if self.impl == "unrolled":
            return self._unrolled(x, lengths, hx)[0]
        if self.impl == "scan":
            return self._scan(x, lengths, hx)[0]
        return self._aten(x, lengths, hx)

    def forward_with_state(self, x: Tensor, lengths: Tensor,
                           hx: Optional[Tuple[Tensor, Tensor]] = None
                           ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """(output, (h_n, c_n)) with the packed final states, each [dirs, B, H] (the scan path
        with impl="scan", else the unrolled one)."""
        lengths = self._check(x, lengths, hx)
        return (self._scan if self.impl == "scan" else self._unrolled)(x, lengths, hx)

    def _aten(self, x: Tensor, lengths: Tensor, hx: Optional[Tuple[Tensor, Tensor]]) -> Tensor:
        B, T, _ = x.shape
        h0, c0 = self._initial_state(x, hx)
        valid = lengths_to_mask(lengths, T).unsqueeze(-1)  # [B, T, 1]
        out_f = torch.lstm(x, (h0[0:1], c0[0:1]), self._direction_params(0), self.bias,
                           1, 0.0, False, False, True)[0]
        outs = [torch.where(valid, out_f, torch.zeros_like(out_f))]
        if self.bidirectional:
            idx = _reverse_index(lengths, T).unsqueeze(-1)  # [B, T, 1]
            x_r = torch.gather(x, 1, idx.expand(-1, -1, x.shape[2]))
            out_r = torch.lstm(x_r, (h0[1:2], c0[1:2]), self._direction_params(1), self.bias,
                               1, 0.0, False, False, True)[0]
            out_r = torch.where(valid, out_r, torch.zeros_like(out_r))
            outs.append(torch.gather(out_r, 1, idx.expand(-1, -1, out_r.shape[2])))
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def _input_gates(self, x: Tensor, lengths: Tensor, hx: Optional[Tuple[Tensor, Tensor]]):
        """What the written-out cells share: the initial state [D, B, H], the input projection of
        every step at once [D, B, T, 4H] (the reverse direction on the input reversed within each
        length), the valid mask [B, T] as 0/1 in x's dtype and its complement (1 - mask, made once,
        not per step: a constant inside a scan body stays outside the delegate), the reverse index
        and W_hh^T [D, H, 4H]. The padding is zeroed first, so NaN or Inf in it cannot reach the state
        through m = 0."""
        T = x.shape[1]
        D = self.num_directions
        h, c = self._initial_state(x, hx)  # [D, B, H]
        valid_b = lengths_to_mask(lengths, T)  # [B, T]
        x = torch.where(valid_b.unsqueeze(-1), x, torch.zeros_like(x))
        xs, idx = [x], None
        if self.bidirectional:
            idx = _reverse_index(lengths, T).unsqueeze(-1)
            xs.append(torch.gather(x, 1, idx.expand(-1, -1, x.shape[2])))
        params = [self._direction_params(d) for d in range(D)]
        w_ih = torch.stack([p[0] for p in params])  # [D, 4H, C]
        w_hh_t = torch.stack([p[1] for p in params]).transpose(1, 2)  # [D, H, 4H]
        gx = torch.matmul(torch.stack(xs), w_ih.transpose(1, 2).unsqueeze(1))
        if self.bias:
            b = torch.stack([p[2] + p[3] for p in params])  # [D, 4H]
            gx = gx + b[:, None, None, :]
        valid = valid_b.to(x.dtype)
        return h, c, gx, valid, 1 - valid, idx, w_hh_t

    def _outputs(self, y: Tensor, idx: Optional[Tensor]) -> Tensor:
        """[D, B, T, H] per direction -> [B, T, D * H], the reverse one put back in time order."""
        outs = [y[0]]
        if self.bidirectional:
            outs.append(torch.gather(y[1], 1, idx.expand(-1, -1, self.hidden_size)))
        return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]

    def _unrolled(self, x: Tensor, lengths: Tensor, hx: Optional[Tuple[Tensor, Tensor]]
                  ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """The cell per time step, written with the ops a delegate takes (see `_cell`). Each of
        `select`/`split`/`where` would break the XNNPACK partition at every step: T+3 delegate
        subgraphs for aten.lstm, 3 here."""
        B, T, _ = x.shape
        D, H = self.num_directions, self.hidden_size
        h, c, gx, valid, invalid, idx, w_hh_t = self._input_gates(x, lengths, hx)
        ys = []
        for t in range(T):
            g_x = gx[:, :, t:t + 1, :].reshape(D, B, 4 * H)
            m, keep = (v[:, t:t + 1].reshape(1, B, 1) for v in (valid, invalid))
            h, c, y = _cell(g_x, m, keep, h, c, w_hh_t, H)
            ys.append(y.reshape(D, B, 1, H))
        return self._outputs(torch.cat(ys, dim=2), idx), (h, c)

    def _scan(self, x: Tensor, lengths: Tensor, hx: Optional[Tuple[Tensor, Tensor]]
              ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
        """The same cell as the body of torch's `scan` over T: one copy in the graph for any T.
        Scanned inputs: the step's input gates [D, B, 4H] and its masks [1, B, 1]; carry (h, c);
        W_hh^T is a closure, which export lifts into the op's additional inputs."""
        B, T, _ = x.shape
        H = self.hidden_size
        h, c, gx, valid, invalid, idx, w_hh_t = self._input_gates(x, lengths, hx)

        def step(carry, inputs):
            h, c, y = _cell(*inputs, *carry, w_hh_t, H)
            return (h, c), y

        m, keep = (v.transpose(0, 1).reshape(T, 1, B, 1) for v in (valid, invalid))
        # clone: the two carries must not be one tensor (h0 = c0 = zeros); see the module docstring
        (h, c), ys = scan(step, (h.clone(), c.clone()), (gx.permute(2, 0, 1, 3), m, keep))  # ys [T, D, B, H]
        return self._outputs(ys.permute(1, 2, 0, 3), idx), (h, c)


def _cell(g_x: Tensor, m: Tensor, keep: Tensor, h: Tensor, c: Tensor, w_hh_t: Tensor, H: int
          ) -> Tuple[Tensor, Tensor, Tensor]:
    """One LSTM step of both directions at once: (h, c, output). g_x [D, B, 4H] is the step's input
    projection with both biases, m [1, B, 1] is 1 at valid steps and 0 after a sequence's length,
    keep = 1 - m.
    The gates come by slicing (not `select`/`split`, which ExecuTorch lowers to select_copy and
    split_with_sizes_copy) and the freeze after the length is `new*m + old*(1-m)` with m in {0, 1}
    (exact; not `where`, which XNNPACK has no kernel for): ops that XNNPACK delegates."""
    g = g_x + torch.bmm(h, w_hh_t)  # [D, B, 4H]
    i, f, gg, o = (g[..., k * H:(k + 1) * H] for k in range(4))
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(gg)
    h_new = torch.sigmoid(o) * torch.tanh(c_new)
    return h_new * m + h * keep, c_new * m + c * keep, h_new * m


def packed_lstm_reference(lstm: nn.LSTM, x: Tensor, lengths: Tensor,
                          hx: Optional[Tuple[Tensor, Tensor]] = None
                          ) -> Tuple[Tensor, Tuple[Tensor, Tensor]]:
    """What Kokoro computes: pack (enforce_sorted=False), run, pad back to x's T. Eager only."""
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True,
                                               enforce_sorted=False)
    out, state = lstm(packed, hx)
    out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
    return out, state
