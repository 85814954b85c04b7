"""SIGTERM stops the harness's main process as Ctrl-C does (harness.plumbing.stopping): `kokoro-parity`
and a pytest run with the plugin each remove what they were holding in a temporary directory, say
they stopped, and go no further."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def started(cmd: list[str], ready: Path, cwd: Path) -> subprocess.Popen:
    """`cmd` started, once it has written `ready` (the path of the temporary directory it holds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate(timeout=30)
    return proc


HOLD = """
    import tempfile, time
    from pathlib import Path
    with tempfile.TemporaryDirectory(prefix="kokoro-parity-chain-", dir={tmp!r}) as where:
        (Path(where) / "0.npy").write_bytes(b"x" * 1000)
        Path({ready!r}).write_text(where)
        time.sleep(120)
"""


def test_kokoro_parity_stopped_by_sigterm_removes_its_temporary_directory_and_exits_143(tmp_path):
    """The command's work (here a stand-in for `harness.commands`, so the child starts in a blink)
    holds a temporary directory; SIGTERM removes it and ends the command with 128 + 15."""
    ready = tmp_path / "ready"
    body = textwrap.indent(textwrap.dedent(HOLD.format(tmp=str(tmp_path), ready=str(ready))), "    ")
    script = ("import sys, types\n"
              f"def dispatch(args):\n{body}\n"
              "sys.modules['harness.commands'] = types.SimpleNamespace(dispatch=dispatch)\n"
              "from harness.cli import main\n"
              "sys.exit(main(['backends']))\n")
    proc = started([sys.executable, "-c", script], ready, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "kokoro-parity: stopped (SIGTERM)" in err and "Traceback" not in err
    assert not Path(ready.read_text()).exists()


def test_a_pytest_run_stopped_by_sigterm_removes_its_temporary_directory_and_runs_nothing_more(tmp_path):
    """pytest with the plugin: SIGTERM is an interruption (exit 2, as Ctrl-C), the running test's
    temporary directory is removed and the next test does not start."""
    ready = tmp_path / "ready"
    (tmp_path / "test_held.py").write_text(
        "from pathlib import Path\n\n\ndef test_holds():\n"
        + textwrap.indent(textwrap.dedent(HOLD.format(tmp=str(tmp_path), ready=str(ready))), "    ")
        + f"\n\ndef test_after():\n    Path({str(tmp_path / 'after')!r}).write_text('ran')\n")
    proc = started([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "test_held.py"], ready, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, out + err
    assert "Stopped: SIGTERM" in out + err, out + err
    assert not Path(ready.read_text()).exists() and not (tmp_path / "after").exists()
