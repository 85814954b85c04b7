"""Progress: what the harness is doing now, so that a long first run is not a silent one.

A cold `make parity` spends a quarter of an hour before its first verdict (weights rebuilt,
references in float64, lowerings), and pytest shows nothing while an item runs. Harness modules
say what they are doing with `with phase("lowering"):`; a display chosen by the face (the pytest
plugin, the CLI) shows it: one updating line on a terminal, plain lines in a log (and a line with
the elapsed time at least every 30 s while a phase runs), nothing in `-q`. Without a display a
phase costs a clock read.

The seconds of every finished phase are remembered in the cache (`<cache>/progress/seconds.json`,
by phase and subject), so a lowering shows how long the same one took last time.
"""
from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from rich.console import Console

from .plumbing import cache
from .plumbing.files import atomic_write_json

LEDGER = "seconds.json"


@dataclass
class Phase:
    """One piece of work being done: `name` (lowering), `subject` (the item or case it is for),
    `detail` (where inside it, updated as it goes), and what the same phase took last time."""

    name: str
    subject: str = ""
    detail: str = ""
    last_s: float | None = None
    started: float = field(default_factory=time.monotonic)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def label(self) -> str:
        return f"{self.name} {self.subject}".strip()

    def update(self, detail: str) -> None:
        """Say where inside the phase the work is (a step, a dtype); displays show it."""
        self.detail = detail
        if _display is not None:
            _display.update(self)


def clock(seconds: float) -> str:
    """12 s, 3:05, 1:02:09: short enough for a status line."""
    s = int(round(seconds))
    if s < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{s} s"
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def status_text(phases: list[Phase]) -> str:
    """The updating line: the innermost phase with its elapsed time (and last time), after the
    labels of the phases around it."""
    if not phases:
        return ""
    inner = phases[-1]
    outer = [p.label for p in phases[:-1] if p.label]
    text = " > ".join([*outer, inner.label])
    if inner.detail:
        text += f": {inner.detail}"
    text += f"  {clock(inner.elapsed_s)}"
    if inner.last_s is not None:
        text += f" (last {clock(inner.last_s)})"
    return text


# ---- the remembered seconds ------------------------------------------------------------------

_ledger: dict[str, float] | None = None


def _ledger_path():
    return cache.cache_dir() / "progress" / LEDGER


def last_seconds(key: str) -> float | None:
    """How long the phase `key` took when it last finished, from the cache; None if never."""
    global _ledger
    if _ledger is None:
        try:
            _ledger = json.loads(_ledger_path().read_text())
        except (OSError, ValueError):
            _ledger = {}
    value = _ledger.get(key)
    return float(value) if isinstance(value, (int, float)) else None


def remember_seconds(key: str, seconds: float) -> None:
    global _ledger
    path = _ledger_path()
    try:
        with cache.lock(path):
            try:
                ledger = json.loads(path.read_text())
            except (OSError, ValueError):
                ledger = {}
            ledger[key] = round(seconds, 2)
            atomic_write_json(path, ledger)
        _ledger = ledger
    except OSError:  # a read-only cache: progress is a courtesy, never an item's failure
        pass


# ---- the API harness modules call ------------------------------------------------------------

_display = None  # the face's display (set_display), or None: nothing shown
_stack: list[Phase] = []  # the open phases, outermost first
_items: list[str] = []  # the item being worked on (set by the face), the default subject


@contextlib.contextmanager
def item(label: str) -> Iterator[None]:
    """The item the phases inside are for (their default subject)."""
    _items.append(label)
    try:
        yield
    finally:
        _items.pop()


@contextlib.contextmanager
def phase(name: str, subject: str | None = None, active: bool = True) -> Iterator[Phase]:
    """Show `name` while the body runs and remember how long it took. `subject` defaults to the
    current item; `active=False` (a cache hit: nothing will be done) shows and remembers nothing."""
    p = Phase(name, _items[-1] if subject is None and _items else (subject or ""))
    if not active:
        yield p
        return
    key = p.label
    p.last_s = last_seconds(key)
    _stack.append(p)
    display = _display
    if display is not None:
        display.start(p, list(_stack))
    ok = False
    try:
        yield p
        ok = True
    finally:
        _stack.remove(p)
        seconds = p.elapsed_s
        if ok:
            remember_seconds(key, seconds)
        if display is not None:
            display.end(p, seconds, ok, list(_stack))


_say: Callable[[str], None] | None = None  # the face's way to a line the user must act on


def say(text: str) -> None:
    """A line the user must see and act on (a URL to open on a device): through the face's
    `set_say` (pytest: past its output capture, even with -q), else on stderr."""
    if _say is not None:
        _say(text)
    else:
        print(text, file=sys.stderr, flush=True)


def set_say(write_line: Callable[[str], None] | None) -> None:
    global _say
    _say = write_line


def set_display(display) -> None:
    """Install the display of this process (None: show nothing). The faces call this."""
    global _display
    if _display is not None and _display is not display:
        _display.close()
    _display = display


@contextlib.contextmanager
def displayed(display) -> Iterator[None]:
    set_display(display)
    try:
        yield
    finally:
        set_display(None)


# ---- displays ----------------------------------------------------------------------------------

class PlainLines:
    """One line when a phase starts and one when it ends: for logs (CI, xdist workers, pipes). While
    a phase runs, a line with its elapsed time after every `every_s` without one, so that a log
    never goes silent for longer (en_long's float64 references once said nothing for 5 minutes)."""

    def __init__(self, write_line: Callable[[str], None], prefix: str = "kokoro-parity: ",
                 every_s: float = 30.0) -> None:
        self.write_line = write_line
        self.prefix = prefix
        self.every_s = every_s
        self._lock = threading.Lock()  # the ticker writes too
        self._phases: list[Phase] = []
        self._last_line = time.monotonic()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def _write(self, text: str) -> None:
        self.write_line(f"{self.prefix}{text}")
        self._last_line = time.monotonic()

    def start(self, p: Phase, stack: list[Phase]) -> None:
        last = f" (last {clock(p.last_s)})" if p.last_s is not None else ""
        with self._lock:
            self._phases = stack
            self._write(f"{p.label}{last} ...")
        if self._thread is None:
            self._wake.clear()
            self._thread = threading.Thread(target=self._tick, name="kokoro-parity-progress", daemon=True)
            self._thread.start()

    def update(self, p: Phase) -> None:
        pass  # details would flood a log; the still-working lines show them

    def end(self, p: Phase, seconds: float, ok: bool, stack: list[Phase]) -> None:
        with self._lock:
            self._phases = stack
            self._write(f"{p.label}: {'done' if ok else 'stopped'} in {clock(seconds)}")
        if not stack:
            self.close()

    def _tick(self) -> None:
        while True:
            with self._lock:
                wait = self._last_line + self.every_s - time.monotonic()
                if wait <= 0 and self._phases:
                    try:
                        self._write(f"{status_text(self._phases)}, still working")
                    except (OSError, ValueError):  # a closed stream: progress is a courtesy, never a failure
                        return
                    wait = self.every_s
            if self._wake.wait(max(wait, 0.01)):
                return

    def close(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wake.set()
            thread.join()


class UpdatingLine:
    """One line, redrawn every `interval_s` while a phase is open (elapsed time moves), and
    taken away when the last phase ends. `draw(text)` and `erase()` own the terminal: the pytest
    plugin draws through pytest's terminal writer, the CLI through rich."""

    def __init__(self, draw: Callable[[str], None], erase: Callable[[], None], interval_s: float = 1.0) -> None:
        self.draw, self.erase, self.interval_s = draw, erase, interval_s
        self._lock = threading.Lock()
        self._phases: list[Phase] = []
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, p: Phase, stack: list[Phase]) -> None:
        with self._lock:
            self._phases = stack
            self.draw(status_text(stack))
        if self._thread is None:
            self._wake.clear()
            self._thread = threading.Thread(target=self._tick, name="kokoro-parity-progress", daemon=True)
            self._thread.start()

    def update(self, p: Phase) -> None:
        with self._lock:
            if self._phases:
                self.draw(status_text(self._phases))

    def end(self, p: Phase, seconds: float, ok: bool, stack: list[Phase]) -> None:
        if stack:
            with self._lock:
                self._phases = stack
                self.draw(status_text(stack))
            return
        self._stop()

    def _stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._wake.set()
            thread.join()
        with self._lock:
            if self._phases:
                self._phases = []
                self.erase()

    def _tick(self) -> None:
        while not self._wake.wait(self.interval_s):
            with self._lock:
                if self._phases:
                    self.draw(status_text(self._phases))

    def close(self) -> None:
        self._stop()


class RichLine:
    """The CLI's updating line: rich's status spinner on stderr, its text re-read at each refresh."""

    def __init__(self, console) -> None:
        self.console = console
        self._phases: list[Phase] = []
        self._status = None

    def __rich__(self) -> str:
        return status_text(self._phases)

    def start(self, p: Phase, stack: list[Phase]) -> None:
        self._phases = stack
        if self._status is None:
            self._status = self.console.status(self, refresh_per_second=2)
            self._status.start()

    def update(self, p: Phase) -> None:
        pass  # read at the next refresh

    def end(self, p: Phase, seconds: float, ok: bool, stack: list[Phase]) -> None:
        self._phases = stack
        if not stack:
            self.close()

    def close(self) -> None:
        status, self._status = self._status, None
        if status is not None:
            status.stop()


def for_cli(quiet: bool = False):
    """The CLI's display: rich's updating line on a terminal's stderr, plain lines on stderr
    otherwise (a log), nothing when `quiet`."""
    if quiet:
        return None

    console = Console(stderr=True)
    if console.is_terminal:
        return RichLine(console)

    return PlainLines(lambda line: print(line, file=sys.stderr, flush=True))
