"""Writing, running and reporting the upstream bundles of the catalog's defects.

A bundle is docs/upstream/<name>/: program.pt2, inputs.pt, the float64 expected.pt, repro.py (from
templates/repro.py.in with the defect's check pasted in), ENV.md and REPORT.md (templates/<runtime>.md
and footer.md). `main` regenerates them and re-runs each repro.py alone; `check_bundles` re-runs.
"""
from __future__ import annotations

import copy
import importlib.metadata as md
import importlib.util
import inspect
import os
import platform
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import torch

from ..plumbing.bundle import write_bundle_dir
from ..plumbing.files import atomic_write_text
from ..repro import _cpu
from . import checks
from .catalog import BY_NAME, DEFECTS, SEARCHED, Defect
from ..plumbing.errors import UsageError

REPRODUCED, FIXED, CANNOT_RUN, CHANGED = 1, 0, 2, 3
STATUS = {REPRODUCED: "reproduces", FIXED: "fixed", CANNOT_RUN: "cannot run here", CHANGED: "changed"}
BLOCKED = ("kokoro", "harness", "misaki")  # what a bundle must run without
TEMPLATES = Path(__file__).with_name("templates")
REPORTS = {"coremltools": "coremltools.md", "apache-tvm": "apache-tvm.md", "executorch": "executorch.md"}


def default_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "docs" / "upstream"


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text(encoding="utf-8")


TEMPLATE_IMPORTS = ("import sys", "from pathlib import Path", "import numpy as np", "import torch")


def repro_source(d: Defect) -> str:
    """repro.py: the template, the imports the defect's check needs (a missing runtime exits 2
    before anything runs) and the check with what it calls (harness.upstream.checks)."""
    imports = checks.imports_for(d.check, TEMPLATE_IMPORTS)
    block = ("\ntry:  # the runtime under test: without it, this cannot run here (exit 2)\n"
             + "".join(f"    {line}\n" for line in imports)
             + "except ImportError as e:\n    print(f\"cannot run here: {e}\")\n    sys.exit(2)\n") if imports else ""
    return (_template("repro.py.in").replace("@TITLE@", d.title).replace("@RUNTIME@", d.runtime)
            .replace("@MODULE@", d.module).replace("@SIGNATURE@", repr(d.signature)).replace("@IMPORTS@", block)
            .replace("@HELPERS@", checks.source_for(d.check) + "\n"))


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def kokoro_line(d: Defect) -> str:
    """`file:line: code` of the Kokoro (or transformers) line the program stands for, found in
    the installed sources (not imported)."""
    rel, text = d.source
    spec = importlib.util.find_spec(rel.split("/")[0])
    if spec is None or not spec.submodule_search_locations:
        return f"{rel}: `{text}` (package not installed here)"
    path = Path(next(iter(spec.submodule_search_locations))).parent / rel
    try:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if text in line:
                return f"{rel}:{i}: `{line.strip()}` ({rel.split('/')[0]} {_version(rel.split('/')[0])})"
    except OSError:
        pass
    return f"{rel}: `{text}`"


def build_bundle(d: Defect, out: Path) -> Path:
    """Write program.pt2, inputs.pt, expected.pt (float64), repro.py and ENV.md (and model.onnx)
    through plumbing.bundle; REPORT.md is written once the bundle has run (check_bundles)."""
    torch.manual_seed(0)
    module, inputs = d.program()
    module.eval()
    with torch.no_grad():
        program = torch.export.export(module, tuple(t.clone() for t in inputs))
        expected = copy.deepcopy(module).double()(*[t.double() if t.is_floating_point() else t.clone() for t in inputs])
    expected = list(expected) if isinstance(expected, (list, tuple)) else [expected]
    files = {"program.pt2": lambda p: torch.export.save(program, str(p)),
             "inputs.pt": lambda p: torch.save(list(inputs), p),
             "expected.pt": lambda p: torch.save({"float64": [e.detach() for e in expected]}, p),
             "repro.py": repro_source(d), "ENV.md": _env_md(d)}
    if d.onnx:
        files["model.onnx"] = lambda p: _onnx(program, p)
    return write_bundle_dir(out / d.name, files)


def _onnx(program, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(program, (), dynamo=True, opset_version=18, optimize=True, verbose=False).save(
            str(path), external_data=False)


def _env_md(d: Defect) -> str:
    rows = [("Python", platform.python_version()), ("OS", platform.platform()),
            ("CPU", f"{_cpu()} ({os.cpu_count()} logical cores)"), ("torch", _version("torch")),
            ("numpy", _version("numpy"))]
    if d.runtime not in ("torch", "numpy"):
        rows.append((d.runtime, _version(d.runtime)))
    if d.onnx:
        rows += [("onnx", _version("onnx")), ("onnxscript", _version("onnxscript"))]
    return "# Environment\n\n| what | version |\n| --- | --- |\n" + "".join(f"| {a} | {b} |\n" for a, b in rows)


# ---- running a bundle alone -------------------------------------------------------------------

_ISOLATED = """
import runpy, sys
BLOCKED = {blocked!r}
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked: the repro must run without it")
        return None
sys.meta_path.insert(0, _Block())
sys.argv = ["repro.py"]
code = 0
try:
    runpy.run_path("repro.py", run_name="__main__")
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 3)
except BaseException:
    import traceback
    traceback.print_exc()
    code = 3
print("LOADED", sorted({{m.split(".")[0] for m in sys.modules}} & set(BLOCKED)))
sys.exit(code)
"""


def run_isolated(bundle: Path, timeout: float = 900) -> dict:
    """Run `bundle/repro.py` in a fresh interpreter (-I: no PYTHONPATH, no user site) in its own
    directory, with kokoro and this harness made unimportable. Exit codes as repro.py's."""
    start = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-I", "-c", _ISOLATED.format(blocked=BLOCKED)], cwd=bundle,
                           capture_output=True, text=True, timeout=timeout,
                           env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")})
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired:
        code, text = None, f"no result after {timeout:.0f} s"
    site = str(Path(torch.__file__).resolve().parent.parent) + os.sep  # .../site-packages/: not the reader's
    lines = [ln.replace(site, "site-packages/") for ln in text.splitlines() if ln.strip() and not _noise(ln)]
    message = next((ln for ln in reversed(lines) if ln.startswith(("REPRODUCED", "FIXED", "CHANGED",
                                                                  "cannot run here"))), lines[-1] if lines else "")
    return {"exit_code": code, "status": STATUS.get(code, "error"), "seconds": round(time.monotonic() - start, 1),
            "message": message, "output": "\n".join(lines[-40:])}


def _noise(line: str) -> bool:
    """Progress bars and import chatter of the runtimes, left out of reports."""
    return any(s in line for s in ("it/s]", "ops/s]", "passes/s]", "Failed to load _ML", "torchao", "_pytree.py",
                                   "[torch.onnx]", "return cls.__new__", "Warning", "warnings.warn"))


# ---- REPORT.md ----------------------------------------------------------------------------------

def _minimal_code(d: Defect) -> str:
    module, inputs = d.program()
    cls = type(module)
    shapes = ", ".join(f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}" for t in inputs)
    return (f"```python\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\n"
            f"{inspect.getsource(cls).rstrip()}\n\n\n"
            f"# inputs: {shapes} (inputs.pt)\nprogram = torch.export.export({cls.__name__}().eval(), inputs)\n```\n"
            f"then, as `repro.py` does:\n```python\n{_check_code(d.check)}\n```\n")


def _check_code(check: str) -> str:
    """The check as REPORT.md shows it: the imports it uses, then its function."""
    imports = "".join(f"{line}\n" for line in checks.imports_for(check, ("import torch",)))
    return (imports + "\n\n" if imports else "") + checks.function_source(check).rstrip()


def report_md(d: Defect, result: dict) -> str:
    source = kokoro_line(d)
    env = _env_md(d).split("\n", 2)[2]
    runtime = f"{d.runtime} {_version(d.runtime)}"
    status = STATUS.get(result["exit_code"], "error")
    expected = {"convert": "the program converts (and, where it can run, matches `expected.pt`, the float64 "
                           "result of the same program, within 4 x PyTorch float32's own error)",
                "delegation": "the op runs inside the XNNPACK delegate, in a few delegate subgraphs",
                "numerics": ("the float16 output stays finite and close to the float64 one" if d.runtime == "torch" else
                             "the output is within 4 x PyTorch float32's own error of `expected.pt` (float64)"),
                "run": "the program runs on the given (standard-strided) inputs and matches `expected.pt` within 4 x "
                       "PyTorch float32's own error",
                "scaling": "the converted program stays the same size whatever the input's length"}[d.kind]
    expected = d.expected or expected
    known = "".join(f"- {link}: {what}\n" for link, what in d.known) or "- none found\n"
    code = _minimal_code(d)
    output = "\n".join(ln for ln in result["output"].splitlines() if not ln.startswith("LOADED "))
    actual = f"```\n{output}\n```"
    how = {"delegation": "The program's values are right: this is a performance defect (what stays outside the "
                         "delegate runs on portable kernels; each delegate cut costs a call).",
           "run": "The lowered program does not run on standard-strided inputs.",
           "numerics": "The program runs, but its values are further from float64 than PyTorch float32's "
                       "(`repro.py` lowers without a partitioner: XNNPACK leaves this op to the portable kernels too)."}.get(d.kind, "")
    common = dict(title=d.title, runtime=runtime, env=env, code=code, actual=actual, source=source, op=d.op, how=how,
                  expected=expected, known=known, status=status, message=result["message"], name=d.name,
                  workaround=d.workaround, searched=d.searched, exit_code=result["exit_code"],
                  detail="\n" + textwrap.fill(d.detail, 110) + "\n" if d.detail else "")
    template = _template(REPORTS.get(d.runtime, "torch.md"))
    return template.format(**common) + _template("footer.md").format(**common)


# ---- the list -------------------------------------------------------------------------------------

def readme_md(rows: list[tuple[Defect, dict]]) -> str:
    lines = ["# Upstream repro bundles", "",
             "One directory per runtime defect the kokoro-parity matrix found. Each holds a standalone "
             "`repro.py` (torch, numpy and the runtime's package only; no Kokoro, no kokoro-parity), the "
             "minimal program (`program.pt2`), `inputs.pt`, the float64 `expected.pt`, `ENV.md` and a "
             "`REPORT.md` written as the runtime's issue template asks. `repro.py` exits 1 while the defect "
             "reproduces, 0 once fixed, 2 when it cannot run here, 3 when it fails differently.", "",
             "Regenerate and re-check all (each repro runs in a fresh interpreter that cannot import kokoro or "
             "the harness; a defect that no longer reproduces fails the command): `make upstream` "
             "(`kokoro-parity upstream`). Re-check only: `kokoro-parity upstream --check`; the nightly run does "
             "that too and the dashboard shows each status.", "",
             f"Status below: the repro run on this machine, {time.strftime('%Y-%m-%d')}. Known reports: a "
             f"search of the runtime's tracker on {SEARCHED}.", "",
             "| bundle | defect | runtime | status now | hidden in kokoro-parity by | known report |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [readme_row(d, r) for d, r in rows]
    return "\n".join(lines) + "\n"


def written_elsewhere(readme: Path) -> str:
    """The README's sections after the catalog's table (from its first `## ` heading): bundles that
    other commands write (a rewrite's, `kokoro-parity run --rewrite`), kept when the table is rewritten."""
    text = readme.read_text() if readme.exists() else ""
    at = text.find("\n## ")
    return text[at:] if at >= 0 else ""


def readme_row(d: Defect, r: dict, day: str = "") -> str:
    """The defect's row of docs/upstream/README.md (`day`: the date of a run apart from the others)."""
    known = "; ".join(f"[{link.split('github.com/')[-1].replace('/issues/', '#').replace('/pull/', '#')}]"
                      f"({link}) ({what.split(':')[0].split(',')[0]})" for link, what in d.known) or "none found"
    when = f"; {day}" if day else ""
    return (f"| [{d.name}]({d.name}/) | {d.title} | {d.runtime} {_version(d.runtime)} | "
            f"**{r['status']}** (exit {r['exit_code']}, {r['seconds']:.0f} s{when}) | {d.workaround} | {known} |")


def update_readme_rows(text: str, rows: list[tuple[Defect, dict]]) -> str:
    """docs/upstream/README.md with these defects' rows rewritten (dated: a run of some bundles only),
    a new defect's row placed after the row of the defect before it in DEFECTS; the other rows kept."""
    lines = text.rstrip("\n").split("\n")

    def at(name):
        return next((i for i, ln in enumerate(lines) if ln.startswith(f"| [{name}]({name}/) |")), None)

    for d, r in rows:
        row = readme_row(d, r, time.strftime("%Y-%m-%d"))
        i = at(d.name)
        if i is not None:
            lines[i] = row
            continue
        before = [j for j in (at(e.name) for e in DEFECTS[:DEFECTS.index(d)]) if j is not None]
        table = [j for j, ln in enumerate(lines) if ln.startswith("| ")]
        lines.insert(max(before) + 1 if before else (table[-1] + 1 if table else len(lines)), row)
    return "\n".join(lines) + "\n"


def check_bundles(root: Path | None = None, timeout: float = 900) -> list[dict]:
    """Run every bundle's repro.py alone (the nightly re-check): one row per bundle."""
    root = Path(root or default_dir())
    rows = []
    for bundle in sorted(p.parent for p in root.glob("*/repro.py")):
        d = BY_NAME.get(bundle.name)
        r = run_isolated(bundle, timeout)
        rows.append({"name": bundle.name, "runtime": d.runtime if d else "", "title": d.title if d else bundle.name,
                     "version": _version(d.runtime) if d else "", "exit_code": r["exit_code"],
                     "status": r["status"], "message": r["message"], "seconds": r["seconds"]})
    return rows


def main(out: Path | None = None, only: list[str] | None = None, check_only: bool = False) -> int:
    """Regenerate (or only re-check) the bundles; 1 when any defect does not reproduce."""
    out = Path(out or default_dir())
    unknown = [n for n in only or [] if n not in BY_NAME]
    if unknown:
        raise UsageError(f"unknown defect(s) {unknown}; known: {', '.join(BY_NAME)}")
    chosen = [d for d in DEFECTS if not only or d.name in only]
    rows = []
    for d in chosen:
        if not check_only:
            build_bundle(d, out)
        elif not (out / d.name / "repro.py").exists():
            raise FileNotFoundError(f"{out / d.name / 'repro.py'}: no bundle (run `kokoro-parity upstream`)")
        r = run_isolated(out / d.name)
        rows.append((d, r))
        if not check_only:
            atomic_write_text(out / d.name / "REPORT.md", report_md(d, r))
        size = sum(p.stat().st_size for p in (out / d.name).iterdir())
        print(f"{d.name:34s} exit {r['exit_code']}  {r['status']:15s} {r['seconds']:6.1f} s  {size / 1e6:5.2f} MB  "
              f"{r['message'][:110]}", flush=True)
    if not check_only and not only:
        atomic_write_text(out / "README.md", readme_md(rows) + written_elsewhere(out / "README.md"))
    elif not check_only and (out / "README.md").exists():  # --only: those rows, the others as they were
        atomic_write_text(out / "README.md", update_readme_rows((out / "README.md").read_text(), rows))
    failed = [d.name for d, r in rows if r["exit_code"] != REPRODUCED]
    if failed:
        print(f"kokoro-parity upstream: the defect does not reproduce in {', '.join(failed)}: read its output, then "
              f"update the bundle or mark the defect fixed (harness/upstream/catalog.yaml)", file=sys.stderr)
        for d, r in rows:
            if d.name in failed:
                print(f"--- {d.name}\n{r['output']}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(only=sys.argv[1:] or None))
