"""The console script's argument handling (the commands themselves are tested where they live)."""
from __future__ import annotations

import pytest

from harness.cli import main


def test_bench_passes_its_arguments_to_the_benchmark_script(capsys):
    with pytest.raises(SystemExit) as e:  # argparse of benchmarks/bench.py, in a child process
        raise SystemExit(main(["bench", "--help"]))
    assert e.value.code == 0


def test_other_commands_reject_unknown_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cache", "info", "--bogus"])
    assert e.value.code == 2
    assert "--bogus" in capsys.readouterr().err
