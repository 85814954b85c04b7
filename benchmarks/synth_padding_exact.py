"""How close the length-aware synthesizer on a padded frame bucket comes to Kokoro on the exact frames,
and what each of its vocoder-edge fixes is worth (no backend: eager PyTorch).

Per case and padding: the synthesizer (f0n + text_encoder + decoder) on the case's reference
durations, padded by `pad` frames, against Kokoro's dynamic synthesizer on the exact frames, on the
valid audio. Rows: without `length_aware_norm` (length-aware LSTMs only), with it, and with it but
one part switched off (`-part`), which names the ops the parts exist for. `floor` is Kokoro's own
fp32-vs-fp64 difference on the exact frames. With --dtype float64 both sides run in float64, which
separates a semantic difference from fp32 rounding that the vocoder amplifies.
Usage: python benchmarks/synth_padding_exact.py [--case en_short] [--pad 1 5 15 55] [--stft torch custom]
       [--dtype float64] [--only "+length_aware_norm" "+length_aware_norm -istft_envelope"]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

from harness import length_aware_norm as lan  # noqa: E402
from harness.cases import load_cases  # noqa: E402
from harness.e2e import alignment  # noqa: E402
from harness.metrics.audio import audio_metrics  # noqa: E402
from harness.model import SAMPLES_PER_FRAME, load_model  # noqa: E402
from harness.patches import apply_patches, to_float64  # noqa: E402
from harness.reference import load_traces  # noqa: E402
from harness.steps import get_step  # noqa: E402

# Each part of the patch, switched off by making it the identity.
ABLATIONS = {
    "-zeros": ("zero_after", lambda x, lengths: x),  # no conv reads zeros past the length
    "-sine_edge": ("sine_phase_edge_like_exact", lambda f0, lengths: f0),
    "-stft_edge": ("stft_edge_like_exact", lambda stft, signal, lengths: signal),
    "-istft_envelope": ("istft_envelope_like_exact", lambda stft, audio, lengths: audio),
}


@contextlib.contextmanager
def ablated(name: str | None):
    if name is None:
        yield
        return
    attr, replacement = ABLATIONS[name]
    original = getattr(lan, attr)
    setattr(lan, attr, replacement)
    try:
        yield
    finally:
        setattr(lan, attr, original)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="en_short")
    ap.add_argument("--pad", type=int, nargs="+", default=[1, 5, 15, 55])
    ap.add_argument("--stft", nargs="+", choices=("torch", "custom"), default=["torch", "custom"])
    ap.add_argument("--no-ablations", action="store_true")
    ap.add_argument("--only", nargs="+", help="run only these static variants (labels as printed)")
    ap.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    args = ap.parse_args()
    model = load_model()
    case = load_cases(only=[args.case])[0]
    traces = load_traces(model, case)
    chain, frames = traces.chain, traces.valid.frames
    pred = torch.tensor(traces.pred_dur)
    step = get_step("synthesizer")
    n_valid = frames * SAMPLES_PER_FRAME

    dtype = getattr(torch, args.dtype)

    def prepare(km):
        return to_float64(copy.deepcopy(km)) if dtype == torch.float64 else km

    def run(km, total: int, dtype=dtype) -> torch.Tensor:
        n = total * SAMPLES_PER_FRAME
        inputs = [chain["d"], alignment(pred, chain["d"].shape[1], total), chain["input_ids"], chain["input_lengths"],
                  chain["text_mask"], chain["s_pred"], chain["s_dec"], torch.tensor([frames]),
                  chain["case_rand_ini"], chain["case_sine_noise"][:, :n].contiguous(),
                  chain["case_source_noise"][:, :n].contiguous()]
        inputs = [t.to(dtype) if t.is_floating_point() else t for t in inputs]
        with torch.no_grad():
            return step.module(km)(*inputs)[0, :n_valid]

    rows = []
    for stft in args.stft:
        extra = ["custom_stft"] if stft == "custom" else []
        kokoro = apply_patches(model.kmodel, ["noise_as_input", "dropout_identity", *extra])
        exact32, exact64 = run(kokoro, frames, torch.float32), run(to_float64(copy.deepcopy(kokoro)), frames, torch.float64)
        floor = float((exact32.double() - exact64).norm() / exact64.norm())
        exact = exact64 if dtype == torch.float64 else exact32
        static = ["noise_as_input", "dropout_identity", "no_packing", "length_aware_lstm", *extra]
        variants = {"length_aware_lstm": (prepare(apply_patches(model.kmodel, static)), None)}
        patched = prepare(apply_patches(model.kmodel, [*static, "length_aware_norm"]))
        variants["+length_aware_norm"] = (patched, None)
        if not args.no_ablations:
            variants.update({f"+length_aware_norm {a}": (patched, a) for a in ABLATIONS})
        if args.only:
            variants = {k: v for k, v in variants.items() if k in args.only}
        for pad in args.pad:
            for label, (km, ablation) in variants.items():
                with ablated(ablation):
                    audio = run(km, frames + pad)
                err = (audio - exact).abs()
                a = audio_metrics(exact.float().numpy(), audio.float().numpy())
                rows.append([stft, args.dtype, frames, pad, label, float(err.norm() / exact.norm()), floor, float(err.max()),
                             n_valid - int(err.argmax()), a["pesq"], a["mcd_db"]])
    print(f"case {case.id}: synthesizer on {frames} frames (reference durations) padded vs Kokoro on the exact frames")
    print(tabulate(rows, headers=["stft", "dtype", "frames", "pad", "static variant", "rel_l2", "floor_rel_l2", "max_abs",
                                  "worst_from_end", "pesq", "mcd_db"], floatfmt=".3g"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
