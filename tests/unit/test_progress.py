"""Progress (harness.progress): a run says what it is doing, as plain lines in a log, on one
updating line in a terminal, and not at all in `-q`; the shortest case runs first."""
from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import progress
from tests.unit.conftest import child_pytest_env

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from harness.plumbing.cache import CACHE_ENV

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(progress, "_ledger", None)
    return tmp_path / "cache"


def test_plain_lines_name_the_phase_its_item_and_last_time(cache):
    lines = []
    with progress.displayed(progress.PlainLines(lines.append)), progress.item("en_short-decoder-xnnpack-static"):
        with progress.phase("lowering"):
            pass
        with progress.phase("lowering"):
            pass
        with progress.phase("cached", active=False):  # a cache hit: nothing to say
            pass
    assert lines[0] == "kokoro-parity: lowering en_short-decoder-xnnpack-static ..."
    assert re.fullmatch(r"kokoro-parity: lowering en_short-decoder-xnnpack-static: done in \d\.\d s", lines[1])
    assert re.fullmatch(r"kokoro-parity: lowering en_short-decoder-xnnpack-static \(last \d\.\d s\) \.\.\.", lines[2])
    assert len(lines) == 4 and not any("cached" in line for line in lines)


def test_plain_lines_say_a_long_phase_is_still_working_and_stop_with_it(cache):
    """A log (CI, a pipe) hears from a running phase after every `every_s` without a line, with the
    phase's elapsed time; nothing more once the last phase ended."""
    import threading
    import time

    lines = []
    with progress.displayed(progress.PlainLines(lines.append, every_s=0.1)), progress.item("x"):
        with progress.phase("judging"):
            start = time.monotonic()
            with progress.phase("references", subject="en_long static float64") as p:
                p.update("decoder")
                time.sleep(0.55)
            lasted = time.monotonic() - start  # longer than asked on a busy machine
            inner = lines[2:-1]  # between the two start lines and the inner end line
            time.sleep(0.35)
        outer = lines[len(inner) + 3:]
        ended = len(lines)
    time.sleep(0.3)
    assert len(lines) == ended and lines[-1].startswith("kokoro-parity: judging x: done in")
    assert 3 <= len(inner) <= int(lasted / 0.1), lines  # at most one per 0.1 s of the phase
    assert all(re.fullmatch(r"kokoro-parity: judging x > references en_long static float64: decoder  "
                            r"\d\.\d s, still working", w) for w in inner), inner
    assert 2 <= len(outer[:-1]) <= 3 and all(re.fullmatch(r"kokoro-parity: judging x  \d\.\d s, still working", w)
                                             for w in outer[:-1]), outer
    assert not any(t.name == "kokoro-parity-progress" for t in threading.enumerate())


def test_last_seconds_come_from_the_cache_across_processes(cache):
    with progress.phase("references", subject="ja static float64"):
        pass
    code = ("from harness import progress; "
            "print(progress.last_seconds('references ja static float64'), progress.last_seconds('never'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env=child_pytest_env(KOKORO_PARITY_CACHE=str(cache))).stdout.split()
    assert float(out[0]) >= 0 and out[1] == "None"


def test_a_failing_phase_says_so_and_is_not_remembered(cache):
    lines = []
    with progress.displayed(progress.PlainLines(lines.append)), pytest.raises(RuntimeError):
        with progress.phase("exporting", subject="decoder"):
            raise RuntimeError("boom")
    assert lines[-1].startswith("kokoro-parity: exporting decoder: stopped in")
    assert progress.last_seconds("exporting decoder") is None


def test_status_text_shows_the_inner_phase_in_its_context():
    outer = progress.Phase("en_short-decoder-eager-dynamic")
    inner = progress.Phase("references", "en_short static float64", last_s=125.0)
    inner.detail = "decoder"
    text = progress.status_text([outer, inner])
    assert re.fullmatch(r"en_short-decoder-eager-dynamic > references en_short static float64: decoder  "
                        r"\d\.\d s \(last 2:05\)", text), text
    assert progress.clock(3725) == "1:02:05" and progress.clock(42.4) == "42 s"


def test_updating_line_redraws_while_a_phase_runs_and_erases_at_the_end(cache):
    drawn, erased = [], []
    line = progress.UpdatingLine(drawn.append, lambda: erased.append(True), interval_s=0.05)
    import time

    with progress.displayed(line), progress.phase("lowering", subject="x"):
        time.sleep(0.3)
        assert not erased
    assert len(drawn) >= 3 and all(d.startswith("lowering x") for d in drawn)  # the ticker redrew it
    assert erased == [True]


def test_pytest_line_goes_after_pytests_text_and_gives_it_back():
    from _pytest._io import TerminalWriter

    from harness.plugin import _PytestLine
    import contextlib

    out = io.StringIO()
    tw = TerminalWriter(out)
    tw.fullwidth = 100
    tw.write("tests/parity/test_parity.py ..")
    line = _PytestLine(tw, contextlib.nullcontext)
    line.draw("lowering en_short-decoder-xnnpack-static  3.0 s")
    line.draw("lowering en_short-decoder-xnnpack-static  4.0 s")
    line.erase()
    tw.write(".")
    text = out.getvalue()
    assert text.startswith("tests/parity/test_parity.py ..\x1b7 ")  # the cursor saved after pytest's dots
    assert text.endswith("\x1b8\x1b[K.")  # back where pytest left it, the status cleared, pytest goes on
    assert "4.0 s" in text and "\n" not in text

    out2 = io.StringIO()
    tw2 = TerminalWriter(out2)
    tw2.fullwidth = 60  # -v: the item's id leaves no room, the status takes the line and gives it back
    tw2.write("tests/parity/test_parity.py::test_parity[en_short-decoder-xnnpack-static] ")
    narrow = _PytestLine(tw2, contextlib.nullcontext)
    narrow.draw("lowering " + "x" * 100)
    narrow.erase()
    value = out2.getvalue()
    assert value.endswith("\r\x1b[Ktests/parity/test_parity.py::test_parity[en_short-decoder-xnnpack-static] ")
    assert "x" * 51 not in value  # clipped to the width


def test_a_step_s_references_show_a_phase_when_computed_and_none_when_read_again(cache, monkeypatch):
    """`StepReferences`: the first read of a step in a mode and dtype computes its references in
    that mode and dtype under one phase naming the step; a second read finds them in memory and
    shows nothing; the other dtype and mode are each computed when first read (a dynamic item never
    pays for the padded static bucket, a float32 read for the float64 run); another process's
    traces read them from the disk cache, showing nothing."""
    from types import SimpleNamespace

    from harness import reference

    computed = []

    def fake_step_references(model, traces, steps, modes, dtypes):
        computed.append((steps[0].name, *modes, *dtypes))
        with progress.phase("references", subject=f"{traces.case_id} {steps[0].name}"):
            return {(steps[0].name, mode, dtype): ({}, {"x": torch.zeros(1)}) for mode in modes for dtype in dtypes}

    monkeypatch.setattr(reference, "_step_references", fake_step_references)
    model, case = SimpleNamespace(digest="m" * 8), SimpleNamespace(id="tiny", digest="c" * 8)
    traces = SimpleNamespace(case_id="tiny")
    lines = []
    with progress.displayed(progress.PlainLines(lines.append)):
        refs = reference.StepReferences(model, case, traces)
        assert ("decoder", "dynamic", "float32") in refs
        refs[("decoder", "dynamic", "float32")]
        first = list(lines)
        refs[("decoder", "dynamic", "float32")]
        second = lines[len(first):]
        assert computed == [("decoder", "dynamic", "float32")]
        refs[("decoder", "dynamic", "float64")]
        assert refs.get(("decoder", "static", "float32")) is not None
        assert computed == [("decoder", "dynamic", "float32"), ("decoder", "dynamic", "float64"),
                            ("decoder", "static", "float32")] and len(lines) == len(first) + 4
        again = reference.StepReferences(model, case, traces)  # a new process's: the disk cache
        again[("decoder", "dynamic", "float64")]
        again[("decoder", "static", "float32")]
        third = lines[len(first) + 4:]
    assert first == ["kokoro-parity: references tiny decoder ...",
                     first[1]] and first[1].startswith("kokoro-parity: references tiny decoder: done in"), first
    assert second == [] and third == [] and len(computed) == 3


# ---- through pytest ---------------------------------------------------------------------------

def run_pytest(tmp_path, *args, reports="reports"):
    """The parity test file with the tiny case (`--cases-dir`), eager only."""
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_parity.py").write_text((ROOT / "tests" / "parity" / "test_parity.py").read_text())
    cmd = [sys.executable, "-m", "pytest", "tests", "-p", "no:cacheprovider", "--weights=random:0", "--case=tiny",
           f"--cases-dir={tmp_path / 'cases'}",
           "--backend=eager", "--mode=dynamic", "-k", "bert_encoder and not golden",
           f"--report-dir={tmp_path / reports}", *args]
    env = child_pytest_env(KOKORO_PARITY_CACHE=str(tmp_path / "cache"), PYTHONPATH=str(ROOT))
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=1800, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


@pytest.mark.slow
def test_a_first_run_shows_its_phases_in_a_log_and_quiet_shows_none(tmp_path):
    from harness.cases import write_case

    write_case(tmp_path / "cases", "tiny", "Hi.", "en-us", "jf_alpha", 8, 128, speed=4.0)
    out = run_pytest(tmp_path)  # not a terminal: plain lines
    for phase in ("loading the model random:0", "references: Kokoro's chain tiny", "references tiny bert_encoder",
                  "exporting bert_encoder tiny-bert_encoder-eager-dynamic",
                  "lowering tiny-bert_encoder-eager-dynamic", "running tiny-bert_encoder-eager-dynamic",
                  "judging tiny-bert_encoder-eager-dynamic"):
        assert f"kokoro-parity: {phase}" in out, out[-4000:]
    assert "1 passed" in out
    verdict = re.search(r"^tiny-bert_encoder-eager-dynamic: PASS rel \S+ \(\S+x floor\)$", out, re.M)
    assert verdict and verdict.start() < out.index("kokoro-parity summary"), out[-4000:]  # as the item ended
    # the one step's references (its mode's two dtypes) were computed, not every step's (the float64
    # vocoder of both modes)
    assert len(list((tmp_path / "cache" / "traces").glob("*/io.pt"))) == 2

    again = run_pytest(tmp_path, reports="again")  # warm: no export, no lowering to show
    assert "kokoro-parity: running tiny-bert_encoder-eager-dynamic (last" in again
    assert "kokoro-parity: exporting" not in again and "kokoro-parity: lowering" not in again
    assert "kokoro-parity: references" not in again  # read from the cache: nothing computed

    quiet = run_pytest(tmp_path, "-q")
    assert "kokoro-parity:" not in quiet and "1 passed" in quiet
    assert "kokoro-parity" not in run_pytest(tmp_path, "-p", "no:terminal")  # no reporter: nothing to draw on


def test_shortest_case_is_collected_first_and_the_eager_control_first_in_it():
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/parity", "--collect-only", "-q", "--backend=xnnpack",
                          "--backend=eager", "-k", "decoder"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                         env=child_pytest_env())
    ids = [line.split("[")[1].rstrip("]") for line in out.stdout.splitlines() if "::" in line]
    cases = [i.split("-")[0] for i in ids]
    first_of = {c: [i for i in ids if i.startswith(c + "-")] for c in set(cases)}
    assert all("-eager-" in i for c in first_of for i in first_of[c][:2]), ids  # both modes' controls, then XNNPACK
    from harness.cases import load_cases

    length = {c.id: len(c.phonemes) for c in load_cases()}
    assert cases and [length[c] for c in cases] == sorted(length[c] for c in cases), cases
    assert cases[0] == min(length, key=length.get)
