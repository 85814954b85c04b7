"""kokoro-parity as a porter uses it: installed from a wheel into a fresh virtualenv, run by pytest in
the porter's own project with a case of their own (issue 14, section 5).

The wheel is built from this checkout (no build isolation: offline) and installed without its
dependencies; the fresh venv reaches them through a path entry to this venv's site-packages (a
plain path line: this venv's own `.pth` files, among them the editable install of this checkout,
are not processed), so the harness that runs is the wheel's, with its package data only."""
from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from tests.unit.conftest import shared_references

REPO = Path(__file__).resolve().parents[2]


def run(cmd, cwd=None, env=None, timeout=900) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_an_installed_wheel_runs_a_users_own_case(tmp_path):
    """~1.5 min: build, install, then `pytest --backend=eager --case tiny` in a project of its own."""
    from harness.cases import write_case

    dist = tmp_path / "dist"
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", dist, REPO])
    assert built.returncode == 0, built.stderr[-2000:]
    wheel = next(dist.glob("kokoro_parity-*.whl"))
    venv = tmp_path / "venv"
    made = run([sys._base_executable, "-m", "venv", "--without-pip", venv])
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    site = Path(run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "kokoro_parity_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    installed = run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel])
    assert installed.returncode == 0, installed.stderr[-2000:]

    project = tmp_path / "my-port"
    (project / "tests").mkdir(parents=True)
    (project / "pyproject.toml").write_text(textwrap.dedent("""\
        [tool.pytest.ini_options]
        testpaths = ["tests"]
        kokoro_parity_cases = ["parity-cases"]
        """))
    (project / "tests" / "test_parity.py").write_text(textwrap.dedent("""\
        def test_parity(parity_item, check_parity):
            check_parity(parity_item)
        """))
    write_case(project / "parity-cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["KOKORO_PARITY_CACHE"] = str(shared_references(tmp_path / "cache"))  # the run's references: same content

    where = run([python, "-c", "import harness, harness.cases as c, harness.golden as g; print(harness.__file__); "
                 "print(sorted(x.id for x in c.load_cases())); "
                 "print(len(list(g.GOLDEN_DIR.glob('*/en_short/dynamic/*.npy'))), 'golden files')"], cwd=project, env=env)
    assert where.returncode == 0, where.stderr[-2000:]
    assert str(site) in where.stdout and str(REPO) not in where.stdout  # the wheel's harness, not this checkout
    assert "'en_short'" in where.stdout and "'ja'" in where.stdout  # the shipped cases are package data
    assert int(where.stdout.split(" golden files")[0].split()[-1]) >= 8  # and their golden store

    result = run([python, "-m", "pytest", "--backend=eager", "--case", "tiny", "--mode", "dynamic",
                  "--weights", "random:0", "-k", "bert and not encoder", "--report-dir=reports", "-p", "no:cacheprovider"],
                 cwd=project, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "1 passed" in result.stdout and (project / "reports" / "records").is_dir()

    (project / "parity-cases" / "tiny.yaml").write_text(
        (project / "parity-cases" / "tiny.yaml").read_text().replace("voice: jf_alpha", "voice: af_nobody"))
    bad = run([python, "-m", "pytest", "--backend=eager", "--case", "tiny", "--weights", "random:0", "-p",
               "no:cacheprovider"], cwd=project, env=env)
    assert bad.returncode == 4, bad.stdout[-2000:]  # a usage error, before collection
    assert "tiny.yaml" in bad.stderr and "field 'voice'" in bad.stderr and "Traceback" not in bad.stderr + bad.stdout
