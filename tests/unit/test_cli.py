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


def test_cache_prune_and_info(tmp_path, monkeypatch, capsys):
    import os
    import time

    from harness import cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    path, _ = cache.get_or_build("programs", "k", lambda tmp: (tmp / "blob").write_bytes(b"x" * 4096))
    os.utime(path / ".complete", (time.time() - 7200,) * 2)
    assert main(["cache", "info"]) == 0
    assert "programs" in capsys.readouterr().out
    assert main(["cache", "prune", "--max-gb", "0"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not path.exists()
