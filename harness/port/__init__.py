"""A user's port: an ordered list of stages (artifacts), each mapped to Kokoro tensors, judged
stage by stage against the reference at the port's own boundaries.

- tensors.py: the Kokoro tensor vocabulary a port file maps to.
- portfile.py: `port.yaml`, validated whole (`load_port`); the one-stage whole-model port.
- noise.py: the noise band of the audio metrics for artifacts that draw their own noise.
- differences.py: what a difference looks like in words (non-finite, gain, sign flip, shift, noise).
- chain.py: run a port on a case; each stage judged locally and chained; one record.
- onnx_graph.py: an ONNX read and rewritten (random ops, durations, marked, forced and fed copies).
- onnx_steps.py: the one ONNX localizer (a whole model, a chain's stage, one step's file: `localize_modules`):
  the Kokoro modules a file's names reach, each judged chained and locally; the defects ranked.
- onnx_stages.py: its ONNX side (module groups, marking, cutting, feeding, a row's verdict, ranking, repro).
- init.py: `kokoro-parity port init` (a port file guessed from artifacts).
- splits.py: the example 3-stage and 7-stage splits as exportable stages (examples/kokoro-*stage).
"""
