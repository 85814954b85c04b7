"""ExecuTorch's per-operator profile (harness/profile.py): ETDump from the pip runtime, read by
devtools' Inspector, split into the delegate's work and the portable kernels'."""
from __future__ import annotations

import pytest
import torch

from harness.plumbing.files import save_tensors
from harness.plumbing.jobs import run_job
from tests.unit.conftest import shared_references

pytest.importorskip("executorch")


class ConvNorm(torch.nn.Module):
    """A convolution (XNNPACK takes it) and an InstanceNorm (XNNPACK leaves it to the portable
    kernels: `_native_batch_norm_legit.no_stats`), as in Kokoro's vocoder."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(16, 16, 5, padding=2)
        self.norm = torch.nn.InstanceNorm1d(16)

    def forward(self, x):
        return torch.tanh(self.norm(self.conv(x))) + x


@pytest.fixture(scope="module")
def small_pte(tmp_path_factory):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    root = tmp_path_factory.mktemp("pte")
    x = torch.randn(1, 16, 4000)
    program = torch.export.export(ConvNorm().eval(), (x,))
    (root / "program.pte").write_bytes(
        to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer)
    save_tensors(root / "inputs.pt", [x])
    return root


def test_etdump_splits_delegated_and_portable_time(small_pte, tmp_path):
    result = run_job("harness.profile:etdump_job", dict(artifact_path=str(small_pte / "program.pte"),
                                                        inputs_path=str(small_pte / "inputs.pt"), out_dir=str(tmp_path),
                                                        repeat=4), tmp_path / "job", 300)
    assert result.ok, result.error + result.log_tail
    table, s = result.value, result.value["summary"]
    assert (tmp_path / "etdump.etdp").stat().st_size > 0 and s["runs"] == 4
    where = {r["operator"]: r["where"] for r in table["rows"]}
    assert where["_native_batch_norm_legit.no_stats_out"] == "portable kernel"
    assert any(op.startswith("Convolution") and w == "delegated" for op, w in where.items()), where
    assert s["delegate_calls"] >= 1 and s["portable_calls"] >= 1
    # times are medians over runs, each from its own clock reads: only their presence is checked here
    # (nesting inequalities between medians do not hold on a loaded machine); figures belong to benchmarks
    assert s["delegated_ops_ms"] > 0 and s["portable_kernels_ms"] > 0 and s["execute_ms"] > 0
    assert sum(r["ms"] for r in table["rows"]) == pytest.approx(s["delegated_ops_ms"] + s["portable_kernels_ms"])
    assert [r["ms"] for r in table["rows"]] == sorted((r["ms"] for r in table["rows"]), reverse=True)


def test_profile_refuses_what_it_cannot_profile(tmp_path, capsys):
    from harness import cli
    from harness.profile import profile_item
    from harness.runner import Item, Session

    session = Session(weights="random:0", report_dir=tmp_path)
    with pytest.raises(ValueError, match="ExecuTorch programs"):
        profile_item(session, Item("en_short", "decoder", "onnxruntime", "static"))
    with pytest.raises(ValueError, match="two programs"):
        profile_item(session, Item("en_short", "e2e", "xnnpack", "static"))
    code = cli.main(["profile", "--case", "en_short", "--step", "decoder", "--backend", "eager",
                     f"--report-dir={tmp_path}"])  # the CLI's command, in this process
    assert code == 2 and "ETDump profiles ExecuTorch programs" in capsys.readouterr().err


@pytest.mark.slow
def test_profile_of_a_tiny_case_item_on_both_executorch_backends(tmp_path, monkeypatch):
    """~1 min: the tiny case's bert_encoder (seeded random model) compiled for xnnpack and portable
    through the runner's cache, profiled, and the files written."""
    from harness.cases import load_cases, write_case
    from harness.profile import profile_item
    from harness.runner import Item, Session

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(shared_references(tmp_path / "cache", work=True)))
    session = Session(weights="random:0", case_ids=["tiny"], report_dir=tmp_path / "reports")
    session._cases = {c.id: c for c in load_cases(tmp_path / "cases")}
    for backend, where in (("xnnpack", "delegated"), ("portable", "portable kernel")):
        table, out = profile_item(session, Item("tiny", "bert_encoder", backend, "dynamic"), repeat=3)
        assert {r["where"] for r in table["rows"]} == {where}, table["rows"]
        assert table["summary"]["execute_ms"] > 0 and table["summary"]["runs"] == 3
        assert {"etdump.etdp", "operators.csv", "operators.md", "profile.json"} <= {p.name for p in out.iterdir()}
        md = (out / "operators.md").read_text()
        assert table["rows"][0]["operator"] in md and "delegated:" in md
        assert (out / "operators.csv").read_text().splitlines()[0] == "operator,where,calls,ms,share"
    assert table["cache"]["program"] == "hit"  # both ExecuTorch backends export the same program
