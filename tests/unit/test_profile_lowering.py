"""benchmarks/profile_lowering.py: its probes time nested phases and put every original back, and
on a tiny module they see the phases of a real XNNPACK lowering (no Kokoro step is lowered here)."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "profile_lowering.py"
_spec = importlib.util.spec_from_file_location("profile_lowering", _PATH)
profile_lowering = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("profile_lowering", profile_lowering)  # dataclasses look their module up
_spec.loader.exec_module(profile_lowering)


class _Work:
    def outer(self):
        time.sleep(0.02)
        return self.inner() + _Work.static() + self.prop

    def inner(self):
        time.sleep(0.03)
        return 1

    @staticmethod
    def static():
        return 2

    @property
    def prop(self):
        return 3


def test_nested_phases_split_self_time_and_restore_originals():
    originals = {name: _Work.__dict__[name] for name in ("outer", "inner", "static", "prop")}
    with profile_lowering.Profiler() as prof:
        undo = [prof.wrap(_Work, "outer", "outer"), prof.wrap(_Work, "inner", "inner"),
                prof.wrap(_Work, "static", "static"), prof.wrap(_Work, "prop", "prop", lambda r: {"value": r})]
        assert _Work().outer() == 6 and _Work().outer() == 6
        for u in undo:
            u()
    stats = {s.name: s for s in prof.rows()}
    assert [s.name for s in prof.rows()] == ["outer", "inner", "static", "prop"]
    assert stats["outer"].calls == 2 and stats["inner"].parent == "outer" and stats["inner"].depth == 1
    assert stats["inner"].total_s >= 0.06
    # outer's self time excludes inner's sleeps: about 2 x 20 ms, not 2 x 50 ms
    assert 0.035 <= stats["outer"].self_s < stats["outer"].total_s - 0.05
    assert stats["prop"].result == {"value": 3}
    assert {name: _Work.__dict__[name] for name in originals} == originals


def test_summary_adds_the_probes_of_each_phase():
    phases = [
        {"name": "run_decompositions({}) (functionalize only)", "parent": "to_edge (decompositions + edge dialect)",
         "calls": 1, "total_s": 2.0, "self_s": 2.0, "cpu_s": 1.5, "peak_rss_growth_mb": 10.0, "result": {"nodes": 50}},
        {"name": "run_decompositions (ExecuTorch table)", "parent": "to_edge (decompositions + edge dialect)",
         "calls": 1, "total_s": 3.0, "self_s": 3.0, "cpu_s": 2.5, "peak_rss_growth_mb": 30.0, "result": {"nodes": 80}},
        {"name": "run_decompositions (core ATen table)", "parent": "compile job: audit (XnnpackBackend.audit)",
         "calls": 1, "total_s": 7.0, "self_s": 7.0, "cpu_s": 6.0, "peak_rss_growth_mb": 5.0, "result": {"nodes": 90}},
    ]
    rows = {r["phase"]: r for r in profile_lowering.summarize(phases)}
    assert rows["to_edge: decompositions"] == {"phase": "to_edge: decompositions", "calls": 2, "wall_s": 5.0,
                                               "cpu_s": 4.0, "peak_rss_growth_mb": 30.0, "nodes_after": 80}
    assert rows["audit: run_decompositions (core ATen)"]["wall_s"] == 7.0
    assert rows["torch.export"]["calls"] == 0


@pytest.mark.slow
def test_probes_see_the_phases_of_a_tiny_xnnpack_lowering():
    pytest.importorskip("executorch")
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    program = torch.export.export(module, (torch.randn(2, 8),))
    with profile_lowering.Profiler() as prof:
        undo = profile_lowering.install_probes(prof)
        try:
            import executorch.exir as exir  # the probed attribute, as harness.backends.executorch imports it

            edge = exir.to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
            buffer = edge.to_executorch().buffer
        finally:
            for u in undo:
                u()
    assert exir.to_edge_transform_and_lower is to_edge_transform_and_lower
    stats = {s.name: s for s in prof.rows()}
    for name in ("to_edge (decompositions + edge dialect)", "partitioning: tag supported nodes",
                 "XNNPACK preprocess (serialize a partition)", "memory planning", "emit", "serialize .pte (flatbuffer)"):
        assert stats[name].calls >= 1, name
    assert stats["partitioning: tag supported nodes"].result == {"partitions": 1}
    assert stats["to_backend (partition + delegate)"].result["delegate_calls"] == 1
    assert stats["buffer (bytes of the .pte)"].result == {"bytes": len(buffer)}
