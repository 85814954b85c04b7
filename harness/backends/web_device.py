"""A browser target: the ort-web-* runs go to a page that the user opens on their own device.

Web ports fail on particular devices (a laptop GPU's WebGPU corrupting audio, a phone's browser),
which no headless Chromium here reproduces. A `kind: browser` target (targets.yaml) serves the
same page (web/runner.html in device mode), onnxruntime-web's files, the model and the inputs from
one PageServer, prints its URL and waits for a browser to open it. The page polls `/next`, runs
each run it is given and posts the outputs' bytes and its answer back, so one page load serves
every item of the session. The server listens on loopback unless the targets file names another
address, serves only the harness's own files of the run under way, and answers only requests that
carry the run's key: a random token in the printed URL, kept by the device's browser as a cookie
(on a LAN address, another machine that finds the port gets 403, not the model or a run to answer).

The run job runs in this process; the browser is the isolation. The page holds an event stream
(`/alive`) open for as long as it is there: when the page that took a run goes away before
answering (the tab closed, the browser's renderer crashed or was killed out of memory), its
connection closes and the item is CRASHED within seconds; a page that stays but never answers is
the item's TIMEOUT at the run limit (a long synchronous WebAssembly run keeps the connection: the
browser, not the page's script, holds it); an error in the page, a lost WebGPU device included,
is its RUN_ERROR with the browser's message. The next item waits for a page again (the URL is
printed again). A page that never comes, a WebGPU item where the device's browser has no
adapter, or a float16 model where its adapter has no `shader-f16`, is the item's SKIPPED, never a pass.
"""
from __future__ import annotations

import importlib
import itertools
import json
import secrets
import threading
import time
import traceback
from pathlib import Path

from .. import progress
from ..plumbing.jobs import JobResult, first_error_line
from ..plumbing.targets import BrowserTarget, TargetUnreachable
from . import get_backend
from .onnxruntime_web import (NO_F16, NPM_PACKAGE, OrtWebBackend, PageCrashed, no_shader_f16, on_device, page_files,
                              read_outputs, run_audit, stage_job, web_dir)
from .web_page import LOOPBACK, PageServer

RUN_FUNCTION = "harness.backends:run_artifact_job"  # an ort-web-* run
# ... and a localization's: the marked model, each stage's subgraph and the defects' effects run on
# the device's page too (harness.port.onnx_stages.stage_runner), so `--bisect` names what it computes wrong
DEVICE_JOBS = (RUN_FUNCTION, "harness.port.onnx_steps:localize_job", "harness.port.onnx_stages:effects_job")
PROGRESS_S = 10  # a progress line this often while no browser has come
SEEN_S = 3  # a page that polled this recently is there: no need to print the URL again
PAGE = "/runner.html?device"
GONE_S = 2.0  # a page whose connection is gone this long (no EventSource reconnect) went away


def listen_address(listen: str | None) -> tuple[str, int]:
    """(host, port) of a target's `listen` ("0.0.0.0:8765", "192.168.1.5", "[::]:8765"): loopback
    and a free port unless written."""
    if not listen:
        return LOOPBACK, 0
    host, sep, port = listen.rpartition(":")
    if not sep or host.endswith(":") or (host.startswith("[") != host.endswith("]")):  # a bare IPv6 address
        return listen.strip("[]"), 0
    return host.strip("[]"), int(port)


class DeviceSkip(Exception):
    """The device cannot take the run (no browser opened the URL, no WebGPU there): the item's SKIPPED."""


class PageGone(PageCrashed):
    """The page that took a run went away before answering (tab closed, renderer crashed): CRASHED."""


def takes(backend) -> bool:
    """Whether a device's page can run `backend`'s items: onnxruntime-web's, a step's or a user's ONNX."""
    return isinstance(backend, OrtWebBackend) or str(getattr(backend, "runtime", "")).startswith("ort-web-")


class Device:
    """The server a device's page polls, and the hand-over of one run at a time to it."""

    def __init__(self, host: str, port: int, wait_s: float) -> None:
        self.wait_s = wait_s
        self.key = secrets.token_urlsafe(12)  # this run's: a page without it gets nothing (PageServer.admits)
        self.server = PageServer(files=page_files(), trees={"/ort/": web_dir() / "node_modules" / NPM_PACKAGE / "dist"},
                                 routes={"/next": self._next}, streams={"/alive": self._alive}, host=host, port=port,
                                 key=self.key)
        self._lock = threading.Lock()
        self._pending: dict | None = None  # the run no page has taken yet
        self._taken = threading.Event()
        self._came = threading.Event()  # a page polled
        self._polled = 0.0  # when a page last asked for a run (monotonic)
        self._ids = itertools.count(1)
        self._open: dict[str, int] = {}  # page id -> its /alive connections open now
        self._left: dict[str, float] = {}  # page id -> when its last /alive connection closed (monotonic)
        self._taker: str | None = None  # the page that took the run under way
        self.seen: dict = {}  # the user agent and adapter of the page that took the last run
        self._started = False
        self.run_s = 3600.0  # how long a taken run may take (the job's time limit)

    @property
    def url(self) -> str:
        return f"{self.server.url}{PAGE}&key={self.key}"

    def start(self) -> None:
        if not self._started:
            self.server.__enter__()
            self._started = True

    def close(self) -> None:
        if self._started:
            self.server.__exit__(None, None, None)
            self._started = False

    def _next(self, query: dict) -> bytes:
        """GET /next?page=ID: the run no page has taken yet (taken by this request), or {}."""
        with self._lock:
            self._polled = time.monotonic()
            self._came.set()
            job, self._pending = self._pending, None
            if job is not None:
                self._taker = query.get("page")
        if job is None:
            return b"{}"
        self._taken.set()
        return json.dumps(job).encode()

    def _alive(self, query: dict, opened: bool) -> None:
        """GET /alive?page=ID, the page's event stream: opened, or its connection gone."""
        page = query.get("page")
        if not page:
            return
        with self._lock:
            self._open[page] = self._open.get(page, 0) + (1 if opened else -1)
            if not self._open[page]:
                self._left[page] = time.monotonic()

    def _gone(self, page: str | None) -> bool:
        """Whether `page` held /alive and has held no connection for GONE_S (an EventSource that
        lost its connection reconnects sooner). A page never seen on /alive is never gone: its
        hang is the run limit's."""
        with self._lock:
            return (page is not None and page in self._open and not self._open[page]
                    and time.monotonic() - self._left[page] > GONE_S)

    def run(self, model: Path, feed: dict, execution_provider: str, bundle: str) -> tuple:
        """`run_in_browser`'s run on the device: ({output name: array}, the audit of where it ran)."""
        self.start()
        timeout = self.run_s
        job_id = str(next(self._ids))
        cfg = stage_job(self.server, model, feed, execution_provider, bundle, outputs=f"/output/{job_id}/")
        self._taken.clear()
        with self._lock:
            self._pending = {"id": job_id, "cfg": cfg}
        try:
            self._wait(self._taken)
        except DeviceSkip:
            with self._lock:
                self._pending = None
            if not self._taken.is_set():  # else taken in the last instant
                raise
        taken = time.monotonic()
        deadline = taken + timeout
        about = self.server.posted.get(f"/about/{self._taker}")  # the page's user agent and adapter, posted on load
        if about:
            said = json.loads(about)
            self.seen = {"user_agent": said.get("user_agent"), "webgpu_adapter": said.get("adapter")}
        while f"/answer/{job_id}" not in self.server.posted:
            if self._gone(self._taker):
                self._polled = 0.0  # no page there now: the next run prints the URL again
                raise PageGone(f"the device's page went away during the run (tab closed or crashed) after "
                               f"{time.monotonic() - taken:.0f} s")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the device's page gave no answer after {timeout:.0f} s")
            time.sleep(0.05)
        self._polled = time.monotonic()  # the page is there: it polls again after its answer
        said = json.loads(self.server.posted[f"/answer/{job_id}"])
        self.seen = {"user_agent": said.get("user_agent"), "webgpu_adapter": said.get("adapter")}
        if "error" in said and execution_provider == "webgpu" and "error" in (said.get("adapter") or {}):
            raise DeviceSkip(f"the device's browser has no WebGPU: {said['adapter']['error']}")
        if "error" in said and execution_provider == "webgpu" and NO_F16 in said["error"]:  # a float16 model
            raise DeviceSkip(no_shader_f16(said.get("adapter") or {}, "the device's"))
        if "error" in said:
            raise RuntimeError(f"onnxruntime-web ({execution_provider}) on the device: {said['error']}")
        browser = {"user_agent": said.get("user_agent"), "device": True}
        return (read_outputs(self.server, said["answer"], f"/output/{job_id}/"),
                run_audit(said["answer"], said.get("console", []), browser, cfg))

    def wait_for_page(self) -> None:
        """Until a page polls: at once when one did in the last SEEN_S, so that a run's time is not
        the user's way to the URL."""
        if time.monotonic() - self._polled > SEEN_S:
            self._came.clear()
            self._wait(self._came)

    def _wait(self, done: threading.Event) -> None:
        """Until `done`: the URL once when no page is polling, then a progress line every
        PROGRESS_S; DeviceSkip after `wait_s`."""
        start = time.monotonic()
        if start - self._polled > SEEN_S:
            progress.say(f"kokoro-parity: open {self.url} on the device (waiting up to {self.wait_s:.0f} s)")
        while not done.wait(min(PROGRESS_S, max(0.0, start + self.wait_s - time.monotonic()))):
            waited = time.monotonic() - start
            if waited >= self.wait_s:
                raise DeviceSkip(f"no browser opened the URL within {self.wait_s:.0f} s")
            progress.say(f"kokoro-parity: waiting for a browser at {self.url}: {waited:.0f} s of {self.wait_s:.0f} s")


class DeviceTarget(BrowserTarget):
    """A `kind: browser` target: its run jobs go to the device's page (`Device`), in this process."""

    def __init__(self, name: str, spec) -> None:
        super().__init__(name, spec)
        self.device = Device(*listen_address(spec.listen), spec.wait_s)

    def runnable(self, backend) -> tuple[bool, str]:
        if takes(backend):
            return True, ""
        return False, (f"target {self.name!r} is a browser on the user's device: it runs onnxruntime-web "
                       f"items only (ort-web-wasm, ort-web-webgpu, --artifact-runtime ort-web-*)")

    def available(self, backend) -> tuple[bool, str]:
        """The backend's own check, less the Chromium that the device's browser replaces."""
        with on_device(self.device):
            return backend.available()

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, **({"device": self.device.seen} if self.device.seen else {})}

    def run_job(self, function, kwargs, workdir, timeout, files=None, warm=False, preload=None) -> JobResult:
        """The job's function here, its browser runs on the device; the record's `target` gets the
        device's user agent and adapter (`extra["device_target"]`)."""
        if function not in DEVICE_JOBS or not takes(get_backend(kwargs.get("backend") or kwargs["runtime"])):
            raise TargetUnreachable(self.runnable(object())[1])
        module, _, name = function.partition(":")
        Path(workdir).mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        self.device.run_s = timeout
        try:
            self.device.start()
            self.device.wait_for_page()  # before the job: its run_s is the device's, not the user's wait
            with on_device(self.device):
                value = getattr(importlib.import_module(module), name)(**kwargs)
        except DeviceSkip as e:
            raise TargetUnreachable(str(e)) from None
        except TimeoutError as e:
            return JobResult("timeout", error=str(e), seconds=time.monotonic() - start,
                             extra={"device_target": self.describe()})
        except Exception as e:  # noqa: BLE001 - the run's failure is the item's verdict
            return JobResult(getattr(e, "job_status", "error"), error=first_error_line(e),
                             traceback=traceback.format_exc(), seconds=time.monotonic() - start,
                             extra={"device_target": self.describe()})
        return JobResult("ok", value=value, seconds=time.monotonic() - start,
                         extra={"device_target": self.describe()})

    def close(self) -> None:
        self.device.close()

