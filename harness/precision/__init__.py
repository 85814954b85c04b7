"""Float16 judged by its own floor, and the float32 islands that make a float16 port sound right.

- `float16`: eager PyTorch in float16 with module-level float32 islands (`Float16Mode`, `Mixed`):
  the float16 floor of `harness.reference.float16_outputs` and the search run it.
- `islands`: a keep-list's forms in a backend: the JSON ($KOKORO_PARITY_KEEP_FP32) that the `fp16`
  and `coreml-fp16` backends read, the program's float32 nodes, the fp16 backend's mixed graph and
  Core ML's `op_selector`.
- `search`: the smallest set of modules to keep in float32 so that the float16 run is shippable on
  every case (`kokoro-parity precision`), and the files it writes.

Layers: `float16` imports nothing of the harness; backends import `islands`; `search` sits above
the reference and the backends, as the runner does.
"""
