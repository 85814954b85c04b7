"""Cost laws: what a backend's compile or run will cost, known before it starts.

Some costs grow with the input faster than anything else in the matrix: TVM's frontends write an
LSTM out step by step (compile memory grows with the square of the steps), tvm-onnx's compile grows
as the graph's size to the power 1.5, portable kernels run the vocoder far slower than real time.
An item past a limit would be a TIMEOUT after the limit or an out-of-memory kill after minutes; a
backend that declares its measured law lets the runner SKIP it up front, with the figures as the
reason. The points are measurements (docs/performance.md says by which command); the fit is made
here from them, so a new point is one line.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# The sizes of a program a law can be written in (harness.programs.program_sizes computes them).
EXPORTED_NODES = "exported nodes"
LSTM_STEPS = "LSTM steps"  # the time steps of the program's longest aten.lstm
AUDIO_SECONDS = "seconds of audio"  # the audio an audio step returns, at Kokoro's 24 kHz


@dataclass(frozen=True)
class CostLaw:
    """A cost (`unit`: "s" or "GB") as a function of one size of the program, fit to measured
    (size, cost) points: `power` (cost = a * size**k, least squares in log-log) or `quadratic`
    (a + b * size + c * size**2: memory that a written-out loop keeps per step and per pair)."""

    size: str
    unit: str
    points: tuple[tuple[float, float], ...]
    form: str = "power"
    source: str = "docs/performance.md"

    def __post_init__(self):
        needed = {"power": 2, "quadratic": 3}.get(self.form)
        if needed is None:
            raise ValueError(f"CostLaw form {self.form!r}: power or quadratic")
        if len(self.points) < needed:
            raise ValueError(f"a {self.form} CostLaw needs {needed} points, got {len(self.points)}")

    def _coefficients(self) -> np.ndarray:
        x, y = (np.array(v, dtype=float) for v in zip(*self.points))
        if self.form == "power":
            return np.polyfit(np.log(x), np.log(y), 1)  # (k, log a)
        return np.polyfit(x, y, 2)

    def estimate(self, size: float) -> float:
        c = self._coefficients()
        if self.form == "power":
            return float(math.exp(c[1]) * size ** c[0]) if size > 0 else 0.0
        return float(np.polyval(c, size))

    def describe(self) -> str:
        """The law in words, for a SKIPPED item's reason: its form and the points it was fit to."""
        shown = ", ".join(f"{_figure(v)} {self.unit} at {_figure(s, whole=True)}" for s, v in self.points)
        form = (f"grows as the {self.size} to the power {self._coefficients()[0]:.2f}" if self.form == "power"
                else f"grows with the square of the {self.size}")
        return f"{form} (measured: {shown} {self.size}; {self.source})"


def _figure(v: float, whole: bool = False) -> str:
    if whole and v == int(v):
        return f"{int(v):,}"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}" if v >= 1 else f"{v:.2f}"
