"""How ExecuTorch's run time for CustomSTFT's phase correction grows with the signal: the boolean-mask
`phase[mask] = pi` (an `index_put` left to the portable kernels) against the `torch.where` that the
`stft_phase_where` patch writes (exact, and XNNPACK-friendly), both lowered with the XNNPACK
partitioner and timed by ExecuTorch's own profiler (harness.profile, ETDump).

    .venv/bin/python benchmarks/etdump_index_put.py [FRAMES:EVERY ...]

FRAMES are STFT frames of kokoro's 11-bin harmonic STFT (en_short's decoder: 30,721). EVERY = `dc`
is what the decoder sees: the DC and Nyquist bins' imaginary parts are exactly 0 (their sine
weights are 0), so the mask selects about one bin per frame, and its true count grows with the
signal; a number N sets imag = 0 on every N-th frame instead (0: nowhere). The mask's true count is
printed beside the times.
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.profile import etdump_job  # noqa: E402
from harness.plumbing.files import save_tensors  # noqa: E402


class MaskPut(torch.nn.Module):
    """kokoro/custom_stft.py's CustomSTFT.transform, phase part."""

    def forward(self, real, imag):
        phase = torch.atan2(imag, real)
        phase[(imag == 0) & (real < 0)] = torch.pi
        return phase


class Where(torch.nn.Module):
    """The same values with torch.where (harness/patches: stft_phase_where)."""

    def forward(self, real, imag):
        return torch.where((imag == 0) & (real < 0), torch.full_like(real, torch.pi), torch.atan2(imag, real))


def inputs(frames: int, every: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    real, imag = torch.randn(1, 11, frames, generator=g), torch.randn(1, 11, frames, generator=g)
    if every == "dc":
        imag[:, [0, 10]] = 0  # DC and Nyquist: exactly on the real axis, as kokoro's STFT computes them
    elif int(every or 0):
        imag[..., :: int(every)] = 0
    return [real, imag]


def profile(module: torch.nn.Module, args: list[torch.Tensor], work: Path) -> dict:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(module.eval(), tuple(args))
    pte = work / "program.pte"
    pte.write_bytes(to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    save_tensors(work / "inputs.pt", args)
    return etdump_job(str(pte), str(work / "inputs.pt"), str(work), repeat=4)


def main(specs: list[str]) -> None:
    print("| frames | elements | mask true | phase[mask] = pi: run (ms) | of which index_put.out (ms) | "
          "torch.where: run (ms) |")
    print("|---|---|---|---|---|---|")
    for spec in specs:
        frames, _, every = spec.partition(":")
        args = inputs(int(frames), every)
        true = int(((args[1] == 0) & (args[0] < 0)).sum())
        with tempfile.TemporaryDirectory() as tmp:
            masked = profile(MaskPut(), args, Path(tmp))
            where = profile(Where(), args, Path(tmp))
        put = sum(r["ms"] for r in masked["rows"] if r["operator"].startswith("index_put"))
        print(f"| {int(frames):,} | {args[0].numel():,} | {true:,} | {masked['summary']['execute_ms']:.2f} | "
              f"{put:.2f} | {where['summary']['execute_ms']:.2f} |", flush=True)
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main(sys.argv[1:] or ["7680:dc", "15360:dc", "30721:dc", "7680:70", "7680:0"])
