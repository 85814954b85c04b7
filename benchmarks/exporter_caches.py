"""One program (the tiny case's bert_encoder on random:0) exported in three cache directories one
after another, in one process, as the tests of a suite switch caches: each export's wall time and
the exporter's pid, then the exporter's CPU seconds. A new pid after a switch is a new exporter
process (torch and kokoro imported, the model built again).

    PYTHONPATH=$PWD python benchmarks/exporter_caches.py
"""
from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="exporter-caches-"))
    os.environ["KOKORO_PARITY_CACHE"] = str(root / "c0")
    from harness import programs
    from harness.cases import load_cases, write_case
    from harness.runner import Session

    write_case(root / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    session = Session(weights="random:0", case_ids=["tiny"], report_dir=root / "reports")
    session._cases = {c.id: c for c in load_cases(root / "cases")}
    inputs = session.traces("tiny").inputs("bert_encoder", "dynamic", "float32")
    for i in range(1, 4):
        os.environ["KOKORO_PARITY_CACHE"] = str(root / f"c{i}")
        start = time.perf_counter()
        _, _, result = programs.ensure_program("random:0", session.model.digest, "bert_encoder", inputs, [], 900)
        pid = programs.EXPORTER.proc.pid if programs.EXPORTER.proc else None
        print(f"cache {i}: export {time.perf_counter() - start:.1f} s wall, exporter pid {pid}, ok {result.ok}",
              flush=True)
    programs.EXPORTER.stop()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"children CPU {children.ru_utime + children.ru_stime:.1f} s")


if __name__ == "__main__":
    main()
