"""The runtime checks of the upstream bundles: source that each standalone repro.py is cut from.

One file per runtime, each importing its runtime at the top as a script does. The harness never
imports them (the runtimes are optional): it reads them as source and pastes into a repro.py the
check a defect names, the functions it calls (across the files, `common.py` first) and the imports
those use. Each check is `check(program, inputs, expected) -> (exit code, message)`.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

HERE = Path(__file__).parent
FILES = ("common", "coreml_checks", "tvm_checks", "executorch_checks", "float16_checks")


@functools.cache
def _functions() -> dict[str, tuple[ast.FunctionDef, str]]:
    """name -> (its definition, its source), over the files in order."""
    found = {}
    for name in FILES:
        source = (HERE / f"{name}.py").read_text(encoding="utf-8")
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                found[node.name] = (node, ast.get_source_segment(source, node))
    return found


@functools.cache
def _imports() -> dict[str, str]:
    """bound name -> the import statement that binds it (the files' top-level absolute imports)."""
    bound = {}
    for name in FILES:
        for node in ast.parse((HERE / f"{name}.py").read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and not node.level
                                                and node.module != "__future__"):
                for a in node.names:
                    key = a.asname or a.name.split(".")[0]
                    bound[key] = ast.unparse(type(node)(**{**vars(node), "names": [a]}))
    return bound


def check_names() -> list[str]:
    return [n for n in _functions() if n.startswith("check_")]


def function_source(name: str) -> str:
    return _functions()[name][1]


def _needs(name: str, seen: list[str]) -> list[str]:
    """The functions `name` calls, transitively, callees first."""
    node, _ = _functions()[name]
    for used in sorted({n.id for n in ast.walk(node) if isinstance(n, ast.Name)}):
        if used in _functions() and used != name and used not in seen:
            _needs(used, seen)
    if name not in seen:
        seen.append(name)
    return seen


def imports_for(check: str, already: tuple[str, ...] = ()) -> list[str]:
    """The import statements the check and its callees use, minus those repro.py has already."""
    names = {n.id for f in _needs(check, []) for n in ast.walk(_functions()[f][0]) if isinstance(n, ast.Name)}
    found = {_imports()[n] for n in names if n in _imports()} - set(already)
    return sorted(found, key=lambda line: (line.startswith("from"), line))


def source_for(check: str) -> str:
    """The check's callees, then the check itself renamed `check` (what repro.py's main calls)."""
    order = _needs(check, [])
    parts = [function_source(f) for f in order[:-1]]
    parts.append(function_source(check).replace(f"def {check}(", "def check(", 1))
    return "\n\n\n".join(parts) + "\n"
