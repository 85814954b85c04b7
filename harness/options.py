"""The run options, declared once for both faces.

`pytest --backend=xnnpack` and `kokoro-parity run --backend xnnpack` must mean the same thing with
the same spelling; when each face declared its own options they drifted (a subcommand accepted a
limit and never passed it on). Each option is one `Option`; a face adds the ones it takes with
`add_argparse` or `add_pytest`, and `RunConfig.from_options` reads them back into the one
configuration a Session is built from.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable



@dataclass(frozen=True)
class Localize:
    """`--bisect` and its options (one spelling on both faces: `--bisect-depth`, `--bisect-band-from`)."""

    depth: int = 2  # module levels whose cuts are searched before the ops (a backend step)
    band_from: str | None = None  # a build of the backend known to be right
    etrecords: tuple[str, ...] = ()  # `--etrecord [STEP=]PATH` of .pte artifacts
    verify: bool = True  # run the written repro.py once
    force: bool = False  # localize a passing backend item too (a clean backend must localize nothing)


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    action: str | None = None  # "append", "store_true", or None (one value)
    type: Callable | None = None
    default: Any = ...  # Ellipsis: append -> [] (backend, case, step say None: "every one"); else None
    choices: tuple | None = None
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def initial(self):
        if self.default is not ...:
            return self.default
        return [] if self.action == "append" else None

    def kwargs(self, **override) -> dict:
        kw = dict(help=self.help, dest=self.dest, default=self.initial)
        for key in ("action", "type", "choices", "metavar"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        kw.update(override)
        return kw


# What runs a user's artifact (`--artifact-runtime`, a port stage's `runtime:`): the runtime of the
# file's kind, or onnxruntime-web in headless Chromium (harness.backends.onnxruntime_web's backends).
# Spelled here, which the faces read before any backend is imported; harness.backends.prebuilt
# takes its RUNTIMES from these.
NATIVE_RUNTIME = "native"
WEB_RUNTIMES = ("ort-web-wasm", "ort-web-webgpu")
ARTIFACT_RUNTIMES = (NATIVE_RUNTIME, *WEB_RUNTIMES)

WEIGHTS_HELP = ("a Kokoro .pth to load strictly, `hf` (the local Hugging Face cache), `random[:seed]`; default: "
                "the int8-rebuilt Kokoro-82M v1.0 (env KOKORO_PARITY_WEIGHTS)")

OPTIONS: dict[str, Option] = {o.dest: o for o in (
    Option("--backend", "backend to check (repeatable; default: every installed backend)", "append", default=None),
    Option("--case", "case id (repeatable; default: all): the shipped cases and those of --cases-dir", "append", default=None),
    Option("--cases-dir", "your own cases (YAML, `kokoro-parity new-case`), before the shipped ones; "
                          "pytest ini: kokoro_parity_cases", "append", metavar="DIR"),
    Option("--step", "step name (repeatable; default: all; under pytest select with -k)", "append", default=None),
    Option("--mode", "dynamic (exact lengths), static (padded to the bucket, packing disabled) or both",
           default="both", choices=("dynamic", "static", "both")),
    Option("--weights", WEIGHTS_HELP),
    Option("--report-dir", "where JSON records and run files go", type=Path, default=Path("reports")),
    Option("--profile", "tolerance profile YAML (default: harness/tolerances.yaml)"),
    Option("--with-patch", "add a patch to every backend's own (repeatable), e.g. length_aware_lstm", "append"),
    Option("--no-workaround", "run the backends without this named workaround of a runtime defect (repeatable, "
                              "or `all`; `kokoro-parity backends` lists them), so the defect shows as a verdict "
                              "and can be bisected", "append", metavar="NAME"),
    Option("--time-limit", "child-process time limit of export, compile or run (default 900 s each); past it "
                           "the item is TIMEOUT", "append", metavar="PHASE=SECONDS"),
    Option("--memory-limit", "skip a compile whose backend's cost law estimates more memory (default: 80%% of "
                             "this machine's; docs/performance.md)", type=float, metavar="GB"),
    Option("--target", "run the compiled artifacts on this target of targets.yaml (an SSH machine: a Mac, an ARM "
                       "board; docs/targets.md); compile stays here. Ids and tables say `backend@NAME`",
           default="local", metavar="NAME"),
    Option("--targets-file", "the targets file (default: ./targets.yaml, then the user's config dir)",
           metavar="PATH"),
    Option("--reuse-runs", "judge the saved outputs of a local run whose artifact and inputs ran before instead "
                           "of running it again; without it every run runs", "store_true"),
    Option("--reuse-only", "--reuse-runs, and never export, compile or run: an item this cache does not hold "
                           "warm is SKIPPED 'not warm'", "store_true"),
    Option("--artifact", "judge your own .pte/.onnx/TVM .so/.mlpackage against STEP's references, or a "
                         "whole-model file with e2e=PATH (repeatable; without --backend only these items run)",
           "append", metavar="STEP=PATH"),
    Option("--artifact-runtime", "what runs each --artifact (repeatable: one item per runtime): native (the file "
                                 "kind's own runtime, onnxruntime CPU for an .onnx; the default), or for an ONNX "
                                 "onnxruntime-web in headless Chromium: ort-web-wasm, ort-web-webgpu (docs/web.md; "
                                 "a port file names a `runtime:` per stage)", "append",
           choices=ARTIFACT_RUNTIMES, metavar="NAME"),
    Option("--etrecord", "the ETRecord of a .pte artifact (export with generate_etrecord=True): --bisect "
                         "localizes inside the .pte through ExecuTorch's ETDump (default: <artifact>.etrecord "
                         "beside it)", "append", metavar="[STEP=]PATH"),
    Option("--port", "judge a port file's chain of artifacts stage by stage (docs/own-port.md; repeatable)",
           "append", metavar="PORT.YAML"),
    Option("--rewrite", "judge a rewrite of Kokoro in another framework module by module: a built-in adapter "
                        "(`mlx-audio`) or your adapter's Python file (docs/rewrites.md; repeatable; without "
                        "--backend only these items run)", "append", metavar="NAME|ADAPTER.py"),
    Option("--noise-k", "reference runs with different noise seeds for the noise band (default 16)", type=int),
    Option("--bisect", "after a failing item, localize where it diverges (module and op on a backend, the "
                       "stage and node inside an ONNX, the operator inside a .pte) and write a standalone repro "
                       "to <report-dir>/repro/<item>/ (docs/bisection.md)", "store_true"),
    Option("--bisect-depth", "module levels below the step's module whose cuts are searched before the ops "
                             "(0: ops only)", type=int, default=2),
    Option("--bisect-band-from", "bisect against a band: a build of the backend known to be right (e.g. the "
                                 "previous runtime version); its own deviations from float64 are not named",
           metavar="BACKEND"),
)}

# Which options each face takes: a run of items (pytest, `run`, `nightly`), a whole-model file or a
# port file (`check`, `port`), one item bisected (`bisect`).
RUN = ("backend", "case", "cases_dir", "mode", "weights", "report_dir", "profile", "with_patch", "no_workaround",
       "time_limit", "memory_limit", "target", "targets_file", "reuse_runs", "reuse_only", "artifact",
       "artifact_runtime", "etrecord", "port", "rewrite", "noise_k", "bisect", "bisect_depth", "bisect_band_from")
PORTS = ("case", "cases_dir", "weights", "report_dir", "profile", "noise_k", "time_limit", "bisect")
BISECT = ("weights", "report_dir", "profile", "with_patch", "no_workaround", "time_limit", "bisect_depth",
          "bisect_band_from")


def add_argparse(parser, names, **overrides) -> None:
    """Add the named options to an argparse parser; `overrides` maps a name to changed keywords."""
    for name in names:
        parser.add_argument(OPTIONS[name].flag, **OPTIONS[name].kwargs(**overrides.get(name, {})))


def add_pytest(group, names) -> None:
    for name in names:
        group.addoption(OPTIONS[name].flag, **OPTIONS[name].kwargs())


@dataclass(frozen=True)
class RunConfig:
    """What a run was asked for, from either face: the one place a Session's options come from."""

    weights: str | None = None
    case_ids: tuple[str, ...] | None = None
    cases_dirs: tuple[str, ...] = ()
    report_dir: Path = Path("reports")
    profile: str | None = None
    with_patch: tuple[str, ...] = ()
    time_limit: tuple[str, ...] = ()
    memory_limit: float | None = None
    target: str = "local"
    targets_file: str | None = None
    reuse_runs: bool = False
    reuse_only: bool = False
    noise_k: int | None = None
    localize: Localize | None = None  # --bisect and its options; None: no localization
    backends: tuple[str, ...] | None = None  # None: every installed backend
    steps: tuple[str, ...] | None = None  # None: every step (pytest selects with -k instead)
    modes: tuple[str, ...] = ("dynamic", "static")
    artifacts: tuple[str, ...] = ()  # STEP=PATH and e2e=PATH
    artifact_runtimes: tuple[str, ...] = (NATIVE_RUNTIME,)  # what runs each of them (ARTIFACT_RUNTIMES)
    ports: tuple[str, ...] = ()  # port files
    rewrites: tuple[str, ...] = ()  # rewrite adapters (harness.rewrite)

    @classmethod
    def from_options(cls, get: Callable[[str], Any], extra_cases_dirs=()) -> "RunConfig":
        """`get(dest)` reads one option's value (argparse's namespace, pytest's getoption); an
        option the face does not take reads as its default."""
        def value(name):
            try:
                v = get(name)
            except (AttributeError, ValueError):
                v = None
            return OPTIONS[name].initial if v is None else v

        def many(name):  # a repeatable option, or one that a subcommand takes once (`bisect --case`)
            v = value(name)
            return (v,) if isinstance(v, str) else tuple(v) if v else None

        cases = many("case")
        localize = Localize(depth=value("bisect_depth"), band_from=value("bisect_band_from"),
                            etrecords=tuple(value("etrecord"))) if value("bisect") else None
        return cls(weights=value("weights"), case_ids=cases,
                   cases_dirs=tuple(map(str, (*value("cases_dir"), *extra_cases_dirs))),
                   report_dir=Path(value("report_dir")), profile=value("profile"),
                   with_patch=tuple(value("with_patch")), time_limit=tuple(value("time_limit")),
                   memory_limit=value("memory_limit"), target=value("target"), targets_file=value("targets_file"),
                   reuse_runs=bool(value("reuse_runs") or value("reuse_only")), reuse_only=bool(value("reuse_only")),
                   noise_k=value("noise_k"), localize=localize,
                   backends=many("backend"), steps=many("step"),
                   modes=("dynamic", "static") if value("mode") == "both" else (value("mode"),),
                   artifacts=tuple(value("artifact")), ports=tuple(value("port")),
                   artifact_runtimes=tuple(dict.fromkeys(value("artifact_runtime"))) or ("native",),
                   rewrites=tuple(value("rewrite")))
