"""docs/backend-contract.md, kept: a minimal backend written outside this package, on the public
API alone, compiles and runs in child jobs, keys its artifacts by its configuration (`version()`),
is bisected like a built-in one, and its repro bundle exits 2 ("cannot run here") when it gives no
standalone runner, 1 ("reproduced") when it does."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from harness.backends import EXTRA_ENV, get_backend
from harness.plumbing.cache import CACHE_ENV

REPO = Path(__file__).resolve().parents[2]

OUTSIDE_BACKEND = '''
"""A third-party backend: PyTorch, with every output scaled by $MINIMAL_SCALE (its 'bug')."""
import os
import shutil
from pathlib import Path

from harness.backends import Backend


class MinimalBackend(Backend):
    name = "minimal"
    requires = ("torch",)
    artifact_name = "program.pt2"
    description = "the contract's minimal backend"

    def version(self) -> str:  # part of the artifact cache key: the configuration belongs here
        return f"{super().version()},scale={os.environ.get('MINIMAL_SCALE', '1')}"

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        shutil.copyfile(program_path, out_dir / self.artifact_name)
        (out_dir / "scale.txt").write_text(os.environ.get("MINIMAL_SCALE", "1"))
        return {"scale": os.environ.get("MINIMAL_SCALE", "1")}

    def run(self, artifact_path: Path, inputs: list) -> list:
        import torch

        scale = float((artifact_path.parent / "scale.txt").read_text())
        with torch.no_grad():
            out = torch.export.load(str(artifact_path)).module()(*inputs)
        return [o * scale for o in (out if isinstance(out, (tuple, list)) else [out])]


class MinimalWithRepro(MinimalBackend):
    name = "minimal-repro"

    def repro_source(self) -> str:
        scale = float(os.environ.get("MINIMAL_SCALE", "1"))
        return (f"def run_backend(program, inputs):\\n"
                f"    with torch.no_grad():\\n"
                f"        out = program.module()(*inputs)\\n"
                f"    return [o * {scale!r} for o in (out if isinstance(out, (tuple, list)) else [out])]\\n")
'''


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, x):
        return torch.tanh(self.conv(x)) * 0.5


@pytest.fixture
def outside(tmp_path, monkeypatch):
    """The backend module in a directory of its own, registered by KOKORO_PARITY_EXTRA_BACKENDS
    and importable by the child jobs through PYTHONPATH, as docs/backend-contract.md says."""
    pkg = tmp_path / "site"
    pkg.mkdir()
    (pkg / "minimal_backend.py").write_text(textwrap.dedent(OUTSIDE_BACKEND))
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(pkg), str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv(EXTRA_ENV, "minimal=minimal_backend:MinimalBackend,minimal-repro=minimal_backend:MinimalWithRepro")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    torch.manual_seed(0)
    x = torch.randn(1, 4, 16)
    program = torch.export.export(_Tiny().eval(), (x,))
    torch.export.save(program, str(tmp_path / "tiny.pt2"))
    return tmp_path / "tiny.pt2", [x]


def test_the_configuration_is_part_of_the_artifact_key(outside, monkeypatch):
    monkeypatch.setenv("MINIMAL_SCALE", "1")
    clean = get_backend("minimal").artifact_key("program-key")
    monkeypatch.setenv("MINIMAL_SCALE", "1.5")
    assert get_backend("minimal").artifact_key("program-key") != clean


@pytest.mark.parametrize("backend, exit_code, says", [
    ("minimal", 2, "gives no standalone runner"),
    ("minimal-repro", 1, "REPRODUCED"),
])
def test_an_outside_backend_is_bisected_and_bundled(outside, monkeypatch, tmp_path, backend, exit_code, says):
    """Its wrong outputs are localized to the program's first op (every cut is scaled), and the
    bundle's repro.py, run alone, says what it can: 2 without a runner, 1 with one."""
    from harness.bisect import Bisector
    from harness.verdict import Tolerance

    monkeypatch.setenv("MINIMAL_SCALE", "1.5")
    program, inputs = outside
    result = Bisector(program, f"tiny-{backend}", inputs, backend, Tolerance(), "decoder", tmp_path / "reports",
                      f"tiny-{backend}", depth=0).run(verify=False)
    assert result["status"] == "localized", result.get("message")
    assert result["first_op"]["node"] == "conv1d" and result["first_op"]["kind"] == "local"
    bundle = Path(result["repro"]["path"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", EXTRA_ENV)}
    p = subprocess.run([sys.executable, "repro.py"], cwd=bundle, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == exit_code, p.stdout + p.stderr
    assert says in p.stdout
