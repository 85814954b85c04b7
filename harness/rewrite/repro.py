"""The repro bundle of a rewrite's first failing module: the module alone, on the inputs the
float64 reference fed it, in the rewrite's own framework, without Kokoro, torch or this harness.

The layout is the ONNX stages' (harness.port.onnx_stages.write_repro): `inputs.npz` (what the
rewrite was fed, float32), `expected.npy` (the float64 reference's output), `meta.json` (module,
convention, tolerance), `repro.py` (exit 1 reproduced, 0 fixed, 2 cannot run here) and
`REPORT.md`; plus `noise.npz` (Kokoro's noise, for the vocoder's modules) and what the adapter's
`repro` writes (the module's weights and the runner file `repro.py` calls).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from ..metrics import fmt
from ..plumbing.bundle import bundle_info, partial_bundle, write_meta
from .captures import cast32

REPRO = '''#!/usr/bin/env python3
"""Repro: {summary}

Runs {rewrite}'s counterpart of Kokoro's module `{module}` alone on the inputs the float64
reference fed it (inputs.npz, float32) and compares its output with the float64 reference
(expected.npy). Exit 1 while its relative L2 error is above the tolerance of meta.json or has
NaN/Inf where the reference is finite; 0 once it is within; 2 when it cannot run here (a package
of meta.json's `packages` missing). Needs only {packages}.
"""
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
META = json.loads((HERE / "meta.json").read_text())
sys.path.insert(0, str(HERE))
try:
    for package in META["packages"]:
        importlib.import_module(package)
    import numpy as np
    run_saved = importlib.import_module(META["runner"]).run_saved
except ImportError as e:
    print(f"cannot run here: {{type(e).__name__}}: {{e}}")
    sys.exit(2)


def main():
    data = dict(np.load(HERE / "inputs.npz"))
    args = [data[a["npz"]] if "npz" in a else a["value"] for a in META["args"]]
    kwargs = {{k: data[a["npz"]] if "npz" in a else a["value"] for k, a in META["kwargs"].items()}}
    noise = dict(np.load(HERE / "noise.npz")) if (HERE / "noise.npz").exists() else {{}}
    expected = np.load(HERE / "expected.npy")
    try:
        got = np.asarray(run_saved(HERE, META, args, kwargs, noise), dtype=np.float64)
    except Exception as e:  # the rewrite raising on these inputs reproduces the bug too
        print(f"{{META['rewrite']}}: {{META['module']}} raised {{type(e).__name__}}: {{e}}")
        return 1
    if got.shape != expected.shape:
        print(f"{{META['module']}}: shape {{list(got.shape)}} != expected {{list(expected.shape)}}")
        return 1
    if (~np.isfinite(got) & np.isfinite(expected)).any():
        print(f"{{META['module']}}: NaN/Inf where the reference is finite")
        return 1
    norm = float(np.linalg.norm(expected))
    rel = float(np.linalg.norm(got - expected)) / (norm or 1.0)
    bad = rel > META["tolerance"]
    print(f"{{META['module']}}: rel_l2 {{rel:.3e}} against the float64 reference; tolerance {{META['tolerance']:.3e}} "
          f"(torch float32's own error {{META['floor_rel_l2']:.3e}})")
    print(f"REPRODUCED: {{META['rewrite']}} diverges" if bad else f"not reproduced: {{META['rewrite']}} is within")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
'''

NO_RUNNER = '''#!/usr/bin/env python3
"""The adapter of {rewrite} gives no standalone runner (`Adapter.repro`): inputs.npz and expected.npy
hold the module's inputs and float64 output; feed them to the rewrite's module yourself.
Exit code 2: cannot run here (neither reproduced, 1, nor fixed, 0)."""
import sys

print("repro.py: the adapter of {rewrite} defines no `repro` (docs/rewrites.md)")
sys.exit(2)
'''


def saved(values, data: dict, prefix: str):
    """A captured input as meta.json names it: a tensor goes to inputs.npz (float32 as fed)."""
    if isinstance(values, torch.Tensor):
        data[prefix] = cast32(values).detach().numpy()
        return {"npz": prefix, "shape": list(values.shape), "dtype": str(data[prefix].dtype)}
    return {"value": values}


def write_rewrite_repro(out: Path, adapter, model, convention: str, io, m: dict, tol) -> dict:
    """Write the bundle of module `io.path` (its captures `io`, its judged row `m`) to `out`
    through plumbing.bundle (whole or absent); the adapter's `repro` adds its own files to it."""
    data: dict = {}
    args = [saved(v, data, f"arg{i}") for i, v in enumerate(io.args)]
    kwargs = {k: saved(v, data, f"kw_{k}") for k, v in io.kwargs.items()}
    floor = m.get("floor_rel_l2", math.nan)
    tolerance = max(tol.rel_l2, tol.floor_multiplier * floor) if not math.isnan(floor) else tol.rel_l2
    with partial_bundle(out) as d:
        np.savez(d / "inputs.npz", **data)
        if io.noise:
            np.savez(d / "noise.npz", **{k: v.float().numpy() for k, v in io.noise.items()})
        np.save(d / "expected.npy", io.out64.double().numpy())
        runner = adapter.repro(model, io.path, convention, d)
        meta = {"rewrite": adapter.name, "module": io.path, "convention": convention, "tolerance": tolerance,
                "floor_rel_l2": floor, "rel_l2": m.get("rel_l2"), "kind": m.get("kind"), "why": m.get("why"),
                "args": args, "kwargs": kwargs, "runner": (runner or {}).get("runner"),
                "packages": (runner or {}).get("packages", ["numpy"])}
        write_meta(d, meta)
        summary = f"{adapter.name}: `{io.path}` {m.get('kind')} ({m.get('why')})"
        (d / "repro.py").write_text(REPRO.format(summary=summary, rewrite=adapter.name, module=io.path,
                                                 packages=", ".join(meta["packages"]))
                                    if runner else NO_RUNNER.format(rewrite=adapter.name))
        (d / "REPORT.md").write_text(report_md(meta, runner))
    return {**bundle_info(out), "template": runner is not None}


def report_md(meta: dict, runner: dict | None) -> str:
    inputs = "".join(f"- {name}: " + (f"{a['shape']} {a['dtype']}" if "npz" in a else repr(a["value"])) + "\n"
                     for name, a in [*((f"argument {i}", a) for i, a in enumerate(meta["args"])),
                                     *meta["kwargs"].items()])
    built = runner["built"] if runner else "the adapter gives no standalone runner: repro.py exits 2"
    return f"""# {meta['rewrite']}: `{meta['module']}` leaves its floor ({meta['kind']})

**Summary.** {meta['rewrite']}'s counterpart of Kokoro-82M's module `{meta['module']}` (convention
`{meta['convention']}`), fed the inputs the float64 reference fed Kokoro's module (cast to
float32), gives a relative L2 error of {fmt(meta['rel_l2'])} against the float64 output, where
torch float32's own error on the same inputs is {fmt(meta['floor_rel_l2'])}: {meta['why']}.

## Expected vs actual
- **Expected:** `expected.npy` (float64), within a relative L2 of {fmt(meta['tolerance'])} (the larger of the
  tolerance and the multiple of torch float32's own error), no NaN/Inf where it is finite.
- **Actual:** {meta['kind']}.

## The inputs (`inputs.npz`, Kokoro's layout)
{inputs}
## How the module is built
{built}.

## How to run
```
pip install {' '.join(meta['packages'])}
python repro.py     # exit 1 while the bug reproduces, 0 once fixed, 2 when it cannot run here
```
Found with kokoro-parity's module-by-module judgement of a rewrite (docs/rewrites.md).
"""
