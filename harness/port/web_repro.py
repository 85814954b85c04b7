"""The browser half of an ONNX stage's repro bundle, when the stage ran in onnxruntime-web: a static
page that a browser or onnxruntime maintainer opens from a local folder, with nothing fetched
from the internet.

`index.html` and `repro.js` (copies of web/stage_repro.html and web/stage_repro.js, the run and
verdict they share with repro.mjs in `verdict.mjs`) load
onnxruntime-web from `ort/` (the files the localization's pages loaded from web/node_modules,
copied: no CDN), run `stage.onnx` on `inputs/N.bin` (raw little-endian bytes, described by
`inputs.json`: a browser cannot read .npz) with the provider that judged the item, and compare
its output with `expected.bin` (float64) as repro.py does: rel L2 against the tolerance,
"reproduced" or "fixed", printed on the page and its console and set as `window.reproVerdict`.
`repro.mjs` does the same in Node.js on onnxruntime-web's WebAssembly build (`node repro.mjs`).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..backends.onnxruntime_web import NPM_PACKAGE, graph_input_types, web_dir


def browser_files(stage_onnx: Path, inputs_npz: Path, expected: np.ndarray, meta: dict,
                  where: dict) -> tuple[dict, str]:
    """({bundle file: content}, REPORT.md's section) for a stage that ran in onnxruntime-web
    (`where`: the localization's `ran_on`): the page, its inputs as bytes and onnxruntime-web's
    files the run loaded."""
    web = where["ort_web"]
    types = graph_input_types(stage_onnx)
    with np.load(inputs_npz) as saved:
        arrays = {k: np.asarray(saved[k]) for k in saved.files if k in types}
    files: dict = {"index.html": web_dir() / "stage_repro.html", "repro.js": web_dir() / "stage_repro.js",
                   "verdict.mjs": web_dir() / "stage_verdict.mjs"}
    specs = []
    for i, (name, a) in enumerate(arrays.items()):
        a = np.ascontiguousarray(a.astype(types[name]) if types[name] is not None else a)
        files[f"inputs/{i}.bin"] = a.astype(a.dtype.newbyteorder("<")).tobytes()
        specs.append({"name": name, "dtype": a.dtype.name, "dims": list(a.shape), "file": f"inputs/{i}.bin"})
    files["expected.bin"] = np.ascontiguousarray(expected, dtype="<f8").tobytes()
    dist = web_dir() / "node_modules" / NPM_PACKAGE / "dist"
    sizes = {}
    for name in web.get("files", []):
        files[f"ort/{name}"] = dist / name
        sizes[name] = (dist / name).stat().st_size
    files.update(node_files(dist))
    spec = {"stage": meta["stage"], "output": meta["output"], "tolerance": meta["tolerance"],
            "bundle": web["bundle"], "execution_provider": web["execution_provider"],
            "ort_web_version": web["version"], "inputs": specs,
            "expected": {"dtype": "float64", "dims": list(expected.shape), "file": "expected.bin"}}
    files["inputs.json"] = json.dumps(spec, indent=1) + "\n"
    browser = (where.get("browser") or {}).get("version", "?")
    listed = ", ".join(f"`{n}` ({_size(b)})" for n, b in sizes.items())
    report = (f"\n## In a browser: onnxruntime-web {web['version']}, {web['execution_provider']} provider\n\n"
              f"The localization ran this stage in onnxruntime-web {web['version']} (`{web['bundle']}`, "
              f"provider `{web['execution_provider']}`) in Chromium {browser}, as the item was judged. "
              "`index.html` runs it there again: in this folder, `python -m http.server 8000`, then open "
              "http://localhost:8000/ (localhost is a secure context, as WebGPU needs). The page prints the "
              "rel L2 against `expected.bin` (float64) and `reproduced` or `fixed` (also `window.reproVerdict`).\n\n"
              f"onnxruntime-web {web['version']} is in `ort/`, copied from its npm package (nothing is fetched "
              f"from a CDN): {listed}; {_size(sum(sizes.values()))} in all. The inputs are raw little-endian "
              "bytes, `inputs/N.bin`, described in `inputs.json`.\n\n"
              "`node repro.mjs` (Node.js 18 or newer, nothing to install) runs the same stage on onnxruntime-web's "
              "WebAssembly build for Node.js (`ort/ort.node.min.mjs`, with the `onnxruntime-common` it imports in "
              "`node_modules/`, copied): the wasm kernels, whichever provider judged the item; it prints the same "
              "line and exits 1 reproduced, 0 fixed, 2 cannot run here.\n")
    return files, report


NODE_FILES = ("ort.node.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")


def node_files(dist: Path) -> dict:
    """`repro.mjs` and what it loads: onnxruntime-web's Node.js build and its WebAssembly, and the
    ES modules of onnxruntime-common, which that build imports by package name."""
    common = dist.parent.parent / "onnxruntime-common"
    files = {"repro.mjs": web_dir() / "stage_repro_node.mjs",
             "node_modules/onnxruntime-common/package.json": common / "package.json"}
    files.update({f"ort/{name}": dist / name for name in NODE_FILES})
    files.update({f"node_modules/onnxruntime-common/{p.relative_to(common).as_posix()}": p
                  for p in sorted((common / "dist" / "esm").rglob("*")) if p.suffix == ".js"})
    return files


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"
