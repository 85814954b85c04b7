"""The package's shape: who may import whom (import-linter's contracts in pyproject.toml, the rules
of docs/design.md), what importing the faces loads, and the packages the wheel ships."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNTIMES = ("executorch", "tvm", "coremltools", "onnxruntime", "onnxscript", "jinja2", "plotly", "matplotlib",
            "playwright")


def test_import_contracts_hold():
    """~1 s. In a child: lint_imports puts its cwd on sys.path and configures logging. Without
    import-linter (the dev extra) this fails: a layering nobody checks is not a skip."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert "No module named 'importlinter'" not in done.stderr, "pip install -e '.[dev]' (import-linter)"
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_the_faces_import_no_runtime():
    """`kokoro-parity --help` and pytest's plugin load no runtime: a missing extra stays a skip."""
    code = ("import sys, harness.cli, harness.plugin; "
            f"print(sorted(m for m in {RUNTIMES!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_the_wheel_lists_every_package():
    """pyproject.toml lists its packages (the data directories are mapped into the package), so a
    new subpackage must be listed too, or the wheel would ship without it."""
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    listed, mapped = set(setuptools["packages"]), setuptools["package-dir"]
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "harness").rglob("__init__.py")}
    assert found <= listed, f"not in [tool.setuptools] packages: {sorted(found - listed)}"
    for name in listed:
        where = REPO / mapped[name] if name in mapped else REPO.joinpath(*name.split("."))
        assert where.is_dir(), f"{name}: no directory {where}"
    assert (REPO / "cases" / "en_short.yaml").is_file() and not (REPO / "harness" / "data" / "cases").exists()


def test_every_module_imports():
    """Every module of harness/ imports (a name moved to another module, an import left pointing
    at its old place, shows here rather than in the one test that happens to reach it)."""
    code = ("import importlib, pkgutil, harness; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(harness.__path__, 'harness.')]")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def test_deferred_imports_name_real_modules_and_keep_the_contracts():
    """harness.plumbing.deferred binds a module at the top of its user and imports it at first use:
    import-linter does not see those imports, so their names are held here to the protected-module
    contracts of pyproject.toml, and each must name a module that exists (a typo would otherwise
    surface only when a backend first runs)."""
    import ast
    import importlib.util

    contracts = [c for c in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
                 if c["type"] == "protected"]
    found = []
    for path in (REPO / "harness").rglob("*.py"):
        importer = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "deferred_import"
                    and isinstance(node.args[0], ast.Constant)):
                found.append((importer, node.args[0].value))
    assert len(found) > 30, found
    macos_only = {"executorch.backends.apple.mps.partition"}  # ExecuTorch's macOS wheels only
    for importer, name in found:
        try:
            exists = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:
            exists = name in macos_only
        assert exists, f"{importer}: deferred_import({name!r}): no such module"
        for c in contracts:
            if name.split(".")[0] in c["protected_modules"] or name in c["protected_modules"]:
                allowed = any(importer == a or importer.startswith(a + ".") for a in c["allowed_importers"])
                assert allowed, f"{importer} defers {name!r}: contract {c['name']!r}"
