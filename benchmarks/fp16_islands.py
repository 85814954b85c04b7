"""How the float16 decoder's audio depends on what stays in float32 (issue 15, docs/precision.md).

`python benchmarks/fp16_islands.py [--case en_short] [--step decoder] [--keep A,B ...]`: for each
keep-set (comma-separated module paths; `-` for float16 everywhere), runs the step in emulated
float16 eager with those modules in float32 (`harness.precision.evaluate`, the patches of the `fp16`
backend plus `stft_islands`) and prints its share of the step's parameters and FLOPs, the relative
L2 error, PESQ, MCD and level against float64, and whether it is shippable by the default profile.
Without --keep it runs the ladder below, from the float16 floor to the whole generator.

`--causes` instead computes the step in float32 with one thing rounded to float16: an input of the
step, or the weights (parameters and buffers) of one module, optionally only those whose name
contains a given word (`MODULE:WORD`): which float16 roundings the audio is sensitive to at all.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

G = "decoder.generator"
LADDER = [
    [],
    [f"{G}.m_source.l_sin_gen"],
    [f"{G}.m_source.l_sin_gen", f"{G}.stft.analysis"],
    [f"{G}.f0_upsamp", f"{G}.m_source.l_sin_gen"],
    [f"{G}.f0_upsamp", f"{G}.m_source.l_sin_gen", f"{G}.stft.analysis"],
    [f"{G}.f0_upsamp", f"{G}.m_source", f"{G}.stft.analysis"],
    [f"{G}.f0_upsamp", f"{G}.m_source", f"{G}.stft.analysis", f"{G}.stft.synthesis"],
    [G],
]


CAUSES = ["input:F0_pred", "input:N_pred", "input:asr", "input:s_dec", "weights:decoder",
          "weights:decoder.encode,decoder.decode,decoder.F0_conv,decoder.N_conv,decoder.asr_res",
          f"weights:{G}.ups,{G}.resblocks,{G}.noise_convs,{G}.noise_res,{G}.conv_post,{G}.m_source",
          f"weights:{G}.stft.analysis", f"weights:{G}.stft.analysis:weight_forward_imag",
          f"weights:{G}.stft.analysis:weight_forward_real", f"weights:{G}.stft.synthesis"]


def rounded_float32(target, cause: str):
    """The target's step in float32 eager with `cause` rounded to float16: `input:NAME` or
    `weights:MOD,MOD[:WORD]` (every floating parameter and buffer under the modules, or only those
    whose name contains WORD)."""
    import copy

    import torch

    from harness.precision.float16 import _strip, under
    from harness.reference import as_outputs

    kind, _, what = cause.partition(":")
    module, inputs = target.module, list(target.inputs)
    if cause == "none":
        pass
    elif kind == "input":
        names = [t.name for t in target.step.inputs]
        if what not in names:
            raise ValueError(f"--causes: the step has no input {what!r} (inputs: {names})")
        i = names.index(what)
        inputs[i] = inputs[i].half().float()
    elif kind == "weights":
        mods, _, word = what.partition(":")
        module = copy.deepcopy(module)
        with torch.no_grad():
            for name, t in [*module.named_parameters(), *module.named_buffers()]:
                if t.is_floating_point() and under(_strip(name), mods.split(",")) and word in name.rsplit(".", 1)[-1]:
                    t.copy_(t.half().float())
    else:
        raise ValueError(f"--causes: {cause!r} is neither input:NAME nor weights:MODULES[:WORD]")
    with torch.no_grad():
        return as_outputs(target.step, module(*inputs))


def causes(targets, names) -> list[list]:
    from harness.metrics import fmt
    from harness.metrics.audio import audio_metrics

    rows = []
    for target in targets:
        for cause in ["none", *names]:
            outs = rounded_float32(target, cause)
            for spec in target.step.outputs:
                if "samples" not in spec.axes.values():
                    continue
                o, r = target.valid(spec.name, outs[spec.name]), target.valid(spec.name, target.fp64[spec.name])
                a = audio_metrics(r[0].double().numpy(), o[0].double().numpy())
                rows.append([target.case, cause, fmt(a["pesq"]), fmt(a["mcd_db"]), fmt(a["rms_ratio_db"])])
    return rows


def main() -> int:
    from tabulate import tabulate

    from harness.metrics import fmt
    from harness.model import load_model
    from harness.precision.search import evaluate, share_of, targets_for
    from harness.verdict import Profile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="repeatable (default: en_short)")
    ap.add_argument("--step", default="decoder")
    ap.add_argument("--keep", action="append", help="a keep-set: comma-separated module paths, '-' for none")
    ap.add_argument("--native", action="store_true", help="PyTorch's float16 kernels instead of the emulation")
    ap.add_argument("--profile", default=None, help="tolerance profile (default: harness/tolerances.yaml)")
    ap.add_argument("--causes", nargs="*", metavar="CAUSE",
                    help="float32 with one thing rounded: input:NAME or weights:MOD,MOD[:WORD] "
                         "(no CAUSE: a default list)")
    args = ap.parse_args()
    if args.causes is not None:
        model = load_model(None)
        targets = targets_for(model, args.case or ["en_short"], args.step)
        rows = causes(targets, args.causes or CAUSES)
        imag = dict(targets[0].module.named_buffers()).get(f"kmodel.{G}.stft.analysis.weight_forward_imag")
        if imag is not None:  # why those weights: the DFT entries that are 0 in exact arithmetic
            nz = imag != 0
            print(f"stft.analysis weight_forward_imag: {int((nz & (imag.half() == 0)).sum())} of {int(nz.sum())} "
                  f"nonzero float32 entries are 0 in float16; the Nyquist row's largest |entry| is "
                  f"{float(imag[-1].abs().max()):.1e}")
        print(tabulate(rows, headers=["case", "rounded to float16 (rest float32)", "PESQ", "MCD dB", "level dB"],
                       tablefmt="github"))
        return 0
    sets = LADDER if not args.keep else [[] if k == "-" else k.split(",") for k in args.keep]
    model = load_model(None)
    tol = Profile.load(args.profile).for_(args.step, "fp16", "dynamic")
    rows = []
    for target in targets_for(model, args.case or ["en_short"], args.step):
        for keep in sets:
            e = evaluate(target, keep, tol, emulate=not args.native)
            sh = share_of(target, keep)
            for name, m in e.metrics.items():
                kept = " + ".join(k.removeprefix(f"{G}.") for k in keep) or "(float16 everywhere)"
                rows.append([target.case, kept, f"{sh['params_share']:.2%}",
                             f"{sh.get('flops_share', float('nan')):.2%}", fmt(m["rel_l2"]), fmt(m.get("pesq")),
                             fmt(m.get("mcd_db")), fmt(m.get("rms_ratio_db")), "yes" if e.shippable else "no",
                             e.seconds])
            print(f"{target.case}: {keep or '-'}: {e.why} [{e.seconds} s]", file=sys.stderr, flush=True)
    print(tabulate(rows, headers=["case", f"kept in float32 ({G}.)", "params", "FLOPs", "rel L2", "PESQ", "MCD dB",
                                  "level dB", "shippable", "s"], tablefmt="github"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
