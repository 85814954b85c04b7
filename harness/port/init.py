"""`kokoro-parity port init ARTIFACT...`: a port file guessed from the artifacts' declared inputs
and outputs (by name, then rank and dtype), in the order given, every guess marked
`# guess: confirm` and every input or output it could not place marked `# unknown: map me`.
`kokoro-parity port check` then validates it whole.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import tensors
from .portfile import _by_shape, _is_int8


def _guess(p, side: str, taken: set[str]) -> tuple[str | None, str]:
    t = tensors.guess(p.name, p.rank, p.dtype)
    if t is not None:
        return t, "by name"
    t = _by_shape(p, side, None, taken)
    return (t, "by rank and dtype") if t else (None, "")


def port_text(artifacts: list[Path], out: Path) -> str:
    from ..backends.prebuilt import describe

    lines = ["# written by `kokoro-parity port init`: confirm every line marked `# guess: confirm`,",
             "# map every `# unknown: map me` to a Kokoro tensor (docs/own-port.md), then run",
             f"# `kokoro-parity port check {out.name}`.",
             f"name: {out.parent.resolve().name or 'my-port'}", "stages:"]
    for path in artifacts:
        ins, outs = describe(path)
        rel = os.path.relpath(Path(path).resolve(), out.parent.resolve())
        lines += [f"  - name: {Path(path).stem.replace('.', '_')}", f"    artifact: {rel}"]
        if _is_int8(Path(path)):
            lines.append("    precision: int8  # guess: confirm (integer matmuls/convolutions in the graph)")
        noise_in = [p.name for p in ins if tensors.guess(p.name, p.rank, p.dtype) in tensors.NOISE]
        if noise_in:
            lines.append(f"    noise: inputs  # guess: confirm (the vocoder's noise is an input: {', '.join(noise_in)})")
        for side, ports in (("inputs", ins), ("outputs", outs or [])):
            lines.append(f"    {side}:")
            taken: set[str] = set()
            for i, p in enumerate(ports):
                name = p.name if p.name is not None else f"#{i}"
                t, how = _guess(p, side, taken)
                shape = f"{p.dtype or '?'} {list(p.shape) if p.shape is not None else '?'}"
                if t is None:
                    lines.append(f"      {_key(name)}: FIXME  # unknown: map me ({shape})")
                else:
                    taken.add(t)
                    lines.append(f"      {_key(name)}: {t}  # guess: confirm ({how}; declared {shape}, "
                                 f"Kokoro's {tensors.describe(t)})")
    return "\n".join(lines) + "\n"


def _key(name: str) -> str:
    return name if name.replace("_", "").isalnum() else f'"{name}"'


def write_port(artifacts: list[Path], out: Path) -> Path:
    from ..plumbing.files import atomic_write

    text = port_text(artifacts, Path(out))
    return atomic_write(out, lambda f: f.write(text.encode()))
