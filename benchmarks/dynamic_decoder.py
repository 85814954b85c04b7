"""Can one XNNPACK lowering of the decoder serve every case? An experiment, not a harness path.

`python benchmarks/dynamic_decoder.py [--frames 36 50 20]` (random weights, no case needed):

1. torch.export's save/load round trip of a program with a derived dimension (`2 * frames`, as the
   decoder's F0 is twice its frames) on a module of one line: `run_decompositions()` on the loaded
   program (what every lowering calls first) fails with "expected sympy.Symbol" while the program
   in memory decomposes; dropping the derived entries of the loaded shape environment's ranges
   works around it.
2. Kokoro's decoder with xnnpack's patches exported with the frames dynamic (Dim `frames`, F0 and N
   `2 * frames`, noise `600 * frames`) after three value-preserving rewrites that the export needs
   (SineGen's linear interpolations by output size, not scale factor; the nearest upsamplings by 2
   and 300 as `repeat_interleave`), lowered once to XNNPACK, and run at each `--frames`, each
   against the same exported program run eagerly and against a static (exact-shape) lowering at
   the first length, the control.
3. `--hint N` exports with an N-frame example (default: the first `--frames`). It matters: inside
   the lowering, XNNPACK's Conv1dUnsqueezePass re-traces each conv1d in fake mode, and torch's fake
   convolution asks `torch._C._select_conv_backend`, whose size heuristics (`512*frames <= 20480`
   and the like) become guards decided at the example's size that narrow the program's frames
   range: a 36-frame example leaves [8, 40] (the inputs planned for 40 frames), a max-size one
   leaves [41, max]. Printed as "frames range after lowering".
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
import types
from pathlib import Path

import sympy
import torch
import torch.nn.functional as F
from torch._export.utils import _get_shape_env_from_gm
from torch.export import Dim

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import patches as hp  # noqa: E402
from harness.backends import get_backend  # noqa: E402
from harness.model import load_random  # noqa: E402
from harness.patches import apply_patches  # noqa: E402
from harness.steps import FRAME_UNITS, get_step  # noqa: E402


def derived_dim_round_trip() -> None:
    class Twice(torch.nn.Module):
        def forward(self, x, y):
            return x.repeat_interleave(2, dim=1) + y

    d = Dim("f", min=2, max=64)
    program = torch.export.export(Twice(), (torch.randn(1, 8), torch.randn(1, 16)), dynamic_shapes=({1: d}, {1: 2 * d}))
    program.run_decompositions()
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    loaded = torch.export.load(buf)
    try:
        loaded.run_decompositions()
        print(f"torch {torch.__version__}: a loaded program with a derived dim decomposes")
    except AssertionError as e:
        print(f"torch {torch.__version__}: a loaded program with a derived dim: run_decompositions() "
              f"fails: AssertionError: {e}")
        drop_derived_ranges(loaded)
        loaded.run_decompositions()
        print("  with the derived ranges dropped from its shape environment: it decomposes")


def drop_derived_ranges(program) -> None:
    shape_env = _get_shape_env_from_gm(program.graph_module)
    for key in [k for k in shape_env.var_to_range if not isinstance(k, sympy.Symbol)]:
        del shape_env.var_to_range[key]


def _sine_by_size(self, f0):
    """SineGen.forward as the noise_as_input patch writes it, interpolating to sizes."""
    fn = f0 * torch.arange(1, self.harmonic_num + 2, dtype=torch.float32).reshape(1, 1, -1)
    rad = (fn / self.sampling_rate) % 1
    rand_ini = hp._noise("rand_ini").to(rad.dtype)
    rad = torch.cat([rad[:, :1, :] + rand_ini[:, None, :], rad[:, 1:, :]], dim=1)
    n = rad.shape[1]
    rad = F.interpolate(rad.transpose(1, 2), size=n // self.upsample_scale, mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad, dim=1) * 2 * torch.pi
    phase = F.interpolate(phase.transpose(1, 2) * self.upsample_scale, size=n, mode="linear").transpose(1, 2)
    uv = (f0 > self.voiced_threshold).type(torch.float32)
    noise = (uv * self.noise_std + (1 - uv) * self.sine_amp / 3) * hp._noise("sine_noise").to(phase.dtype)
    return torch.sin(phase) * self.sine_amp * uv + noise, uv, noise


class RepeatUp(torch.nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x.repeat_interleave(self.k, dim=-1)


def rewritten_decoder(patches):
    km = apply_patches(load_random(0).kmodel, patches)
    gen = km.decoder.generator
    gen.m_source.l_sin_gen.forward = types.MethodType(_sine_by_size, gen.m_source.l_sin_gen)
    gen.f0_upsamp = RepeatUp(int(gen.f0_upsamp.scale_factor))
    for m in km.modules():
        if type(m).__name__ == "UpSample1d" and m.layer_type != "none":
            m.forward = types.MethodType(lambda self, x: x.repeat_interleave(2, dim=-1), m)
    return get_step("decoder").module(km)


def decoder_inputs(step, frames: int) -> tuple:
    g = torch.Generator().manual_seed(frames)
    shapes = {"asr": (1, 512, frames), "F0_pred": (1, 2 * frames), "N_pred": (1, 2 * frames), "s_dec": (1, 128),
              "rand_ini": (1, 9), "sine_noise": (1, 600 * frames, 9), "source_noise": (1, 600 * frames, 1)}
    values = {n: torch.randn(*s, generator=g) for n, s in shapes.items()}
    values["F0_pred"] = torch.rand(1, 2 * frames, generator=g) * 300
    values["rand_ini"] = torch.rand(1, 9, generator=g)
    return tuple(values[n] for n in step.input_names)


def lower(program, out: Path) -> tuple[Path, float]:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    start = time.perf_counter()
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    out.write_bytes(edge.to_executorch().buffer)
    return out, time.perf_counter() - start


def planned_range(pte: Path) -> str:
    """The frames the lowered method's first input (`asr`, [1, 512, frames]) is planned for."""
    from executorch.runtime import Runtime

    meta = Runtime.get().load_program(str(pte)).metadata("forward")
    return f"up to {meta.input_tensor_meta(0).sizes()[2]} frames (its planned sizes)"


def rel(got, want) -> float:
    return float((got - want).norm() / want.norm())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, nargs="+", default=[36, 50, 20])
    ap.add_argument("--max-frames", type=int, default=1024)
    ap.add_argument("--hint", type=int, default=None, help="the example's frames (default: the first --frames)")
    args = ap.parse_args()
    derived_dim_round_trip()

    from executorch.runtime import Runtime

    step = get_step("decoder")
    module = rewritten_decoder(get_backend("xnnpack").patches)
    frames = Dim("frames", min=8, max=args.max_frames)
    dims = tuple({ax: frames * FRAME_UNITS[u] for ax, u in t.axes.items()} or None for t in step.inputs)
    first = decoder_inputs(step, args.frames[0])
    hint = decoder_inputs(step, args.hint) if args.hint else first
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        program = torch.export.export(module, hint, dynamic_shapes=dims, strict=False)
        torch.export.save(program, Path(tmp) / "dynamic.pt2")
        loaded = torch.export.load(Path(tmp) / "dynamic.pt2")
        drop_derived_ranges(loaded)
        pte, seconds = lower(loaded, Path(tmp) / "dynamic.pte")
        print(f"example {args.hint or args.frames[0]} frames: frames range after lowering {planned_range(pte)}")
        print(f"dynamic decoder (frames 8..{args.max_frames}) lowered to XNNPACK in {seconds:.1f} s")
        static, s_seconds = lower(torch.export.export(module, first, strict=False), Path(tmp) / "static.pte")
        print(f"static decoder ({args.frames[0]} frames) lowered in {s_seconds:.1f} s: the control")
        method = Runtime.get().load_program(str(pte)).load_method("forward")
        for n in args.frames:
            x = decoder_inputs(step, n)
            want = module(*x)
            try:
                got = method.execute([t.contiguous() for t in x])[0]
                line = f"{n} frames: dynamic XNNPACK vs eager rel. L2 {rel(got, want):.3e}"
            except RuntimeError as e:
                line = f"{n} frames: dynamic XNNPACK fails: {str(e).splitlines()[0]}"
            if n == args.frames[0]:
                control = Runtime.get().load_program(str(static)).load_method("forward")
                ctl = control.execute([t.contiguous() for t in x])[0]
                line += f"; static XNNPACK vs eager {rel(ctl, want):.3e}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
