"""How much padding the synthesizer's frame axis changes the audio (no backend: eager PyTorch).

The synthesizer (f0n + text_encoder + decoder, CustomSTFT as ports use it) runs on a case's exact
reference durations, once on the exact frames and once per padded length; the audio's valid
region is compared. Kokoro's synthesizer is not padding-invariant: its InstanceNorms average over
the whole frame axis. Usage: python benchmarks/synth_padding.py [--case en_short] [--pad 1 5 15 55]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from harness.cases import load_cases  # noqa: E402
from harness.e2e import alignment  # noqa: E402
from harness.metrics.audio import audio_metrics  # noqa: E402
from harness.model import SAMPLES_PER_FRAME, load_model  # noqa: E402
from harness.patches import apply_patches  # noqa: E402
from harness.reference import load_traces  # noqa: E402
from harness.steps import get_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="en_short")
    ap.add_argument("--pad", type=int, nargs="+", default=[1, 5, 15, 55])
    ap.add_argument("--with-patch", action="append", default=[])
    args = ap.parse_args()
    model = load_model()
    case = load_cases(only=[args.case])[0]
    traces = load_traces(model, case)
    chain, frames = traces.chain, traces.valid.frames
    km = apply_patches(model.kmodel, ["noise_as_input", "dropout_identity", "custom_stft", *args.with_patch])
    synth = get_step("synthesizer").module(km)
    pred = torch.tensor(traces.pred_dur)

    def run(total: int) -> torch.Tensor:
        n = total * SAMPLES_PER_FRAME
        inputs = [chain["d"], alignment(pred, chain["d"].shape[1], total), chain["input_ids"], chain["input_lengths"],
                  chain["text_mask"], chain["s_pred"], chain["s_dec"], torch.tensor([frames]),
                  chain["case_rand_ini"], chain["case_sine_noise"][:, :n].contiguous(),
                  chain["case_source_noise"][:, :n].contiguous()]
        with torch.no_grad():
            return synth(*inputs)[0, : frames * SAMPLES_PER_FRAME]

    exact = run(frames)
    rows = []
    for pad in args.pad:
        audio = run(frames + pad)
        a = audio_metrics(exact.numpy(), audio.numpy())
        rows.append([frames, pad, float((audio - exact).norm() / exact.norm()), a["pesq"], a["mcd_db"], a["logmel_corr"]])
    print(f"case {case.id}: synthesizer on {frames} frames (exact durations), padded; patches: "
          f"{', '.join(['custom_stft', *args.with_patch])}")
    print(tabulate(rows, headers=["frames", "padding", "rel_l2", "pesq", "mcd_db", "logmel_corr"], floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
