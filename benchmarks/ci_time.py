"""`make bench`: the unit suite's time, as the last `make test` of this checkout measured it.

CI runs `make test` (`.ci/run`); its time is a figure to watch against a target, not something a
test can assert. `make test` writes JUnit XML (reports/junit/unit-tests.xml, gitignored) with each
test's seconds (setup, call and teardown) and the session's wall time; this reads it back and
prints the slowest tests, the total and when and where it was measured. Nothing is run here: a
missing or partial file is said as such, never filled in.
"""
from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "reports" / "junit" / "unit-tests.xml"
DURATIONS = ROOT / "tests" / "unit" / "durations.json"
TARGET_S = 20 * 60


def node_id(classname: str, name: str) -> str:
    """pytest's node id back from JUnit's dotted classname (`tests.unit.test_x.TestY`)."""
    parts = classname.split(".")
    module = max((i for i, p in enumerate(parts) if p.startswith("test_")), default=len(parts) - 1)
    return "::".join(["/".join(parts[:module + 1]) + ".py", *parts[module + 1:], name])


def read_suite(path: Path) -> dict:
    """The suite's wall time, when and where it ran, its counts and each test's seconds."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise SystemExit(f"{path}: not JUnit XML ({e})") from None
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise SystemExit(f"{path}: no <testsuite> element")
    tests = []
    for case in suite.iter("testcase"):
        name = node_id(case.get("classname", ""), case.get("name", ""))
        outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                   else "skipped" if case.find("skipped") is not None else "passed")
        tests.append((float(case.get("time", 0.0)), name, outcome))
    counts = {k: sum(t[2] == k for t in tests) for k in ("passed", "failed", "skipped")}
    return {"wall_s": float(suite.get("time", 0.0)), "timestamp": suite.get("timestamp", "?"),
            "hostname": suite.get("hostname", "?"), "counts": counts, "tests": sorted(tests, reverse=True)}


def report(suite: dict, path: Path, top: int) -> str:
    wall, tests = suite["wall_s"], suite["tests"]
    c = suite["counts"]
    lines = [f"unit suite (`make test`), the run started {suite['timestamp']} on {suite['hostname']} ({path}):",
             f"  {len(tests)} tests: {c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed",
             f"  pytest's session {wall:.0f} s ({wall / 60:.1f} min) against the {TARGET_S // 60}-minute target: "
             + ("met" if wall <= TARGET_S else f"{(wall - TARGET_S) / 60:.1f} min over"),
             f"  the tests' own seconds add up to {sum(t[0] for t in tests):.0f} s (over the workers)",
             f"  slowest {min(top, len(tests))}:"]
    lines += [f"  {s:8.1f} s  {name}" + ("" if outcome == "passed" else f"  [{outcome}]")
              for s, name, outcome in tests[:top]]
    return "\n".join(lines)


def module_seconds(suite: dict) -> dict[str, float]:
    """Each test module's seconds (its tests' setup, call and teardown), the heaviest first."""
    seconds: dict[str, float] = {}
    for s, name, _outcome in suite["tests"]:
        module = Path(name.split("::")[0]).name
        seconds[module] = seconds.get(module, 0.0) + s
    return dict(sorted(((m, round(s, 1)) for m, s in seconds.items()), key=lambda kv: -kv[1]))


def write_durations(suite: dict, path: Path) -> None:
    """The file tests/unit/conftest.py orders xdist's queue by (`--write-durations`)."""
    data = {"about": f"seconds per test module, `make test` started {suite['timestamp']} on {suite['hostname']}; "
                     "`python benchmarks/ci_time.py --write-durations` rewrites it",
            "modules": module_seconds(suite)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--junit", type=Path, default=DEFAULT, help="the JUnit XML of a `make test` run")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--write-durations", type=Path, nargs="?", const=DURATIONS, default=None, metavar="FILE",
                    help="write each module's seconds for the suite's xdist order "
                         f"(default {DURATIONS.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    if not args.junit.is_file():
        print(f"unit suite: no measurement ({args.junit} is missing; `make test` writes it)")
        return 0
    suite = read_suite(args.junit)
    if args.write_durations:
        if suite["counts"]["failed"] or len(suite["tests"]) < 100:
            raise SystemExit(f"{args.junit}: a partial or failing run ({suite['counts']}): not written")
        write_durations(suite, args.write_durations)
        print(f"wrote {args.write_durations}")
        return 0
    print(report(suite, args.junit, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
