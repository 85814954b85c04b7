"""Export the two-stage port of the porters' reports from the default model to ONNX, and write its
port file: a duration stage (tokens -> durations and `d`), the alignment built on the host, then a
synthesizer (d, alignment, tokens, style, noise -> audio). The programs are the harness's own
(`duration_stage`, `synthesizer` of harness/steps.py, exported by harness/programs.py with the
onnxruntime backend's patches) at one case's exact lengths, then turned into ONNX by
harness/backends/onnx.py `export_onnx`.

    .venv/bin/python examples/kokoro-2stage/export.py --case ja [--weights random:0] [--out DIR]
    pytest --port examples/kokoro-2stage/port.yaml --case ja
"""
from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True)
    p.add_argument("--weights", default=None)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args()

    from harness.backends import get_backend
    from harness.backends.onnx import export_onnx
    from harness.backends.prebuilt import describe
    from harness.programs import ensure_program
    from harness.runner import Session
    from harness.steps import get_step

    session = Session(weights=args.weights, case_ids=[args.case])
    traces = session.traces(args.case)
    chain = traces.chain
    patches = session.patches_for(get_backend("onnxruntime"))
    inputs = {
        "duration_stage": {k: chain[k] for k in get_step("duration_stage").input_names},
        "synthesizer": {k: chain[k] for k in get_step("synthesizer").input_names},
    }
    lines = [f"# the two-stage port, exported for case {args.case!r} by examples/kokoro-2stage/export.py",
             "name: kokoro-2stage", "stages:"]
    for step, feed in inputs.items():
        entry, _key, result = ensure_program(args.weights, session.model.digest, step, feed, patches, 3600)
        if result is not None and not result.ok:
            raise SystemExit(f"export of {step} failed: {result.error}")
        onnx_path = args.out / f"{step}.onnx"
        info = export_onnx(entry / "program.pt2", onnx_path)
        print(f"{onnx_path}: {info.get('exporter')}")
        ins, outs = describe(onnx_path)
        names = get_step(step).output_names
        lines += [f"  - name: {step}", f"    artifact: {onnx_path.name}",
                  "    noise: inputs" if step == "synthesizer" else "    noise: none",
                  "    inputs:", *(f"      {i.name}: {i.name}" for i in ins),
                  "    outputs:", *(f"      {o.name}: {n}" for o, n in zip(outs, names))]
    (args.out / "port.yaml").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'port.yaml'}")


if __name__ == "__main__":
    main()
