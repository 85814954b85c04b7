"""A Conv1d with a dynamic length lowered to XNNPACK: the planned input size follows the example.

`python benchmarks/xnnpack_dynamic_range.py` (seconds; torch 2.13.0, executorch from the venv): one
Conv1d(512, 512, 3) exported with its length dynamic in [8, 1024] and lowered with
`to_edge_transform_and_lower(..., partitioner=[XnnpackPartitioner()])`. Inside XNNPACK's
preprocess, Conv1dUnsqueezePass re-traces the conv in fake mode, and torch's fake convolution asks
`torch._C._select_conv_backend`, whose size heuristic (`512*n <= 20480`) becomes a guard decided at
the example's length that narrows the range: an example of 36 plans the input for length 40, one of
1024 for 1024 (printed on 2026-11-28). The standalone repro for an upstream report; the decoder's
case is benchmarks/dynamic_decoder.py (docs/performance.md).
"""
import tempfile
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime
from torch.export import Dim


class Conv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(512, 512, 3, padding=1)

    def forward(self, x):
        return self.conv(x)


def planned(example_len: int) -> int:
    n = Dim("n", min=8, max=1024)
    ep = torch.export.export(Conv().eval(), (torch.randn(1, 512, example_len),), dynamic_shapes=({2: n},))
    pte = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "m.pte").write_bytes(pte.buffer)
        return Runtime.get().load_program(str(Path(tmp) / "m.pte")).metadata("forward").input_tensor_meta(0).sizes()[2]


for example in (36, 1024):
    print(f"example length {example}: input planned for length {planned(example)} (declared max 1024)", flush=True)
