"""What judging a port chain costs beyond running its artifacts alone (issue 21: at most 1.10 warm).

Exports the 3-stage split (harness/port/splits.py: duration | alignment on the host | prosody |
decoder) of the random model (`random:0`) on the short `tiny` case (or `--weights default --case ja`:
the default model on a shipped case) to ONNX, in a child process with
a cache of its own, so that the harness's cache starts empty. Then, in this process:

- harness, cold: a Session on that empty cache runs the port item (`harness.port.chain.run_port_item`:
  the references, each artifact copied into the cache, each stage run locally and chained in child
  processes, judged stage by stage);
- harness, warm: a new Session on the cache the cold run left (references cached) runs it again;
- alone: a script that imports only numpy and onnxruntime runs the same artifacts on the very
  inputs the warm item fed them (the item's `inputs.npz`/`.pt`, the same number of artifact runs: local
  and chained), loading each ONNX once and running it, as a porter's one-off script does; its first
  process (cold) and the median of `--repeat` more (warm), whole processes with Python's start;
  and once more with one such process per artifact run (the isolation the harness had before its
  warm worker, harness.plumbing.worker).

The model is loaded before each timed item (a pytest session loads it once, not per item) and
reported beside them. Prints harness / alone, cold and warm, against the target.

    nice -n 19 .venv/bin/python benchmarks/chain_overhead.py [--repeat 5] [--profile out.pstats] [--keep DIR]
    nice -n 19 .venv/bin/python benchmarks/chain_overhead.py --chain DIR/chain/port.yaml   # reuse --keep DIR's export
    nice -n 19 .venv/bin/python benchmarks/chain_overhead.py --weights default --case ja --repeat 3
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TARGET = 1.10  # issue 21: the chain's overhead against running the artifacts alone, warm
SPLIT = "kokoro-3stage"
NP_TYPES = {"tensor(float16)": "float16", "tensor(int32)": "int32", "tensor(float)": "float32",  # declared -> numpy
            "tensor(int64)": "int64", "tensor(bool)": "bool", "tensor(double)": "float64"}


def alone(plan_path: str) -> None:
    """`--alone PLAN`: the artifacts alone (numpy and onnxruntime only), one line of JSON out."""
    start = time.perf_counter()
    import numpy as np
    import onnxruntime as ort

    imported = time.perf_counter()
    plan = json.loads(Path(plan_path).read_text())
    outputs, sessions = 0, {}
    for run in plan["runs"]:
        if run["onnx"] not in sessions:  # each artifact loaded once, as a porter's script does
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = 1  # as the harness's run (harness.backends.onnx_child)
            sessions[run["onnx"]] = ort.InferenceSession(run["onnx"], opts, providers=["CPUExecutionProvider"])
        sess = sessions[run["onnx"]]
        data = np.load(run["inputs"])
        feed = {p.name: np.ascontiguousarray(data[f"arr_{i}"].astype(NP_TYPES.get(p.type, data[f"arr_{i}"].dtype)))
                for i, p in enumerate(sess.get_inputs())}
        outputs += len(sess.run(None, feed))
    end = time.perf_counter()
    print(json.dumps({"import_s": imported - start, "load_and_run_s": end - imported, "runs": len(plan["runs"]),
                      "outputs": outputs}))


def export_chain(tmp: Path, case: str, weights: str | None) -> Path:
    """The split exported by its example's own command, on a cache that the timed runs never see."""
    env = {**os.environ, "KOKORO_PARITY_CACHE": str(tmp / "export-cache"), "KOKORO_PARITY_CASES": str(tmp / "cases")}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / SPLIT / "export.py"), "--case", case,
                        *(["--weights", weights] if weights else []), "--out", str(tmp / "chain")], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"exporting the {SPLIT} split failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return tmp / "chain" / "port.yaml"


def harness_item(tmp: Path, port: Path, case: str, weights: str | None, label: str, profile=None) -> dict:
    """One port item on a fresh Session (its model loaded first, outside the timing)."""
    from harness.plumbing.worker import stop_worker
    from harness.port.chain import port_items, run_port_item
    from harness.runner import Session

    stop_worker()  # a new session's worker, as a new pytest run has: no ONNX session loaded before

    session = Session(weights=weights, case_ids=[case], report_dir=tmp / "reports" / label,
                      cases_dirs=(str(tmp / "cases"),))
    t0 = time.perf_counter()
    session.model  # noqa: B018 - loaded once per session, as in a pytest run
    model_s = time.perf_counter() - t0
    (item,) = port_items(session, [str(port)])
    if profile is not None:
        profile.enable()
    t0 = time.perf_counter()
    rec = run_port_item(session, item)
    wall = time.perf_counter() - t0
    session.close()
    if profile is not None:
        profile.disable()
    if rec.verdict.value not in ("pass", "fail"):
        raise SystemExit(f"{label} item: {rec.verdict.value}: {rec.reason}")
    job_s = sum(v for k, v in rec.timings.items() if k.endswith("run_job_s"))
    run_s = sum(v for k, v in rec.timings.items() if k.endswith("run_s") and not k.endswith("job_s"))
    return {"item_s": wall, "model_load_s": model_s, "verdict": rec.verdict.value, "item": item.id,
            "run_jobs_s": job_s, "runtime_s": run_s, "artifact_runs": sum(k.endswith("run_job_s") for k in rec.timings),
            "counts": dict(session.counts), "report_dir": str(session.report_dir)}


def alone_plan(tmp: Path, port: Path, warm: dict) -> Path:
    """The warm item's artifact runs (its saved inputs, in the order it fed them) as numpy files."""
    import numpy as np
    import torch

    from harness.plumbing.files import load_arrays
    from harness.port.portfile import load_port

    runs = []
    spec = load_port(port)
    for stage in spec.stages:
        for role in ("local", "chained"):
            run_dir = Path(warm["report_dir"]) / "runs" / warm["item"] / f"{stage.name}-{role}"
            if (run_dir / "inputs.npz").is_file():  # an ONNX run's torch-free inputs (harness.backends.onnx_child)
                arrays = load_arrays(run_dir / "inputs.npz")
            elif (run_dir / "inputs.pt").is_file():
                arrays = [t.numpy() for t in torch.load(run_dir / "inputs.pt", weights_only=True)]
            else:
                continue  # the first stage's chained run is its local one
            npz = tmp / "alone" / f"{stage.name}-{role}.npz"
            npz.parent.mkdir(parents=True, exist_ok=True)
            np.savez(npz, *arrays)
            runs.append({"onnx": str(stage.file_for(spec.root, None)), "inputs": str(npz)})
    plan = tmp / "alone" / "plan.json"
    plan.write_text(json.dumps({"runs": runs}))
    return plan


def single_run_plans(plan: Path) -> list[Path]:
    """The plan cut into one plan per artifact run."""
    runs = json.loads(plan.read_text())["runs"]
    out = []
    for i, run in enumerate(runs):
        out.append(plan.with_name(f"plan-{i}.json"))
        out[-1].write_text(json.dumps({"runs": [run]}))
    return out


def run_alone(plan: Path) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--alone", str(plan)],
                       capture_output=True, text=True, check=True)
    return {"process_s": time.perf_counter() - t0, **json.loads(r.stdout.strip().splitlines()[-1])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5, help="warm runs of the artifacts alone (median)")
    ap.add_argument("--profile", type=Path, help="write a cProfile of the warm item here (pstats)")
    ap.add_argument("--keep", type=Path, help="keep the work directory here")
    ap.add_argument("--chain", type=Path, help="reuse the port file of an earlier --keep run (DIR/chain/port.yaml) "
                                               "instead of exporting the split again")
    ap.add_argument("--weights", default="random:0", help="`default` for the default model (then give --case ja)")
    ap.add_argument("--case", default="tiny", help="tiny (8 tokens, written here) or a shipped case")
    ap.add_argument("--alone", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.alone:
        alone(args.alone)
        return 0
    sys.path.insert(0, str(ROOT))
    from tabulate import tabulate

    from harness.cases import write_case

    case, weights = args.case, None if args.weights == "default" else args.weights
    tmp = Path(tempfile.mkdtemp(prefix="kp-chain-bench-"))
    load = os.getloadavg()
    try:
        # the unit tests' tiny case: 8 tokens, speed 4 (few frames)
        write_case(tmp / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
        t0 = time.perf_counter()
        if args.chain:  # an earlier export of this benchmark (--keep DIR: DIR/chain/port.yaml)
            shutil.copytree(args.chain.parent, tmp / "chain")
            port = tmp / "chain" / args.chain.name
        else:
            port = export_chain(tmp, case, weights)
        export_s = time.perf_counter() - t0
        os.environ["KOKORO_PARITY_CACHE"] = str(tmp / "cache")  # empty: the cold item computes the references
        cold = harness_item(tmp, port, case, weights, "cold")
        profile = None
        if args.profile:
            import cProfile

            profile = cProfile.Profile()
        warm = harness_item(tmp, port, case, weights, "warm", profile)
        if profile is not None:
            profile.dump_stats(str(args.profile))
        plan = alone_plan(tmp, port, warm)
        alone_cold = run_alone(plan)
        alone_warm = [run_alone(plan) for _ in range(max(args.repeat, 1))]
        # the harness's isolation (a process per artifact run) without its torch: what it could cost
        isolated = [sum(run_alone(one)["process_s"] for one in single_run_plans(plan)) for _ in range(3)]
    finally:
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    warm_alone_s = statistics.median(a["process_s"] for a in alone_warm)
    warm_inproc_s = statistics.median(a["load_and_run_s"] for a in alone_warm)
    if alone_cold["runs"] != warm["artifact_runs"]:
        raise SystemExit(f"alone ran {alone_cold['runs']} artifacts, the item {warm['artifact_runs']}")
    ratio_cold, ratio_warm = cold["item_s"] / alone_cold["process_s"], warm["item_s"] / warm_alone_s
    print(f"{SPLIT} of {args.weights} on the {case} case ({warm['artifact_runs']} artifact runs: local + chained); "
          f"export {export_s:.1f} s{' (reused)' if args.chain else ''}; load average before {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
          f"after {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(tabulate([
        ["harness: port item, cold (empty cache: references, artifact copies)", f"{cold['item_s']:.2f} s",
         f"model load {cold['model_load_s']:.1f} s (not in the item); run jobs {cold['run_jobs_s']:.2f} s"],
        ["harness: port item, warm (references cached)", f"{warm['item_s']:.2f} s",
         f"model load {warm['model_load_s']:.1f} s (not in the item); run jobs {warm['run_jobs_s']:.2f} s, "
         f"of which the runtime {warm['runtime_s']:.3f} s"],
        ["alone: numpy + onnxruntime, first process", f"{alone_cold['process_s']:.2f} s",
         f"imports {alone_cold['import_s']:.2f} s, load + run {alone_cold['load_and_run_s']:.3f} s"],
        [f"alone: median of {len(alone_warm)} more processes", f"{warm_alone_s:.2f} s",
         f"load + run {warm_inproc_s:.3f} s"],
        ["harness / alone, cold", f"{ratio_cold:.2f}", ""],
        ["harness / alone, warm", f"{ratio_warm:.2f}", f"target <= {TARGET:.2f}: {'met' if ratio_warm <= TARGET else 'missed'}"],
    ], headers=["", "wall", ""]))
    print(f"where the warm item's {warm['item_s']:.1f} s go: {warm['artifact_runs']} run jobs {warm['run_jobs_s']:.1f} s "
          f"(the runtime's load + run {warm['runtime_s']:.1f} s, the rest the child's start, imports and tensor files); "
          f"the rest of the item {warm['item_s'] - warm['run_jobs_s']:.1f} s (judging, hashing, files)")
    print(f"alone, one process per artifact run (the harness's isolation before its warm worker): median of {len(isolated)} "
          f"{statistics.median(isolated):.2f} s; harness / that {warm['item_s'] / statistics.median(isolated):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
