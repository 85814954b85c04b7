"""The same lowering and run as the harness's `xnnpack` backend, by hand: torch and executorch only.

Input: an exported program (.pt2) and its inputs (.pt), as the harness caches them. Prints one
JSON line of seconds. `bench.py` compares it with the same work through the harness's jobs.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
from executorch.exir import to_edge_transform_and_lower
from executorch.runtime import Runtime


def main(program_path: str, inputs_path: str) -> None:
    t = {}
    start = time.perf_counter()
    program = torch.export.load(program_path)
    inputs = [x.contiguous() for x in torch.load(inputs_path, weights_only=True)]
    t["load_program_s"] = time.perf_counter() - start

    start = time.perf_counter()
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    t["lower_s"] = time.perf_counter() - start
    start = time.perf_counter()
    buffer = edge.to_executorch().buffer
    pte = Path(tempfile.mkdtemp()) / "program.pte"
    pte.write_bytes(buffer)
    t["serialize_s"] = time.perf_counter() - start

    start = time.perf_counter()
    method = Runtime.get().load_program(str(pte)).load_method("forward")
    t["load_s"] = time.perf_counter() - start
    start = time.perf_counter()
    method.execute(inputs)
    t["run_s"] = time.perf_counter() - start
    t["pte_bytes"] = pte.stat().st_size
    print(json.dumps(t))


if __name__ == "__main__":
    main(*sys.argv[1:3])
