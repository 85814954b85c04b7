"""A run stopped by SIGTERM or SIGHUP ends as one stopped by Ctrl-C: an exception in the main
process (the CLI's, pytest's), so `finally` blocks and context managers run (temporary directories
removed, an item's record written with where it stopped) and `atexit` stops the warm worker. The
default disposition of these signals ends the process at once and leaves all of that behind.

Only the harness's main process installs the handler: job children (harness.plumbing.jobs,
harness.plumbing.worker) keep the default, so a child killed by a signal is its job's outcome.
"""
from __future__ import annotations

import signal
import threading

SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """A stop signal, raised where the main thread is. A KeyboardInterrupt, so pytest ends the
    session as on Ctrl-C (a SystemExit raised inside a test is that test's failure, and the run
    would go on to the next item)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise(signum, frame) -> None:
    raise Stopped(signum)


def install() -> dict:
    """Turn SIGTERM and SIGHUP into `Stopped` where their disposition is the default (`nohup`, or an
    embedding program's handler, stays); the previous handlers, for `restore`. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _raise) for s in SIGNALS if signal.getsignal(s) is signal.SIG_DFL}


def restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def exit_status(exc: BaseException) -> int:
    """A shell's status for a process ended by this signal (128 + its number; Ctrl-C: 130)."""
    return 128 + (exc.signum if isinstance(exc, Stopped) else signal.SIGINT)


def cause(exc: BaseException) -> str:
    """What stopped a run, as a record's reason says it: the signal, else the exception's first line."""
    if isinstance(exc, Stopped):
        return exc.args[0]
    text = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
    return text.splitlines()[0][:500]
