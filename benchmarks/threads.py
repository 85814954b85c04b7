"""Torch's thread pool when several processes share the cores: one float64 decoder forward pass of
the random model (60 frames, three times) in `--processes` processes at once, each with
OMP_NUM_THREADS set to each of `--threads`; the wall time of each.

Why: the test suite runs two xdist workers on two cores, each with job children, and each torch
process starts a pool of one thread per core. The tests' conftest sets one thread per process
from this measurement (docs/performance.md).

    python benchmarks/threads.py --processes 2 --threads 2 1
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CHILD = """
import copy, time, torch
from harness.model import load_random
km = load_random(0).kmodel.eval()
dec = copy.deepcopy(km.decoder).double()
g = torch.Generator().manual_seed(0)
asr = torch.randn(1, 512, 60, generator=g, dtype=torch.float64)
f0 = 150 + 50 * torch.rand(1, 120, generator=g, dtype=torch.float64)
n = torch.randn(1, 120, generator=g, dtype=torch.float64)
s = torch.randn(1, 128, generator=g, dtype=torch.float64)
start = time.perf_counter()
with torch.no_grad():
    for _ in range(3):
        dec(asr, f0, n, s)
print(f"{time.perf_counter() - start:.1f}")
"""


def run(processes: int, threads: int) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    children = [subprocess.Popen([sys.executable, "-c", CHILD], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True) for _ in range(processes)]
    return [float(c.communicate()[0].strip().splitlines()[-1]) for c in children]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}, load average: {os.getloadavg()[0]:.1f}")
    for threads in args.threads:
        start = time.perf_counter()
        times = run(args.processes, threads)
        print(f"{args.processes} processes x {threads} thread(s): forward passes {', '.join(f'{t:.1f}' for t in times)} s "
              f"(wall {time.perf_counter() - start:.1f} s with start-up)")


if __name__ == "__main__":
    main()
