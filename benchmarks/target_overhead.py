"""What running an item's job on an SSH target costs beyond running it here.

Starts a throwaway sshd on 127.0.0.1 and a separate target virtualenv (tests/unit/sshd_helper.py),
exports a small torch program (an MLP; `--width`, `--layers` set its size), and runs the eager
backend's run job on it N times here (`jobs.run_job`) and N times on the target
(`SshTarget.run_job`): the first remote run ships the artifact and the harness source, the others
find them in the target's cache. Prints median wall times per job and the difference: the
transport overhead per item (ssh, tar streams, the remote Python's start), which on a real network
adds its round trips.

    .venv/bin/python benchmarks/target_overhead.py [--runs 10] [--width 1024] [--layers 8]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-multiplex", action="store_true", help="one SSH connection per command")
    args = ap.parse_args()

    import torch
    import yaml

    from harness.plumbing.files import save_tensors
    from harness.plumbing.jobs import run_job
    from harness.plumbing.targets import get_target
    from sshd_helper import have_openssh, start_sshd, target_venv

    ok, why = have_openssh()
    if not ok:
        print(f"skipped: {why}")
        return 0
    with tempfile.TemporaryDirectory(prefix="kp-target-bench-") as tmp:
        tmp = Path(tmp)
        layers = []
        for _ in range(args.layers):
            layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).eval()
        x = torch.randn(1, 64, args.width)
        entry = tmp / "artifact"
        entry.mkdir()
        torch.export.save(torch.export.export(model, (x,)), str(entry / "program.pt2"))
        mb = (entry / "program.pt2").stat().st_size / 2**20
        sshd = start_sshd(tmp / "sshd")
        python = target_venv(tmp / "venv", ["torch", "numpy"])
        (tmp / "targets.yaml").write_text(yaml.safe_dump({"targets": {"bench": sshd.target(
            python, tmp / "remote", multiplex=not args.no_multiplex)}}))
        target = get_target("bench", tmp / "targets.yaml")
        try:
            def job(i: int, remote: bool):
                run = tmp / ("remote-runs" if remote else "runs") / str(i)
                save_tensors(run / "inputs.pt", {"x": x})
                kwargs = dict(backend="eager", artifact_path=str(entry / "program.pt2"),
                              inputs_path=str(run / "inputs.pt"), outputs_path=str(run / "outputs.pt"))
                start = time.perf_counter()
                if remote:
                    r = target.run_job("harness.backends:run_artifact_job", kwargs, run, 300,
                                       files=dict(artifact_path="artifact_entry", inputs_path="input",
                                                  outputs_path="output"))
                else:
                    r = run_job("harness.backends:run_artifact_job", kwargs, run, 300)
                wall = time.perf_counter() - start
                if not r.ok:
                    raise SystemExit(f"{'remote' if remote else 'local'} run {i}: {r.status} {r.error}\n{r.log_tail}")
                return wall, r

            t0 = time.perf_counter()
            target.describe()  # the probe: first connection, the harness shipped
            probe_s = time.perf_counter() - t0
            first_wall, first = job(0, True)
            local = [job(i, False)[0] for i in range(args.runs)]
            remote = [job(i, True) for i in range(1, args.runs + 1)]
            same = torch.equal(torch.load(tmp / "runs" / "0" / "outputs.pt")[0],
                               torch.load(tmp / "remote-runs" / "1" / "outputs.pt")[0])
        finally:
            target.close()
            sshd.stop()
    rw = [w for w, _ in remote]
    med_l, med_r = statistics.median(local), statistics.median(rw)
    print(f"artifact {mb:.1f} MiB (MLP {args.layers}x{args.width}), input 1x64x{args.width}, {args.runs} runs each, "
          f"target: sshd on 127.0.0.1, {'one connection per command' if args.no_multiplex else 'multiplexed'}")
    print(f"target probe (first connection, harness source shipped): {probe_s:.2f} s")
    print(f"first remote job (artifact shipped, {first.extra['upload_bytes'] / 2**20:.1f} MiB): {first_wall:.2f} s")
    print(f"local job  median {med_l:.3f} s (min {min(local):.3f}, max {max(local):.3f})")
    print(f"remote job median {med_r:.3f} s (min {min(rw):.3f}, max {max(rw):.3f}); "
          f"transport_s median {statistics.median(r.extra['transport_s'] for _, r in remote):.3f} s")
    print(f"overhead per item: {med_r - med_l:+.3f} s ({med_r / med_l:.2f}x); outputs identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
