"""`ort-web-wasm` and `ort-web-webgpu`: the `onnxruntime` backend's ONNX file run by onnxruntime-web
in headless Chromium, as Kokoro's web port (kokoro-js: transformers.js on onnxruntime-web) runs it.

The compile is the `onnxruntime` backend's export (the same program, the same patches, the same
artifact key: one ONNX file serves all three). The run, in the job's child process, starts a
loopback server (harness.backends.web_page), opens web/runner.html in a fresh page, creates an
InferenceSession with executionProviders ['wasm'] or ['webgpu'], and reads the outputs back as raw
bytes. The page opens in the harness run's own headless Chromium for that provider when the run
has one (`SharedBrowser`: the Session starts it on first use and hands its DevTools endpoint to
each run's child, which connects over CDP and opens a fresh context of its own), else in one
started for the run (a standalone child, a probe). Each item's isolation stays a process's: a
renderer crash is the item's CRASHED (the page's own message), a page that never answers is the
job's TIMEOUT (the child is killed; Chromium disposes of its context, and the session closes any
page left and restarts a browser that stopped answering), a lost WebGPU device a RUN_ERROR with the
browser's reason; the next item gets a fresh page, and a fresh browser if the last one died. A
localization runs its many subgraphs in one `BrowserSession` (one browser, a fresh page per run:
`BrowserRunner`).

The record says where it ran: onnxruntime-web's version and bundle, the browser's version and user
agent, the WebGPU adapter (vendor, architecture, features, whether `shader-f16`, key limits), and
the op audit from onnxruntime's own verbose log: which nodes each execution provider took after
the session's graph optimizations, which fell back to the CPU (wasm) kernels, and why.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import os
import re
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import torch

from ..plumbing.files import content_key
from ..plumbing.jobs import first_error_line
from . import Backend
from .onnx import ONNX_NAME, ONNX_PATCHES, OnnxRuntimeBackend, export_onnx, input_feed
from .web_page import CHROMIUM, PageServer, launch_chromium
from ..plumbing.deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
playwright_api = deferred_import("playwright.sync_api")
float16_cast = deferred_import("onnxconverter_common.float16")

WEB_DIR_ENV = "KOKORO_PARITY_WEB_DIR"  # another install of web/ (package.json + node_modules)
REPO_WEB = Path(__file__).resolve().parents[2] / "web"
NPM_PACKAGE = "onnxruntime-web"
THREADS = 1  # one wasm thread: threads need a cross-origin-isolated page, and the machines have 2 cores
# torch dtype -> onnxruntime-web tensor type (the page builds the typed array over the raw bytes)
DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.int64: "int64", torch.int32: "int32",
          torch.int8: "int8", torch.uint8: "uint8", torch.bool: "bool", torch.float16: "float16"}
NUMPY = {"float32": np.float32, "float64": np.float64, "int64": np.int64, "int32": np.int32, "int8": np.int8,
         "uint8": np.uint8, "bool": np.bool_, "float16": np.float16}
PLACED = re.compile(r"(All nodes|Node\(s\)) placed on \[(\w+)\]\. Number of nodes: (\d+)")
PLACED_NODE = re.compile(r"VerifyEachNodeIsAssignedToAnEp\]\s{3}(\S+) \((.*)\)\s*$")
NO_KERNEL = re.compile(r"(\w+) kernel not found in registries for Op type: (\w+) node name: (.*)$")
NODES_KEPT = 40  # node names of the CPU fallbacks the record keeps (the log has them all)
KEPT_LOG = re.compile(r"\[[WEF]:onnxruntime|Node placements|placed on \[|VerifyEachNodeIsAssignedToAnEp\]\s{3}"
                      r"|kernel not found in registries")


_device = None  # harness.backends.web_device.Device taking this process's runs (`on_device`)


@contextlib.contextmanager
def on_device(device):
    """Runs in the `with` block go to `device` (a page on the user's own device) instead of a
    headless Chromium started here."""
    global _device
    before, _device = _device, device
    try:
        yield device
    finally:
        _device = before


_shared: str | None = None  # the DevTools endpoint of the harness run's browser taking this process's runs


@contextlib.contextmanager
def on_shared_browser(endpoint: str | None):
    """Runs in the `with` block open their pages in the browser at `endpoint` (a Session's
    `SharedBrowser`) instead of one started for the run; None changes nothing."""
    global _shared
    before, _shared = _shared, endpoint or _shared
    try:
        yield endpoint
    finally:
        _shared = before


class PageCrashed(RuntimeError):
    """The page's renderer died: the item's CRASHED, with the browser's message."""

    job_status = "crashed"  # harness.plumbing.jobs: a crash of a process the job drives


def web_dir() -> Path:
    return Path(os.environ.get(WEB_DIR_ENV) or REPO_WEB)


def ort_web_version() -> str | None:
    """The installed onnxruntime-web's version (web/node_modules), None when not installed."""
    try:
        return json.loads((web_dir() / "node_modules" / NPM_PACKAGE / "package.json").read_text())["version"]
    except (OSError, ValueError, KeyError):
        return None


@functools.cache
def chromium_version() -> str:
    """`chromium --version` (Debian's wrapper script prints it; its shell noise on stderr is ignored)."""
    try:
        out = subprocess.run([CHROMIUM, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({first_error_line(e)})"
    found = re.search(r"Chromium ([\d.]+)", out)
    return found.group(1) if found else out.strip() or "unknown"


@functools.cache
def webgpu_adapter() -> dict:
    """What this machine's headless Chromium offers to WebGPU (asked once per process): the adapter's
    info, or {"error": why there is none}."""
    try:
        with PageServer(files=page_files()) as server, playwright_api.sync_playwright() as p:
            browser = launch_chromium(p, webgpu=True)
            try:
                page = browser.new_page()
                page.goto(server.url + "/runner.html")
                page.wait_for_function("window.kokoroReady === true")
                return page.evaluate("() => window.kokoroAdapter()")
            finally:
                browser.close()
    except playwright_api.Error as e:
        return {"error": f"Chromium did not start: {first_error_line(e)}"}


def page_files() -> dict[str, Path]:
    return {"/runner.html": web_dir() / "runner.html", "/runner.js": web_dir() / "runner.js"}


def placement(log_lines: list[str]) -> dict:
    """The op audit from onnxruntime's verbose log: nodes per execution provider (after its graph
    optimizations; "All nodes placed" names no ops), the ops it put on the CPU provider, and the
    ops a provider had no kernel for (the reason of most fallbacks)."""
    providers: dict[str, dict] = {}
    current = None
    missing: Counter = Counter()
    for line in log_lines:
        if m := PLACED.search(line):
            current = providers.setdefault(m.group(2), {"nodes": 0, "ops": Counter(), "names": []})
            current["nodes"] += int(m.group(3))
            continue
        if current is not None and (m := PLACED_NODE.search(line)):
            current["ops"][m.group(1)] += 1
            current["names"].append(f"{m.group(1)} ({m.group(2)})")
            continue
        current = None
        if m := NO_KERNEL.search(line):
            missing[f"{m.group(1)}:{m.group(2)}"] += 1
    for entry in providers.values():
        entry["ops"] = dict(sorted(entry["ops"].items()))
    cpu = providers.get("CPUExecutionProvider", {})
    names = [n for n in cpu.get("names", []) if not n.startswith("Memcpy")]
    for entry in providers.values():
        del entry["names"]
    return {"placement": providers,
            "ops_on_cpu": {k: v for k, v in cpu.get("ops", {}).items() if not k.startswith("Memcpy")},
            "nodes_on_cpu": names[:NODES_KEPT] + ([f"... {len(names) - NODES_KEPT} more"] if len(names) > NODES_KEPT else []),
            "ops_without_kernel": dict(sorted(missing.items()))}


def browser_provider(backend) -> str:
    """The execution provider ("wasm", "webgpu") of a backend whose runs open a page in headless
    Chromium (an ort-web-* backend, a user's ONNX on a browser runtime), "" for any other."""
    if isinstance(backend, OrtWebBackend):
        return backend.execution_provider
    web = getattr(backend, "web", None)  # harness.backends.prebuilt.PrebuiltBackend
    if callable(web) and getattr(backend, "runtime", None) in ("ort-web-wasm", "ort-web-webgpu"):
        return browser_provider(web())
    return ""


def browser_missing() -> str:
    """Why no page can run here (no chromium, no onnxruntime-web in web/node_modules), with the
    command that installs it; "" when both are there. The backends' and a user's ONNX artifact's
    (`--artifact-runtime`, harness.backends.prebuilt) one check."""
    if _device is None and not os.path.exists(CHROMIUM):  # a device's own browser needs none here
        return f"{CHROMIUM} not installed (apt-get install chromium)"
    if ort_web_version() is None:
        return f"{NPM_PACKAGE} not installed in {web_dir()}/node_modules (npm ci --prefix web)"
    return ""


def webgpu_missing() -> str:
    """Why this machine's headless Chromium has no WebGPU adapter, or ""."""
    adapter = webgpu_adapter()
    return f"no WebGPU in headless Chromium here: {adapter['error']}" if "error" in adapter else ""


class OrtWebBackend(Backend):
    """onnxruntime-web in headless Chromium; subclasses choose the execution provider and bundle."""

    execution_provider = ""
    bundle = ""  # the dist/ module the page imports (what `import ... from 'onnxruntime-web[/...]'` gives)
    requires = ("onnx", "onnxscript", "playwright")
    run_requires = ("playwright",)
    patches = ONNX_PATCHES  # the onnxruntime backend's program, so its ONNX file (artifact_key)
    artifact_name = ONNX_NAME
    run_imports = ("playwright.sync_api", "onnx")
    audit_labels = {"ops_without_onnx_translation": "ops the ONNX exporter cannot translate",
                    "ops_on_cpu": "ops the WebGPU session left on the CPU (wasm) kernels"}
    audit = OnnxRuntimeBackend.audit  # the exporter's gaps: one audit per program with onnxruntime's
    audit_requires = OnnxRuntimeBackend.audit_requires

    def available(self) -> tuple[bool, str]:
        ok, why = super().available()
        if not ok:
            return ok, why
        why = browser_missing()
        return not why, why

    def version(self) -> str:
        return f"{NPM_PACKAGE}=={ort_web_version()},chromium=={chromium_version()},{super().version()}"

    def artifact_key(self, program_key: str) -> str:
        """The onnxruntime backend's: the compile is its export, so the ONNX file is shared."""
        return OnnxRuntimeBackend().artifact_key(program_key)

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        return export_onnx(program_path, out_dir / ONNX_NAME)

    def drive(self, page, cfg: dict) -> dict:
        """Run the page's session on `cfg` and return its answer (a seam for the tests' faults)."""
        return default_drive(page, cfg)

    def run(self, artifact_path: Path, inputs: list) -> list:
        return self.run_feed(artifact_path, input_feed(artifact_path, list(graph_input_types(artifact_path)), inputs))

    def run_feed(self, artifact_path: Path, feed: dict) -> list:
        """Run the ONNX file on {graph input name: tensor} in the page; `run_audit` says where it ran.
        A user's ONNX artifact run here (`--artifact-runtime`) comes through this too."""
        for name, t in feed.items():
            if t.dtype not in DTYPES:
                raise ValueError(f"input {name}: dtype {t.dtype} has no onnxruntime-web tensor type")
        outputs, self.run_audit = run_in_browser(artifact_path, {n: t.detach().cpu().numpy() for n, t in feed.items()},
                                                 self.execution_provider, self.bundle, self.drive)
        return [torch.from_numpy(a) for a in outputs.values()]


def default_drive(page, cfg: dict) -> dict:
    return page.evaluate("cfg => window.kokoroRun(cfg)", cfg)


def run_in_browser(model: Path, feed: dict, execution_provider: str, bundle: str,
                   drive=default_drive, session: "BrowserSession | None" = None) -> tuple[dict, dict]:
    """Run an ONNX file on named numpy arrays in onnxruntime-web in a headless Chromium: ({output
    name: array} in the model's output order, the audit of where it ran). In `session`'s browser
    when given, else on the device page of a browser target when one is taking the runs (`on_device`),
    else in one started for this call. Any ONNX file, so that what runs subgraphs of a user's ONNX
    (a localizer) can run them here too."""
    if session is not None:
        return session.run(model, feed)
    if _device is not None:
        return _device.run(model, feed, execution_provider, bundle)
    with BrowserSession(execution_provider, bundle, drive, endpoint=_shared) as one:
        return one.run(model, feed)


class BrowserSession:
    """One loopback server and one headless Chromium for many runs (a localization's marked model
    and every subgraph cut from it), a fresh page per run. A page that crashes is that run's
    PageCrashed and is closed; the next run gets a fresh page, and a fresh browser if the crash
    took the browser with it. A page that never answers is the job's TIMEOUT: the job's child
    process is killed, and its browser with it. With `endpoint` (a harness run's `SharedBrowser`)
    its first browser is that one, connected over CDP (closing the session disconnects and
    disposes of its contexts, never that browser); one started here when it cannot be reached.
    A context manager."""

    def __init__(self, execution_provider: str, bundle: str, drive=default_drive, endpoint: str | None = None) -> None:
        self.execution_provider, self.bundle, self.drive = execution_provider, bundle, drive
        self.endpoint = endpoint
        self.shared = False  # the current browser is the harness run's, connected over CDP
        self.shared_error = ""  # why the shared browser could not be reached
        self.launches = 0  # browsers started (1 unless one died)
        self.ort_files: set[str] = set()  # what the pages loaded from onnxruntime-web's dist/
        self._stack = contextlib.ExitStack()
        self._server: PageServer | None = None
        self._playwright = None
        self._browser = None

    def __enter__(self) -> "BrowserSession":
        try:
            self._server = self._stack.enter_context(PageServer(
                files=page_files(), trees={"/ort/": web_dir() / "node_modules" / NPM_PACKAGE / "dist"}))
            self._playwright = self._stack.enter_context(playwright_api.sync_playwright())
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self._browser is not None:
                self._browser.close()
        except playwright_api.Error:
            pass  # already gone (a crash took it)
        finally:
            self._browser = None
            self._stack.close()

    def browser(self):
        """The session's browser, started again when the last one is gone."""
        if self._browser is None or not self._browser.is_connected():
            if self.endpoint and not self.shared and not self.shared_error:  # the first browser only
                try:
                    self._browser = self._playwright.chromium.connect_over_cdp(self.endpoint, timeout=30_000)
                    self.shared = True
                    return self._browser
                except playwright_api.Error as e:
                    self.shared_error = first_error_line(e)
            self.shared = False
            self._browser = launch_chromium(self._playwright, webgpu=self.execution_provider == "webgpu")
            self.launches += 1
        return self._browser

    def run(self, model: Path, feed: dict) -> tuple[dict, dict]:
        """`run_in_browser`'s run, in a fresh page of this session's browser."""
        server = self._server
        cfg = stage_job(server, model, feed, self.execution_provider, self.bundle)
        answer, console, browser = _in_page(self.browser(), server.url, cfg, self.drive)
        browser["shared"] = self.shared
        if self.shared:
            browser["launched_by"] = "session"  # harness.runner.Session's SharedBrowser
        elif self.shared_error:
            browser["shared_error"] = self.shared_error
        self.ort_files.update(r.split()[1][len("/ort/"):] for r in server.requests
                              if r.startswith("GET /ort/") and r.endswith(" 200"))
        return read_outputs(server, answer), run_audit(answer, console, browser, cfg)


def stage_job(server: PageServer, model: Path, feed: dict, execution_provider: str, bundle: str,
              outputs: str = "/output/") -> dict:
    """Put one run's model, side files and input bytes on `server`; the page's config for it (its
    outputs posted under `outputs`). What a harness-driven page and a device's page share."""
    arrays = {n: np.ascontiguousarray(a) for n, a in feed.items()}
    specs = [{"name": n, "dtype": a.dtype.name, "dims": list(a.shape)} for n, a in arrays.items()]
    side = side_files(Path(model))
    server.files = {**page_files(), "/model.onnx": Path(model),
                    **{f"/external/{i}": f for i, f in enumerate(side.values())}}
    server.blobs = {f"/input/{i}": a.tobytes() for i, a in enumerate(arrays.values())}
    for path in [p for p in list(server.posted) if not p.startswith("/about/")]:  # a device page's description stays
        server.posted.pop(path, None)
    del server.requests[:]
    return {"bundle": bundle, "ep": execution_provider, "threads": THREADS, "verbose": True, "inputs": specs,
            "external": [{"path": loc, "url": f"/external/{i}"} for i, loc in enumerate(side)], "outputs": outputs}


def read_outputs(server: PageServer, answer: dict, prefix: str = "/output/") -> dict:
    """{output name: array} from the bytes the page posted under `prefix`, in the model's order."""
    outputs = {}
    for i, out in enumerate(answer["outputs"]):
        raw = server.posted.get(f"{prefix}{i}")
        if raw is None:
            raise RuntimeError(f"output {out['name']}: the page posted no bytes")
        outputs[out["name"]] = np.frombuffer(raw, dtype=NUMPY[out["dtype"]]).reshape(out["dims"]).copy()
    return outputs


def run_audit(answer: dict, console: list[str], browser: dict, cfg: dict) -> dict:
    """Where the run ran: onnxruntime-web, the browser, the adapter, the op audit from its log."""
    audit = {"ort_web": {"version": ort_web_version(), "bundle": cfg["bundle"], "execution_provider": cfg["ep"],
                         "wasm_threads": THREADS, "page_s": answer["times"]},
             "browser": browser, "webgpu_adapter": answer.get("adapter")}
    found = placement(console)
    # the wasm provider is onnxruntime's CPU provider: all of it is "on the CPU", no fallback to name
    audit.update(found if cfg["ep"] == "webgpu" else {"placement": found["placement"]})
    return audit


class DevicePages:
    """A BrowserSession's face on a browser target's device (`on_device`): each run goes to the
    page on the user's device, so that a localization names what *that* browser computes wrong."""

    launches = 0  # the device's browser is the user's: none started here

    def __init__(self, device, execution_provider: str, bundle: str) -> None:
        self.device, self.execution_provider, self.bundle = device, execution_provider, bundle

    def __enter__(self) -> "DevicePages":
        return self

    def __exit__(self, *exc) -> None:
        pass

    @property
    def ort_files(self) -> set[str]:
        """What the device's pages loaded from onnxruntime-web's dist/ (the server's request log)."""
        return {path.removeprefix("/ort/") for path in set(self.device.server.served) if path.startswith("/ort/")}

    def run(self, model: Path, feed: dict) -> tuple[dict, dict]:
        return self.device.run(model, feed, self.execution_provider, self.bundle)


def stage_pages(execution_provider: str, bundle: str):
    """Where a localizer's runs go: the device's page when a browser target takes this process's
    runs (`on_device`), else one headless Chromium here (a context manager either way)."""
    if _device is not None:
        return DevicePages(_device, execution_provider, bundle)
    return BrowserSession(execution_provider, bundle)


class BrowserRunner:
    """A localizer's runner on onnxruntime-web, as `run_onnx` is on onnxruntime CPU: (ONNX path,
    {name: array}, output names or None) -> {name: array}, each run in a fresh page of `session`.
    Inputs the graph does not take are dropped and the others cast to its declared types, as an
    onnxruntime session casts them, since the page builds its tensors from the bytes as they are."""

    def __init__(self, session: BrowserSession) -> None:
        self.session = session
        self.audit: dict = {}  # the last run's: onnxruntime-web, the browser, the adapter

    def __call__(self, path: Path, feed: dict, outputs: list[str] | None = None) -> dict:
        types = graph_input_types(path)
        arrays = {k: np.asarray(v) for k, v in feed.items() if k in types}
        arrays = {k: a.astype(types[k]) if types[k] is not None else a for k, a in arrays.items()}
        got, self.audit = self.session.run(Path(path), arrays)
        return {n: got[n] for n in outputs} if outputs else got

    def about(self) -> dict:
        """Where the stages ran (the record's `ran_on`): onnxruntime-web's version, bundle, provider
        and the dist/ files its pages loaded, the browser, the WebGPU adapter."""
        ort_web = {k: v for k, v in self.audit.get("ort_web", {}).items() if k != "page_s"}
        return {"ort_web": {**ort_web, "files": sorted(self.session.ort_files)},
                "browser": self.audit.get("browser"), "webgpu_adapter": self.audit.get("webgpu_adapter"),
                "browsers_started": self.session.launches}


def side_files(model: Path) -> dict[str, Path]:
    """{location: file} of the tensors an ONNX keeps beside it (an exporter's `model.onnx.data`):
    the page hands them to the session as its external data, served as the model is."""
    graph = onnx.load(str(model), load_external_data=False).graph
    found = {}
    for t in graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                found.setdefault(loc, Path(model).parent / loc)
    return found


def graph_input_types(path: Path) -> dict[str, np.dtype | None]:
    """{graph input: its numpy dtype, None when the graph does not declare one}."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    elem = lambda v: v.type.tensor_type.elem_type  # noqa: E731
    return {v.name: onnx.helper.tensor_dtype_to_np_dtype(elem(v)) if elem(v) else None
            for v in graph.input if v.name not in initializers}


def _in_page(browser, url: str, cfg: dict, drive) -> tuple[dict, list[str], dict]:
    """(the page's answer, its console lines, the browser's version and user agent), in a page
    opened for this run and closed after it."""
    console: list[str] = []
    crashed: list[str] = []
    page = browser.new_page()
    try:
        page.on("console", lambda m: console.append(m.text))
        page.on("crash", lambda _: crashed.append("the page's renderer crashed"))
        page.goto(url + "/runner.html")
        page.wait_for_function("window.kokoroReady === true")
        about = {"version": browser.version, "user_agent": page.evaluate("navigator.userAgent")}
        try:
            answer = drive(page, cfg)
        except playwright_api.Error as e:
            message = first_error_line(e)
            if crashed or "crash" in message.lower():
                raise PageCrashed(f"Chromium {browser.version}: {message}") from None
            raise RuntimeError(f"onnxruntime-web ({cfg['ep']}): {message}") from None
    finally:
        _print_kept(console)
        try:
            page.context.close()  # new_page's own context: its page, caches and workers
        except playwright_api.Error:
            pass  # a crashed page's context may be gone with it
    return answer, console, about


def _print_kept(console: list[str]) -> None:
    """The run's log (the job's log.txt) keeps onnxruntime's warnings, errors and node placements,
    not its verbose rest (shader sources, every transformer's step)."""
    for line in console:
        if KEPT_LOG.search(line):
            print(line)


class OrtWebWasmBackend(OrtWebBackend):
    name = "ort-web-wasm"
    execution_provider = "wasm"
    bundle = "ort.wasm.min.mjs"  # `import * as ort from 'onnxruntime-web/wasm'`
    description = "the onnxruntime ONNX file in onnxruntime-web, WebAssembly (CPU) provider, headless Chromium"


class OrtWebWebGpuBackend(OrtWebBackend):
    name = "ort-web-webgpu"
    execution_provider = "webgpu"
    bundle = "ort.webgpu.min.mjs"  # `import * as ort from 'onnxruntime-web/webgpu'`
    description = "the onnxruntime ONNX file in onnxruntime-web, WebGPU provider, headless Chromium"

    def runnable(self) -> tuple[bool, str]:
        why = webgpu_missing()
        return not why, why


FLOAT32_NAME = "model_fp32.onnx"  # the export, beside the cast artifact until the cast is written


def cast_to_float16(src: Path, dst: Path) -> dict:
    """The float32 ONNX at `src` cast to float16 at `dst` as the web exports make their
    model_fp16.onnx: onnxconverter-common's `convert_float_to_float16(model, keep_io_types=True)`
    (float16 weights and arithmetic, float32 graph inputs and outputs, Casts at the edges)."""
    half = float16_cast.convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    onnx.save(half, str(dst))
    kinds = Counter(onnx.TensorProto.DataType.Name(t.data_type).lower() for t in half.graph.initializer)
    return {"program_dtype": "float16", "initializer_dtypes": dict(sorted(kinds.items())),
            "cast": f"onnxconverter-common=={_version('onnxconverter-common')} "
                    "convert_float_to_float16(keep_io_types=True)"}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


class OrtWebWebGpuFp16Backend(OrtWebWebGpuBackend):
    """Float16 as web ports ship it: the `ort-web-webgpu` backend's ONNX file cast to float16 the way
    the web exports make model_fp16.onnx (`cast_to_float16`), run in onnxruntime-web's WebGPU
    provider. Its float16 shaders need the adapter's `shader-f16` feature: without it the item is
    SKIPPED saying so. Judged by the float16 floor, as the other float16 backends are."""

    name = "ort-web-webgpu-fp16"
    precision = "float16"
    requires = OrtWebBackend.requires + ("onnxconverter_common",)
    description = ("the onnxruntime ONNX file cast to float16 as web ports ship it (onnxconverter-common, "
                   "keep_io_types), onnxruntime-web WebGPU provider (needs shader-f16; judged by the float16 floor)")

    def artifact_key(self, program_key: str) -> str:
        """Its own file (the cast), keyed by the float32 file's key and the converter's version."""
        return content_key("artifact", super().artifact_key(program_key), self.name,
                           _version("onnxconverter-common"))

    def compile(self, program_path: Path, out_dir: Path) -> dict:
        audit = export_onnx(program_path, out_dir / FLOAT32_NAME)
        audit.update(cast_to_float16(out_dir / FLOAT32_NAME, out_dir / ONNX_NAME))
        (out_dir / FLOAT32_NAME).unlink()
        return audit

    def runnable(self) -> tuple[bool, str]:
        ok, why = super().runnable()
        if not ok:
            return ok, why
        adapter = webgpu_adapter()
        return (True, "") if adapter.get("shader_f16") else (False, no_shader_f16(adapter))


NO_F16 = "requires f16 but the device does not support it"  # onnxruntime-web 1.30.0's error without shader-f16


def no_shader_f16(adapter: dict, whose: str = "the") -> str:
    """The skip's reason for a WebGPU adapter without the `shader-f16` feature."""
    named = " ".join(str(adapter[k]) for k in ("vendor", "architecture", "description") if adapter.get(k))
    return f"{whose} WebGPU adapter ({named or 'unnamed'}) has no shader-f16: float16 web models need it"
