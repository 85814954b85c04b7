"""How a backend's run time of an audio step grows with the audio: the points of its `run_time`
cost law (harness.backends.cost).

Run time depends on shapes, not on weights, so this runs the harness's own static items on the
seeded random model: a one-word case whose vocoder bucket is FRAMES frames (FRAMES x 600 samples
of audio), one item per bucket, through `Session.run` (export, compile, run in child processes,
its own cache in a temporary directory). Per row: the bucket, its seconds of audio, compile and
run seconds, the real-time factor, and the power law fit through the rows. Items run one at a time.

    .venv/bin/python benchmarks/run_cost.py --backend portable --frames 48 --frames 96 --frames 144
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def measure(backend: str, step: str, frames_list: list[int]) -> list[dict]:
    from harness.backends.cost import AUDIO_SECONDS
    from harness.cases import load_cases, write_case
    from harness.plumbing.cache import CACHE_ENV
    from harness.runner import Item, Limits, Session

    rows = []
    with tempfile.TemporaryDirectory(prefix="run-cost-") as tmp:
        root = Path(tmp)
        os.environ[CACHE_ENV] = str(root / "cache")
        for frames in frames_list:
            case_id = f"word{frames}"
            write_case(root / "cases", case_id, "Hi.", "en-us", "jf_alpha", 8, frames, speed=4.0)
        session = Session(weights="random:0", case_ids=[f"word{f}" for f in frames_list],
                          report_dir=root / "reports", limits=Limits(run_s=3600))
        session._cases = {c.id: c for c in load_cases(root / "cases")}
        for frames in frames_list:
            rec = session.run(Item(f"word{frames}", step, backend, "static"))
            audio_s = frames * 600 / 24000
            run_s = rec.timings.get("run_s")
            rows.append({"frames": frames, AUDIO_SECONDS: audio_s, "verdict": rec.verdict.value,
                         "compile_s": rec.timings.get("compile_s"), "run_s": run_s,
                         "rtf": run_s / audio_s if run_s else None})
            print(rows[-1], flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="portable")
    ap.add_argument("--step", default="decoder", choices=("decoder", "generator"))
    ap.add_argument("--frames", type=int, action="append", help="vocoder buckets (default: 48 96 144)")
    args = ap.parse_args()
    from harness.backends.cost import AUDIO_SECONDS, CostLaw

    rows = measure(args.backend, args.step, args.frames or [48, 96, 144])
    print(f"\n| backend | step | frames | {AUDIO_SECONDS} | compile s | run s | real-time factor |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {args.backend} | {args.step} | {r['frames']} | {r[AUDIO_SECONDS]:.1f} | {r['compile_s'] or 0:.0f} | "
              f"{r['run_s'] or 0:.1f} | {r['rtf'] or 0:.0f} |")
    points = tuple((r[AUDIO_SECONDS], r["run_s"]) for r in rows if r["run_s"])
    if len(points) >= 2:
        law = CostLaw(AUDIO_SECONDS, "s", points)
        print(f"\nrun time {law.describe()}")
        for audio_s in (4.75, 9.6, 26.95, 38.4):  # ja dynamic, ja static, en_long dynamic and static
            print(f"  {audio_s:5.2f} s of audio: about {law.estimate(audio_s):,.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
