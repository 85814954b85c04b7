"""benchmarks/code_shape.py (`make lint`): its counts on a small tree written here, and `--strict`."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LONG = "def long_one():\n" + "".join(f"    x{i} = {i}\n" for i in range(85)) + "    return x0\n"
INNER = '''\
import os


def f():
    import json
    # onnxruntime is an optional runtime: imported when a stage runs
    import onnxruntime
    from harness import plumbing  # a cycle: plumbing imports this module
    s = "# a cycle, in a string: not a comment"
    from . import sibling  # noted
    import re
    return json, onnxruntime, plumbing, sibling, s, re


class C:
    def method(self):
        def inner():
            import math  # child process entry
            return math
        return inner
'''
FACE = '''\
from harness.runner import Item


def run(item, things):
    if isinstance(item, Item):
        return 1
    if isinstance(item, (int, runner.PortItem)):
        return 2
    return isinstance(things, list)
'''


def code_shape():
    spec = importlib.util.spec_from_file_location("code_shape", ROOT / "benchmarks" / "code_shape.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree(root: Path, readme_lines: int) -> Path:
    (root / "harness" / "sub").mkdir(parents=True)
    (root / "docs").mkdir()
    (root / "harness" / "long.py").write_text(LONG)
    (root / "harness" / "sub" / "inner.py").write_text(INNER)
    (root / "harness" / "cli.py").write_text(FACE)
    (root / "harness" / "other.py").write_text(FACE)  # not a face: its isinstance is not counted
    (root / "harness" / "sub" / "notes.yaml").write_text("why: see issue #12\n")
    (root / "docs" / "a.md").write_text("Fixed in issue 7 and Issues 8.\nan issue, 9 of them\n")
    (root / "README.md").write_text("line\n" * readme_lines)
    return root


def test_the_counts_on_a_small_tree(tmp_path):
    shape = code_shape()
    figures = shape.measure(tree(tmp_path, 3))
    expected_lines = sum(len(s.splitlines()) for s in (LONG, INNER, FACE, FACE))
    assert figures["harness_lines"] == expected_lines
    assert figures["long_functions"] == [("harness/long.py", 1, "long_one", 87)]
    assert [(n, why) for _, n, why in figures["inner_imports"]] == [
        (5, False), (7, True), (8, True), (10, False), (11, False), (18, True)]
    assert figures["isinstance"] == [("harness/cli.py", 5), ("harness/cli.py", 7)]
    assert figures["readme_lines"] == 3
    assert sorted((f, n) for f, n, _ in figures["issue_mentions"]) == [
        ("docs/a.md", 1), ("docs/a.md", 1), ("harness/sub/notes.yaml", 1)]
    lines, met = shape.report(figures)
    assert not met
    assert "6 (3 say why)" in lines[2] and lines[2].endswith("NOT MET")
    assert "harness/long.py:1 long_one (87 lines)" in "\n".join(lines)


def test_it_prints_and_fails_only_when_strict(tmp_path, capsys):
    shape = code_shape()
    root = tree(tmp_path, 251)
    assert shape.main(["--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert "README.md lines" in out and "NOT MET" in out
    assert shape.main(["--root", str(root), "--strict"]) == 1
    capsys.readouterr()
    clean = tmp_path / "clean"
    (clean / "harness").mkdir(parents=True)
    (clean / "harness" / "a.py").write_text("import os\n\n\ndef f():\n    return os\n")
    (clean / "README.md").write_text("# x\n")
    assert shape.main(["--root", str(clean), "--strict"]) == 0
    assert "NOT MET" not in capsys.readouterr().out
