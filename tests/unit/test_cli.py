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

    from harness.plumbing import cache

    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    path, _ = cache.get_or_build("programs", "k", lambda tmp: (tmp / "blob").write_bytes(b"x" * 4096))
    os.utime(path / ".complete", (time.time() - 7200,) * 2)
    assert main(["cache", "info"]) == 0
    assert "programs" in capsys.readouterr().out
    assert main(["cache", "prune", "--max-gb", "0"]) == 0
    assert "removed 1 entries" in capsys.readouterr().out
    assert not path.exists()


def test_table_joins_report_dirs_in_pipeline_and_registry_order(tmp_path, capsys):
    from harness.record import Record
    from harness.verdict import Verdict

    def rec(step, backend, verdict, rel=1e-6):
        return Record(case="ja", step=step, backend=backend, mode="static", verdict=verdict,
                      reason="" if verdict in (Verdict.PASS, Verdict.FAIL) else "why; more",
                      metrics={"y": {"rel_l2": rel, "floor_ratio": 1.5}})

    rec("generator", "tvm", Verdict.PASS).write(tmp_path / "a" / "records")
    nan = rec("decoder", "tvm", Verdict.FAIL, rel=float("nan"))
    nan.metrics["y"]["nan_rate"] = 1.0
    nan.write(tmp_path / "a" / "records")
    rec("bert", "xnnpack", Verdict.CRASHED).write(tmp_path / "a" / "records")
    rec("bert", "xnnpack", Verdict.PASS).write(tmp_path / "b" / "records")  # the later dir wins
    Record(case="en_short", step="bert", backend="tvm", mode="static", verdict=Verdict.PASS).write(tmp_path / "b" / "records")
    assert main(["table", "--report-dir", str(tmp_path / "a"), "--report-dir", str(tmp_path / "b"),
                 "--case", "ja"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[5:] == ["xnnpack", "tvm"]  # the registry's order, not the alphabet
    assert [line.split()[1] for line in lines[2:]] == ["bert", "decoder", "generator"]  # the pipeline's order
    assert "FAIL NaN 100%" in lines[3]
    assert "PASS rel 1.00e-06 (1.5x floor)" in lines[2] and "CRASHED" not in "\n".join(lines)
    assert "not run" in lines[2] and "en_short" not in "\n".join(lines)
    assert main(["table", "--report-dir", str(tmp_path / "a"), "--backend", "tvm"]) == 0
    assert "xnnpack" not in capsys.readouterr().out


@pytest.mark.parametrize("command", ["run", "nightly"])
def test_run_and_nightly_pass_time_and_memory_limits_to_the_session(command, tmp_path, monkeypatch):
    """`nightly` takes `run`'s options: its limits must reach the Session as `run`'s do."""
    from harness import runner

    seen = {}

    class Stop(Exception):
        pass

    def session(config):
        seen.update(limits=runner.Limits.parse(list(config.time_limit), config.memory_limit))
        raise Stop

    monkeypatch.setattr(runner.Session, "from_config", session)
    with pytest.raises(Stop):
        main([command, "--backend=eager", "--weights=random:0", f"--report-dir={tmp_path}",
              "--time-limit", "compile=12", "--time-limit", "run=34", "--memory-limit", "5.5"])
    limits = seen["limits"]
    assert (limits.export_s, limits.compile_s, limits.run_s, limits.memory_gb()) == (900, 12, 34, 5.5)


def test_a_command_that_builds_the_model_prints_no_third_party_warning(tmp_path):
    """torch warns about Kokoro's weight_norm and LSTM dropout whenever a KModel is built (`python -W
    default -m harness.cli weights --weights random:0` shows both), and torchao about its missing
    kernels when executorch is imported: the CLI keeps all of it out of its output."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.unit.conftest import child_pytest_env

    root = Path(__file__).resolve().parents[2]
    env = child_pytest_env(PYTHONPATH=str(root), KOKORO_PARITY_CACHE=str(tmp_path / "cache"))
    cmd = ["-m", "harness.cli", "weights", "--weights", "random:0"]
    out = subprocess.run([sys.executable, *cmd], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0 and "random-seed0" in out.stdout, out.stderr[-2000:]
    assert not [line for line in out.stderr.splitlines() if "Warning" in line or "Failed to load" in line], out.stderr


@pytest.mark.parametrize("asked", [False, True])
def test_kokoros_torch_warnings_are_filtered_unless_the_user_asks_for_warnings(asked, monkeypatch):
    """The filter is on torch's module and the category; `python -W ...` (sys.warnoptions) wins."""
    import sys
    import warnings

    from harness import quiet

    monkeypatch.setattr(sys, "warnoptions", ["default"] if asked else [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        quiet.quiet_warnings()
        warnings.warn_explicit("`torch.nn.utils.weight_norm` is deprecated", FutureWarning, "weight_norm.py", 144,
                               module="torch.nn.utils.weight_norm")
        warnings.warn_explicit("dropout option adds dropout after all but last recurrent layer", UserWarning,
                               "rnn.py", 1011, module="torch.nn.modules.rnn")
        warnings.warn_explicit("a warning of the user's own", UserWarning, "mine.py", 1, module="mine")
    assert [str(w.message)[:10] for w in caught] == (["`torch.nn.", "dropout op", "a warning "] if asked
                                                      else ["a warning "])


def test_nightly_shows_each_items_phases_on_stderr(tmp_path, monkeypatch, capsys):
    """In a CI log, the nightly says what it is doing while an item runs, as `run` does."""
    from types import SimpleNamespace

    from harness import commands, progress
    from harness.plumbing.cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(progress, "_ledger", None)

    class FakeSession:
        cases, profile, counts = {"tiny": None}, None, {}

        @classmethod
        def from_config(cls, config):
            return cls()

        def target_for(self, name):
            pass

        def close(self):
            pass

        def items(self, backends, steps, modes):
            return [SimpleNamespace(id="tiny-decoder-eager-dynamic", run=lambda session: session.run_item())]

        def run_item(self):
            return self.run(SimpleNamespace(id="tiny-decoder-eager-dynamic"))

        def run(self, item):
            with progress.phase("running"):
                return item

    def fake_nightly(records, history_dir, **kwargs):
        assert [r.id for r in records] == ["tiny-decoder-eager-dynamic"]
        return SimpleNamespace(run=SimpleNamespace(upstream=[]), problems=[], regressions=[], summary=lambda: "")

    # `commands` binds both names at import: patched there (patched in their home modules, the real
    # nightly of the default model ran for an hour in CI and failed only at the end)
    monkeypatch.setattr(commands, "Session", FakeSession)
    monkeypatch.setattr(commands, "nightly", fake_nightly)
    assert main(["nightly", "--backend=eager", f"--report-dir={tmp_path}", "--no-upstream"]) == 0
    err = capsys.readouterr().err
    assert "kokoro-parity: running tiny-decoder-eager-dynamic ..." in err, err
    assert "kokoro-parity: running tiny-decoder-eager-dynamic: done in" in err, err


def test_bad_input_is_one_line_and_a_harness_defect_keeps_its_traceback(monkeypatch, capsys):
    """What the user gave (a UsageError: an unknown step, a bad field) is one `error:` line and exit
    2; a ValueError or KeyError from inside the harness is a bug, not bad input: it propagates
    with its traceback instead of reading as the user's mistake."""
    from harness import commands
    from harness.plumbing.errors import UnknownName
    from harness.steps import get_step

    with pytest.raises(UnknownName) as bad:
        get_step("decodr")
    assert isinstance(bad.value, KeyError) and str(bad.value).startswith("unknown step 'decodr'")  # no KeyError quotes

    monkeypatch.setattr(commands, "dispatch", lambda args: get_step("decodr"))
    assert main(["weights"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"kokoro-parity: error: {bad.value}"]
    for internal in (ValueError("shape mismatch inside the harness"), KeyError("internal")):
        def boom(args, e=internal):
            raise e
        monkeypatch.setattr(commands, "dispatch", boom)
        with pytest.raises(type(internal)):
            main(["weights"])


def test_a_stopped_command_closes_its_session_and_exits_as_ctrl_c(tmp_path, monkeypatch, capsys):
    """`bisect` (as `nightly`) opens a Session it did not close itself: stopped half way, the command
    still closes it (a remote target's SSH connection and socket directory, the warm worker)."""
    from harness import runner

    closed = []
    monkeypatch.setattr(runner.Session, "close", lambda self: closed.append(self))
    monkeypatch.setattr(runner.Item, "run", lambda self, session: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main(["bisect", "--case", "en_short", "--step", "decoder", "--backend", "eager",
                 f"--report-dir={tmp_path}"]) == 130
    assert len(closed) == 1 and "kokoro-parity: stopped (KeyboardInterrupt)" in capsys.readouterr().err
