"""A user's port: an ordered list of stages (artifacts), each mapped to Kokoro tensors, judged
stage by stage against the reference at the port's own boundaries.

- tensors.py: the Kokoro tensor vocabulary a port file maps to.
- portfile.py: `port.yaml`, validated whole (`load_port`); the one-stage whole-model port.
- noise.py: the noise band of the audio metrics for artifacts that draw their own noise.
- differences.py: what a difference looks like in words (non-finite, gain, sign flip, shift, noise).
- chain.py: run a port on a case; each stage judged locally and chained; one record.
- onnx_graph.py: an ONNX read and rewritten (module of a node, random ops, durations, marked and forced copies).
- onnx_stages.py: localization inside an ONNX artifact (intermediate outputs mapped to modules).
- onnx_steps.py: the same inside one step's ONNX (`--artifact STEP=PATH --bisect`), on the step's submodules.
- init.py: `kokoro-parity port init` (a port file guessed from artifacts).
- splits.py: the example 3-stage and 7-stage splits as exportable stages (examples/kokoro-*stage).
"""
