"""Sharding and parallel runs give the same items and verdicts as a plain run, and a parallel run
exports each program once (a small matrix: the eager backend on a token step in both modes, two
programs in two groups, of the seeded random model's tiny case: what is checked is the plugin's
sharding, not the weights). The parallel run comes first, on a cache with no programs; the plain
run and the shards then read its programs (exporting nothing), so each program is exported once
in the whole test."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from tests.unit.conftest import child_pytest_env, shared_references

ROOT = Path(__file__).resolve().parents[2]
MATRIX = ["--weights=random:0", "--backend=eager", "--case=tiny", "-k", "bert_encoder and not golden",
          "-p", "no:logging"]


def pytest_run(tmp_path, name, cache, *extra):
    out = tmp_path / name
    env = child_pytest_env(KOKORO_PARITY_CACHE=str(cache))
    r = subprocess.run([sys.executable, "-m", "pytest", "tests/parity", *MATRIX, f"--cases-dir={tmp_path / 'cases'}",
                        f"--report-dir={out}", *extra],
                       cwd=ROOT, capture_output=True, text=True, timeout=2400, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, r.stdout


def verdicts(report_dir):
    return {p.stem: json.loads(p.read_text())["verdict"] for p in (Path(report_dir) / "records").glob("*.json")}


def exports(stdout):
    return int(re.search(r"work: exports (\d+)", stdout).group(1))


@pytest.mark.slow
def test_shards_and_workers_match_the_plain_run(tmp_path):
    from harness.cases import write_case

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    cache = shared_references(tmp_path / "cache")  # no programs: the workers export everything
    parallel, out = pytest_run(tmp_path, "parallel", cache, "-n", "2")
    assert "kokoro-parity summary" in out and exports(out) == 2  # each program exported once

    plain, out = pytest_run(tmp_path, "plain", cache)  # the workers' programs, read back
    assert len(verdicts(plain)) == 2 and exports(out) == 0
    assert verdicts(parallel) == verdicts(plain)

    one, _ = pytest_run(tmp_path, "one", cache, "--shard", "1/2")
    two, _ = pytest_run(tmp_path, "two", cache, "--shard", "2/2")
    assert verdicts(one) and verdicts(two) and not set(verdicts(one)) & set(verdicts(two))
    merged = tmp_path / "merged"  # the CLI's merge, in this process (a child would only pay its imports again)
    assert cli.main(["merge", str(one), str(two), "--out", str(merged)]) == 0
    assert verdicts(merged) == verdicts(plain)
