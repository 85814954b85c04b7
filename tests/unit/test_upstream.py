"""Upstream repro bundles (harness/upstream/, docs/upstream/) and named workarounds.

- Every bundle's repro.py runs in a fresh interpreter (-I: no PYTHONPATH, no user site) in which
  kokoro and this harness cannot be imported, and exits 1 (reproduces) on the pinned versions.
- A bundle rebuilt from its minimal program reproduces too (the generator is not just the files).
- `--no-workaround NAME|all` drops patch-workarounds from an item's patches, reaches the compile
  (artifact key via `version()`) and the repro's runner, and records what was applied/disabled.
- The COMPILE_ERROR bisection, on a small program with an op coremltools has no lowering for
  (`aten.alias`, with the alias_drop workaround off), names that node and writes a bundle that exits 1.

Bundle runs import a runtime and convert a few-op program: 10-60 s each (slow marks on the longer ones).
"""
from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
import yaml

from harness import upstream
from harness.upstream import bundle, catalog, programs  # noqa: F401 - upstream.bundle, .catalog, .programs
from harness.backends import NO_WORKAROUND_ENV, get_backend, set_disabled_workarounds

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "upstream"
# under ~20 s each; the others are slow-marked
FAST = ("tvm-clamp-int", "torch-fp16-sinegen-phase", "tvm-lstm-written-out")


@pytest.fixture
def no_workaround(monkeypatch):
    """Switch workarounds off for this test only (the variable is restored afterwards)."""
    monkeypatch.setenv(NO_WORKAROUND_ENV, "")

    def set_(*names):
        set_disabled_workarounds(names)
    return set_


def _installed(d) -> bool:
    import importlib.util

    return importlib.util.find_spec(d.module) is not None


# ---- fast: names, links, sources ------------------------------------------------------------------

def test_every_defect_has_a_bundle_and_every_workaround_points_to_one():
    names = [d.name for d in upstream.DEFECTS]
    assert len(names) == len(set(names))
    for d in upstream.DEFECTS:
        files = {p.name for p in (DOCS / d.name).iterdir()}
        assert {"repro.py", "program.pt2", "inputs.pt", "expected.pt", "ENV.md", "REPORT.md"} <= files, d.name
        assert sum(p.stat().st_size for p in (DOCS / d.name).iterdir()) < 4e6  # only the subgraph's own weights
        assert d.name in (DOCS / "README.md").read_text()
    from harness.backends import backend_names

    for b in backend_names():
        for w in get_backend(b).workarounds.values():
            linked = [n for n in names if f"docs/upstream/{n}/" in w.upstream]
            assert linked or "no bundle yet" in w.upstream, (b, w.name, w.upstream)


@pytest.mark.parametrize("name", [d.name for d in upstream.DEFECTS])
def test_repro_imports_only_torch_numpy_and_the_runtime(name):
    d = upstream.BY_NAME[name]
    text = (DOCS / name / "repro.py").read_text()
    assert text == upstream.repro_source(d), "docs/upstream is stale: run `make upstream`"
    tree = ast.parse(text)
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    allowed = {"sys", "pathlib", "platform", "traceback", "numpy", "torch", d.module} | ({"onnx"} if d.onnx else set())
    assert imported <= allowed, imported - allowed


def test_report_names_the_op_the_kokoro_line_and_the_versions():
    for d in upstream.DEFECTS:
        report = (DOCS / d.name / "REPORT.md").read_text()
        assert d.op in report and d.source[0] in report, d.name
        assert "reproduces" in report and "exit code 1" in report, d.name
        assert upstream.bundle._version(d.runtime) in report, d.name


# ---- the bundles, run alone ------------------------------------------------------------------------

@pytest.mark.parametrize("name", [pytest.param(d.name, marks=() if d.name in FAST else pytest.mark.slow)
                                  for d in upstream.DEFECTS])
def test_bundle_reproduces_alone_without_kokoro(name, tmp_path):
    """The committed bundle, copied outside the repository, exits 1 with neither kokoro nor the harness importable."""
    import shutil

    d = upstream.BY_NAME[name]
    if not _installed(d):
        pytest.skip(f"{d.runtime} is not installed")
    bundle = tmp_path / name
    shutil.copytree(DOCS / name, bundle)
    r = upstream.run_isolated(bundle, timeout=600)
    assert r["exit_code"] == upstream.REPRODUCED, r["output"]
    assert r["message"].startswith("REPRODUCED") and d.signature.split()[0].lower() in r["output"].lower()
    assert "LOADED []" in r["output"]  # nothing of kokoro or the harness was imported


def test_rebuilt_bundle_reproduces_and_a_fixed_one_exits_0(tmp_path):
    """The generator itself: the float16 bundle rebuilt from its module reproduces; the same repro on
    a 2 s utterance (no overflow: the 'fix') exits 0; one importing the harness cannot."""
    d = upstream.BY_NAME["torch-fp16-sinegen-phase"]
    bundle = upstream.build_bundle(d, tmp_path)
    r = upstream.run_isolated(bundle)
    assert r["exit_code"] == 1 and "non-finite" in r["message"], r["output"]
    short = torch.full((1, 24000 * 2, 1), 9 * 200.0)
    torch.export.save(torch.export.export(upstream.programs.SinePhase(), (short,)), str(bundle / "program.pt2"))
    torch.save([short], bundle / "inputs.pt")
    with torch.no_grad():
        torch.save({"float64": [upstream.programs.SinePhase()(short.double())]}, bundle / "expected.pt")
    r = upstream.run_isolated(bundle)
    assert r["exit_code"] == 0 and r["message"].startswith("FIXED"), r["output"]
    (bundle / "repro.py").write_text("import harness\n")
    r = upstream.run_isolated(bundle)
    assert r["exit_code"] == 3 and "harness is blocked" in r["output"], r["output"]


def test_nightly_check_records_each_status(tmp_path):
    """check_bundles (the nightly re-check) runs every bundle of a directory and says which is fixed."""
    for name, code in (("a-fixed", 0), ("b-open", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "repro.py").write_text(f"import sys\nprint('FIXED' if {code} == 0 else 'REPRODUCED')\n"
                                                  f"sys.exit({code})\n")
    rows = upstream.check_bundles(tmp_path, timeout=120)
    assert [(r["name"], r["status"]) for r in rows] == [("a-fixed", "fixed"), ("b-open", "reproduces")]


def test_history_keeps_upstream_statuses_and_the_dashboard_shows_changes(tmp_path):
    from harness.dashboard import upstream_rows
    from harness.history import Run

    first = Run("r1", "2026-11-01T00:00:00Z", upstream=[{"name": "x", "status": "reproduces"}])
    second = Run.from_dict(Run("r2", "2026-11-02T00:00:00Z", upstream=[{"name": "x", "status": "fixed"}]).to_dict())
    assert second.upstream == [{"name": "x", "status": "fixed"}]
    assert upstream_rows([first, second]) == [{"name": "x", "status": "fixed", "was": "reproduces"}]
    assert upstream_rows([Run("r0", "2026-10-01T00:00:00Z")]) == []


# ---- named workarounds ------------------------------------------------------------------------------

def test_no_workaround_drops_patches_and_changes_the_artifact_key(no_workaround):
    from harness.runner import Session, workarounds_of

    session = Session(weights="random:0")
    coreml, tvm, tvm_onnx = get_backend("coreml-fp32"), get_backend("tvm"), get_backend("tvm-onnx")
    assert "unrolled_lstm" in session.patches_for(tvm_onnx) and "unrolled_lstm" not in session.patches_for(coreml)
    keys = (tvm_onnx.artifact_key("p"), tvm.artifact_key("p"), coreml.artifact_key("p"))
    no_workaround("unrolled_lstm", "clamp_int_bound", "lstm_converter")
    assert "unrolled_lstm" not in session.patches_for(tvm_onnx)
    assert "unrolled_lstm" not in session.patches_for(get_backend("xnnpack"))  # a name means it everywhere
    assert "unrolled_lstm" in session.patches_for(get_backend("portable"))  # not a workaround there
    assert "no-workaround=clamp_int_bound" in tvm.version() and tvm.artifact_key("p") != keys[1]
    assert tvm_onnx.artifact_key("p") == keys[0]  # a patch-workaround changes the program, not the compile
    assert coreml.artifact_key("p") != keys[2]  # a fix inside the conversion changes the compile
    assert workarounds_of(tvm) == {"applied": ["instance_norm_float64_stats", "stft_phase_where"],
                                   "disabled": ["clamp_int_bound"]}
    no_workaround("all")
    assert get_backend("coreml-fp16").disabled_workarounds() == set(get_backend("coreml-fp16").workarounds)
    assert "alias_drop" in coreml.version() and os.environ[NO_WORKAROUND_ENV] == "all"
    with pytest.raises(ValueError, match="unknown workaround"):
        set_disabled_workarounds(["no_such_fix"])


def test_repro_runners_leave_out_disabled_workarounds(no_workaround):
    assert "_clamp_int_safe" in get_backend("tvm").repro_source()
    assert "DISABLED = []" in get_backend("coreml-fp32").repro_source()
    no_workaround("clamp_int_bound", "alias_drop")
    assert "_clamp_int_safe" not in get_backend("tvm").repro_source()
    assert "DISABLED = ['alias_drop']" in get_backend("coreml-fp32").repro_source()


def test_coreml_inference_ir_keeps_the_alias_when_alias_drop_is_off():
    pytest.importorskip("coremltools")
    from harness.backends.coreml import _inference_ir

    program = torch.export.export(upstream.programs.AlbertPositions(), (torch.zeros(1, 16, dtype=torch.long),))
    ops = lambda ep: {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}  # noqa: E731
    assert "aten.alias.default" not in ops(_inference_ir(program))
    assert "aten.alias.default" in ops(_inference_ir(program, {"alias_drop"}))


def test_cli_rejects_an_unknown_workaround(monkeypatch, capsys):
    from harness.cli import main

    monkeypatch.setenv(NO_WORKAROUND_ENV, "")
    assert main(["bisect", "--case", "x", "--step", "decoder", "--backend", "eager", "--no-workaround", "nope"]) == 2
    assert "unknown workaround" in capsys.readouterr().err


# ---- the COMPILE_ERROR bisection ----------------------------------------------------------------------

class _AliasInTheMiddle(torch.nn.Module):
    """Float ops around an identity slice of a buffer, which exports as aten.alias."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("table", torch.randn(1, 16, 8))

    def forward(self, x):
        h = torch.relu(self.lin(x))
        t = self.table[:, :16]
        return torch.tanh(h + t) * 2


@pytest.mark.slow
def test_compile_error_bisection_names_the_op_the_converter_lacks(tmp_path, monkeypatch, no_workaround):
    """~2-5 min (each probe converts in a child): with alias_drop off, coremltools cannot convert the
    program; the error search names the alias node (not the ops that merely contain it), the window
    is that one op, and the bundle's repro.py exits 1 alone (the converter raises)."""
    pytest.importorskip("coremltools")
    from harness.bisect import Bisector
    from harness.verdict import Tolerance

    monkeypatch.setenv("KOKORO_PARITY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    no_workaround("alias_drop")
    torch.manual_seed(0)
    x = torch.randn(1, 16, 8)
    torch.export.save(torch.export.export(_AliasInTheMiddle().eval(), (x,)), str(tmp_path / "p.pt2"))
    result = Bisector(tmp_path / "p.pt2", "alias-in-the-middle", [x], "coreml-fp32", Tolerance(), "decoder",
                      tmp_path / "reports", "alias-coreml", depth=0, errors_count=True).run(verify=True)
    assert result["status"] == "localized", result.get("message")
    first = result["first_op"]
    assert (first["node"], first["op"], first["status"]) == ("alias", "aten.alias.default", "compile_error")
    assert "Unsupported fx node alias" in first["why"] and "self.table[:, :16]" in first["source"]
    assert result["window"] == {"label": "alias", "n_ops": 1, "status": "compile_error"}
    repro = result["repro"]
    assert repro["exit_code"] == 1 and repro["reproduces"], repro
    text = (Path(repro["path"]) / "repro.py").read_text()
    assert "DISABLED = ['alias_drop']" in text and "harness" not in text.split('"""', 2)[2]


def test_a_malformed_catalog_entry_is_one_error_naming_the_defect_and_the_field(tmp_path):
    """The catalog is data: a typo in an entry (an unknown check, a kind that is none) names the
    file, the defect and the field, instead of failing later inside a bundle."""
    good = yaml.safe_load(upstream.catalog.CATALOG.read_text())
    for field, value in (("check", "check_nothing"), ("kind", "slow"), ("program", 3)):
        bad = {**good, "defects": [dict(good["defects"][0], **{field: value})]}
        path = tmp_path / "catalog.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ValueError, match=rf"catalog.yaml: defect coremltools-alias: field {field}"):
            upstream.load_catalog(path)
    searched, defects = upstream.load_catalog(upstream.catalog.CATALOG)
    assert [d.name for d in defects] == [d.name for d in upstream.DEFECTS] and searched == upstream.SEARCHED


def test_a_full_regeneration_keeps_the_sections_other_commands_write(tmp_path):
    """`make upstream` rewrites the catalog's table; the rewrites' bundles' section after it (written
    by `kokoro-parity run --rewrite`, not by the catalog) stays, here and in the shipped README."""
    from harness.upstream.bundle import written_elsewhere

    readme = tmp_path / "README.md"
    readme.write_text("# Upstream repro bundles\n\n| bundle |\n| --- |\n| [a](a/) |\n\n## Rewrites\n\n| [b](b/) |\n")
    assert written_elsewhere(readme) == "\n## Rewrites\n\n| [b](b/) |\n"
    assert written_elsewhere(tmp_path / "none.md") == ""
    shipped = written_elsewhere(DOCS / "README.md")
    assert "[mlx-audio-albert-gelu](mlx-audio-albert-gelu/)" in shipped and "[mlx-mean-float32]" in shipped
    for name in ("mlx-audio-albert-gelu", "mlx-mean-float32"):
        assert {"repro.py", "REPORT.md"} <= {p.name for p in (DOCS / name).iterdir()}
