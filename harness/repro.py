"""The standalone repro bundle: the minimal failing subgraph, its inputs, the float64 expected
output and one Python file that runs it on the backend without Kokoro or this harness.

Like torch's accuracy minifier: `repro.py` computes PyTorch float32's own error (the floor) on the
user's machine and exits 1 while the backend's error is beyond the rule, 0 once it matches, and 2
when it cannot run here (a backend without a standalone runner, Core ML off macOS). The backend's
part of `repro.py` is the backend's own `repro_source()`, so adding a backend touches one module.
"""
from __future__ import annotations

import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from .bisect.graph import evaluate, module_path, source_line
from .metrics import fmt as _fmt
from .plumbing import cache
from .plumbing.bundle import bundle_info, write_bundle_dir

CANNOT_RUN_HERE = 2  # repro.py's exit code when the backend cannot run on this machine


def render_repro(backend, summary: str, node: str, floor_multiplier: float, rel_l2: float) -> str:
    """The text of repro.py for `backend`; one that exits 2 and says what is missing when the
    backend gives no standalone runner (`Backend.repro_source`)."""
    runner = backend.repro_source()
    if runner is None:
        return _NO_RUNNER.format(backend=backend.name, cls=type(backend).__module__ + "." + type(backend).__qualname__,
                                 code=CANNOT_RUN_HERE)
    return _REPRO.format(summary=summary, backend=backend.name, runner=runner, floor_multiplier=floor_multiplier,
                         rel_l2=rel_l2, node=node, code=CANNOT_RUN_HERE)


_REPRO = '''#!/usr/bin/env python3
"""Repro: {summary}

Runs the minimal failing subgraph (program.pt2, a torch.export ExportedProgram) on inputs.pt in
PyTorch and on {backend}, compares both with the float64 expected output (expected.pt), and
exits 1 while the backend's error is beyond {floor_multiplier:g} x PyTorch float32's own error and
beyond a relative L2 of {rel_l2:g}, or has NaN/Inf; {code} when the backend's package is missing here.
Needs only torch, numpy and the backend's package.
"""
import math
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
FLOOR_MULTIPLIER = {floor_multiplier!r}
REL_L2_TOLERANCE = {rel_l2!r}
NODE = {node!r}


{runner}

def metrics(candidate, reference):
    c = candidate.detach().double().numpy()
    r = reference.detach().double().numpy()
    out = {{"nan_rate": float(np.isnan(c).mean()) if c.size else 0.0,
           "nonfinite": int((~np.isfinite(c) & np.isfinite(r)).sum())}}
    if out["nonfinite"]:
        return dict(out, rel_l2=math.nan, max_abs=math.nan, cosine=math.nan)
    diff = c - r
    ref_norm = float(np.linalg.norm(r))
    out["rel_l2"] = float(np.linalg.norm(diff)) / ref_norm if ref_norm else float(np.linalg.norm(diff))
    out["max_abs"] = float(np.abs(diff).max()) if diff.size else 0.0
    denom = float(np.linalg.norm(c)) * ref_norm
    out["cosine"] = float((c.ravel() @ r.ravel()) / denom) if denom else 1.0
    return out


def main():
    program = torch.export.load(str(HERE / "program.pt2"))
    inputs = torch.load(HERE / "inputs.pt", weights_only=True)
    expected = torch.load(HERE / "expected.pt", weights_only=True)["float64"]
    with torch.no_grad():
        ours = program.module()(*[t.clone() for t in inputs])
    ours = list(ours) if isinstance(ours, (tuple, list)) else [ours]
    print(f"torch {{torch.__version__}}; node {{NODE}}; inputs " +
          ", ".join(f"{{tuple(t.shape)}} {{t.dtype}}" for t in inputs))
    try:
        theirs = run_backend(program, [t.clone() for t in inputs])
    except ImportError as e:  # the backend's package is not installed here: neither reproduced nor fixed
        print(f"{backend}: cannot run here: {{type(e).__name__}}: {{e}}")
        return {code}
    except Exception as e:  # a backend that raises reproduces the bug too
        print(f"{backend}: raised {{type(e).__name__}}: {{e}}")
        return 1
    bad = False
    print(f"{{'output':8s}} {{'rel_l2':>10s}} {{'fp32 floor':>10s}} {{'ratio':>8s}} {{'max_abs':>10s}} "
          f"{{'cosine':>10s}} {{'NaN rate':>8s}}")
    for i, (ref, o32, got) in enumerate(zip(expected, ours, theirs)):
        got = torch.as_tensor(got)
        if tuple(got.shape) != tuple(ref.shape):
            print(f"out{{i}}: shape {{tuple(got.shape)}} != expected {{tuple(ref.shape)}}")
            bad = True
            continue
        m, floor = metrics(got, ref), metrics(o32, ref)["rel_l2"]
        ratio = m["rel_l2"] / floor if floor else (1.0 if m["rel_l2"] == 0 else math.inf)
        fails = bool(m["nonfinite"]) or math.isnan(m["rel_l2"]) or (
            m["rel_l2"] > REL_L2_TOLERANCE and m["rel_l2"] > FLOOR_MULTIPLIER * floor)
        bad |= fails
        print(f"out{{i:<5d}} {{m['rel_l2']:10.3e}} {{floor:10.3e}} {{ratio:8.3g}} {{m['max_abs']:10.3e}} "
              f"{{m['cosine']:10.6f}} {{m['nan_rate']:8.2%}}  {{'FAIL' if fails else 'ok'}}")
    print("REPRODUCED: {backend} diverges from PyTorch" if bad else "not reproduced: {backend} matches PyTorch")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
'''

_NO_RUNNER = """#!/usr/bin/env python3
\"\"\"No standalone runner for backend {backend!r}: its class ({cls}) defines no `repro_source()`.

program.pt2 (torch.export.save), inputs.pt and expected.pt hold the failing subgraph and its data:
compile program.pt2 with the backend's own tools and compare its outputs with expected.pt["float64"].
Exit code {code}: cannot run here (neither "reproduced", 1, nor "fixed", 0).
\"\"\"
import sys

print("repro.py: backend {backend!r} gives no standalone runner; install its package and add "
      "`repro_source()` to {cls} (docs/backend-contract.md)")
sys.exit({code})
"""


def run_repro(bundle: Path, timeout: float = 1200) -> dict:
    """Run repro.py alone: a fresh interpreter, its own directory, no PYTHONPATH (so neither this
    harness nor kokoro can be imported from the tree). Exit 1 = the bug reproduces."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    start = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "repro.py"], cwd=bundle, env=env, capture_output=True, text=True,
                           timeout=timeout)
        code, text = p.returncode, (p.stdout + p.stderr)
    except subprocess.TimeoutExpired:
        code, text = None, f"no result after {timeout:.0f} s"
    return {"exit_code": code, "reproduces": code == 1, "repro_s": round(time.monotonic() - start, 1),
            "repro_output": "\n".join(text.strip().splitlines()[-8:])}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _env_md(backend) -> str:
    rows = [("Python", platform.python_version()), ("OS", platform.platform()),
            ("CPU", f"{_cpu()} ({os.cpu_count()} logical cores)")]
    for pkg in ("torch", "numpy", "executorch", "onnxruntime", "onnx", "onnxscript", "apache-tvm", "coremltools"):
        try:
            rows.append((pkg, md.version(pkg)))
        except md.PackageNotFoundError:
            pass
    rows.append((f"backend `{backend.name}`", backend.version()))
    return "# Environment\n\n| what | version |\n| --- | --- |\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


def _report_md(f: dict) -> str:
    rows = "".join(f"| {name} | {_fmt(m.get('rel_l2'))} | {_fmt(m.get('floor_rel_l2'))} | {_fmt(m.get('floor_ratio'))} "
                   f"| {_fmt(m.get('max_abs'))} | {_fmt(m.get('cosine'))} | {_fmt(m.get('nan_rate'))} |\n"
                   for name, m in f["metrics"].items())
    inputs = "".join(f"- `{n}`: {list(s)} {d}\n" for n, s, d in f["inputs"])
    kind = ("**local**: the op alone, fed exact (PyTorch float32) inputs, already diverges" if f["kind"] == "local"
            else "**accumulated**: the op alone passes; the error builds up over the "
                 f"{f['n_ops']} ops of this subgraph until it passes the tolerance at this op")
    tol = f["tol"]
    return f"""# {f['summary']}

**Summary.** On `{f['backend']}` ({f['version']}), the subgraph in `program.pt2` ({f['n_ops']} op{'s' if f['n_ops'] != 1 else ''}, ending in
`{f['op']}`) does not match PyTorch: {f['actual']}.

## Expected vs actual
- **Expected:** the float64 result of the same program on the same inputs (`expected.pt`), within
  {tol.floor_multiplier:g} x the error PyTorch float32 itself makes (its noise floor), or within a relative L2 of {tol.rel_l2:g}.
- **Actual:** {f['actual']}.

| output | rel_l2 vs fp64 | PyTorch fp32 rel_l2 (floor) | ratio | max_abs | cosine | NaN rate |
| --- | --- | --- | --- | --- | --- | --- |
{rows}
Verdict detail: {f['why'] or f['status']}

## The op
- graph node `{f['node']}`: `{f['op']}`, {kind}
- module: `{f['module']}` (Kokoro-82M, item `{f['item']}`)
- source: `{f['source']}`

Inputs of the subgraph:
{inputs}
<details><summary>stack trace recorded by torch.export</summary>

```
{f['stack']}
```
</details>

## How to run
```
pip install torch numpy   # plus the backend's package, versions in ENV.md
python repro.py           # exit code 1 while the bug reproduces, 0 once fixed
```
The directory is self-contained: `program.pt2` (torch.export.save), `inputs.pt`, `expected.pt`
(the float64 reference), `repro.py`. Found with kokoro-parity's bisection.
"""




def write_bundle(bisector, op: dict, verify: bool = True) -> dict:
    """Write <report_dir>/repro/<item>/ for a localized op (plumbing.bundle's layout): the failing
    window's program and inputs (from the probe cache), expected.pt (float64), repro.py, meta.json,
    ENV.md and REPORT.md; with `verify`, run repro.py alone and record whether it reproduces."""
    window, k, backend = op["window"], op["node"], bisector.backend
    entry = cache.entry("bisect", window.key)
    in_names = json.loads((entry / "probe.json").read_text())["inputs"]
    gm, in_names = bisector.graph.carve(window.outputs, in_names)
    inputs = bisector.graph.values32(in_names)
    # float64 only: repro.py computes PyTorch's float32 (the floor) itself, on its machine
    expected = {"float64": evaluate(gm, inputs, "float64")}
    facts = _facts(bisector, op, in_names, inputs)
    out_dir = write_bundle_dir(bisector.report_dir / "repro" / bisector.item_id, {
        "program.pt2": entry / "program.pt2", "inputs.pt": entry / "inputs.pt",
        "expected.pt": lambda path: torch.save(expected, path),
        "ENV.md": _env_md(backend), "REPORT.md": _report_md(facts),
        "repro.py": render_repro(backend, facts["summary"], k.name, bisector.tol.floor_multiplier,
                                 bisector.tol.rel_l2)},
        meta={key: facts[key] for key in ("summary", "actual", "node", "op", "module", "kind", "backend", "version",
                                          "item", "n_ops")})
    has_runner = backend.repro_source() is not None
    info = {**bundle_info(out_dir), "n_ops": window.n_ops, "n_inputs": len(in_names), "template": has_runner}
    if verify and has_runner:
        info.update(run_repro(out_dir, timeout=bisector.limits.compile_s))
    return info


def _facts(bisector, op: dict, in_names: list[str], inputs: list) -> dict:
    k, w, backend = op["node"], op["window"], bisector.backend
    m = w.metrics.get(k.name, {})
    target = str(k.target)
    if not w.ran:
        actual = f"{w.status.replace('_', ' ')}: {w.why}"
    elif m.get("new_nonfinite") or (m.get("nan_rate") or 0) > 0:
        actual = f"non-finite values (NaN rate {m.get('nan_rate', 0):.2%})"
    else:
        actual = (f"relative L2 error {_fmt(m.get('rel_l2'))} against float64, "
                  f"{_fmt(m.get('floor_ratio'))} x PyTorch float32's own error {_fmt(m.get('floor_rel_l2'))}")
    what = "fails to compile or run" if not w.ran else "gives wrong results"
    summary = f"{backend.name}: {target} {what} ({actual.split(':')[0] if ':' in actual else actual})"
    return {"summary": summary, "actual": actual, "node": k.name, "op": target, "module": module_path(k),
            "source": source_line(k), "kind": op["kind"], "backend": backend.name,
            "version": backend.version(), "metrics": w.metrics, "status": w.status, "why": w.why,
            "n_ops": w.n_ops, "inputs": [(n, tuple(t.shape), str(t.dtype)) for n, t in zip(in_names, inputs)],
            "tol": bisector.tol, "item": bisector.item_id, "stack": (k.meta.get("stack_trace") or "").strip()}
