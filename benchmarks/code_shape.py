"""`make lint`: the code-shape targets of docs/design.md, each figure against its target.

Counted with `ast` and `tokenize` on the files as they are: Python lines under harness/, functions
over 80 lines (each with file:line and its length), imports inside function bodies in harness/
(and how many carry a comment saying why: an optional runtime, a child process's entry, a cycle),
`isinstance` on item kinds in the faces, README.md's lines, and issue numbers written into
harness/, docs/ and README.md. It prints; the exit status is 0 unless `--strict` is given and a
target is not met (then 1).
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_HARNESS_LINES = 15_000
MAX_FUNCTION_LINES = 80
MAX_INNER_IMPORTS = 40
MAX_README_LINES = 250
FACES = ("harness/cli.py", "harness/commands.py", "harness/plugin.py")
# A comment that says why an import waits for its function.
WHY = re.compile(r"optional|runtime|extra|child|entry|cycle|circular|lazy|slow|--help", re.I)
ISSUE = re.compile(r"\bissues?\s+#?\d+", re.I)
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".txt", ".in", ".html", ".toml", ".json", ".j2", ".js"}


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "harness").rglob("*.py") if "__pycache__" not in p.parts)


def comment_lines(source: str) -> set[int]:
    """The line numbers that carry a comment (tokenize: a '#' inside a string is not one)."""
    try:
        return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    except (tokenize.TokenError, SyntaxError):
        return set()


def _inner_imports(tree: ast.AST) -> list[ast.stmt]:
    """Import statements whose enclosing scope is a function (nested functions included)."""
    found: list[ast.stmt] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function:
                found.append(child)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(tree, False)
    return found


def _item_kind_isinstance(tree: ast.AST) -> list[int]:
    """Lines of `isinstance(x, SomethingItem)` (or a tuple holding one)."""
    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Tuple):
            return [n for elt in node.elts for n in names(elt)]
        if isinstance(node, ast.Name):
            return [node.id]
        if isinstance(node, ast.Attribute):
            return [node.attr]
        return []

    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance"
            and len(node.args) == 2 and any(n.endswith("Item") for n in names(node.args[1]))]


def measure(root: Path) -> dict:
    """Every figure, with the places behind it."""
    lines = 0
    long_functions: list[tuple[str, int, str, int]] = []
    inner: list[tuple[str, int, bool]] = []
    isinstances: list[tuple[str, int]] = []
    for path in python_files(root):
        rel = path.relative_to(root).as_posix()
        source = path.read_text(encoding="utf-8")
        lines += len(source.splitlines())
        tree = ast.parse(source, filename=rel)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append((rel, node.lineno, node.name, length))
        commented = comment_lines(source)
        text = source.splitlines()
        for node in _inner_imports(tree):
            above = node.lineno - 1
            why = any(n in commented and WHY.search(text[n - 1])
                      for n in (node.lineno, above) if 1 <= n <= len(text))
            inner.append((rel, node.lineno, why))
        if rel in FACES:
            isinstances += [(rel, n) for n in _item_kind_isinstance(tree)]
    readme = root / "README.md"
    readme_lines = len(readme.read_text(encoding="utf-8").splitlines()) if readme.is_file() else 0
    mentions: list[tuple[str, int, str]] = []
    texts = [p for d in ("harness", "docs") if (root / d).is_dir() for p in sorted((root / d).rglob("*"))
             if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts]
    for path in texts + ([readme] if readme.is_file() else []):
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for match in ISSUE.finditer(line):
                mentions.append((path.relative_to(root).as_posix(), number, match.group(0)))
    return {"harness_lines": lines, "long_functions": sorted(long_functions, key=lambda f: -f[3]),
            "inner_imports": inner, "isinstance": isinstances, "readme_lines": readme_lines,
            "issue_mentions": mentions}


def report(figures: dict) -> tuple[list[str], bool]:
    """The printed lines, and whether every target is met."""
    out: list[str] = []
    all_met = True

    def row(what: str, figure: str, target: str, met: bool) -> None:
        nonlocal all_met
        all_met &= met
        out.append(f"{what:<44} {figure:>14}   target {target:<22} {'met' if met else 'NOT MET'}")

    inner = figures["inner_imports"]
    unexplained = [(f, n) for f, n, why in inner if not why]
    row("Python lines under harness/", f"{figures['harness_lines']:,}", f"<= {MAX_HARNESS_LINES:,}",
        figures["harness_lines"] <= MAX_HARNESS_LINES)
    row(f"functions over {MAX_FUNCTION_LINES} lines", str(len(figures["long_functions"])), "none",
        not figures["long_functions"])
    row("imports inside functions in harness/", f"{len(inner)} ({len(inner) - len(unexplained)} say why)",
        f"<= {MAX_INNER_IMPORTS}, each says why", len(inner) <= MAX_INNER_IMPORTS and not unexplained)
    row("isinstance on item kinds in the faces", str(len(figures["isinstance"])), "none",
        not figures["isinstance"])
    row("README.md lines", str(figures["readme_lines"]), f"<= {MAX_README_LINES}",
        figures["readme_lines"] <= MAX_README_LINES)
    row("issue numbers in harness/, docs/, README", str(len(figures["issue_mentions"])), "none",
        not figures["issue_mentions"])
    if figures["long_functions"]:
        out.append("")
        out.append(f"functions over {MAX_FUNCTION_LINES} lines:")
        out += [f"  {f}:{n} {name} ({length} lines)" for f, n, name, length in figures["long_functions"]]
    if figures["isinstance"]:
        out.append("")
        out.append("isinstance on item kinds:")
        out += [f"  {f}:{n}" for f, n in figures["isinstance"]]
    if figures["issue_mentions"]:
        out.append("")
        out.append("issue numbers:")
        out += [f"  {f}:{n} {text!r}" for f, n, text in figures["issue_mentions"]]
    if inner:
        per_file: dict[str, int] = {}
        for f, _, _ in inner:
            per_file[f] = per_file.get(f, 0) + 1
        out.append("")
        out.append("imports inside functions, per file (most first):")
        out += [f"  {count:4d} {f}" for f, count in sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0]))]
    return out, all_met


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is not met")
    args = parser.parse_args(argv)
    lines, all_met = report(measure(args.root))
    print("\n".join(lines))
    return 1 if args.strict and not all_met else 0


if __name__ == "__main__":
    sys.exit(main())
