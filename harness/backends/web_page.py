"""A loopback HTTP server for one browser run, and the headless Chromium that loads its page.

The ort-web-* backends (harness.backends.onnxruntime_web) run an ONNX file inside a web page, as
a web port does. Everything the page needs comes from this server on 127.0.0.1: the page, the
runtime's JavaScript and WebAssembly from web/node_modules, the model file (served from disk in
chunks: a 90 MB model is never inlined into a script or a protocol message), each input's raw
bytes; the page posts each output's raw bytes back. Nothing is fetched from the internet, and the
server stops with the run. Tensors cross the page boundary as bytes, never as JSON number lists.
A browser target (harness.backends.web_device) serves a page on the user's own device from the
same server, on another address only when its targets.yaml entry says so.
"""
from __future__ import annotations

import atexit
import hmac
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl

CHROMIUM = "/usr/bin/chromium"  # Debian's; Playwright's own browser downloads are never used
# What every run's browser starts with: no network of its own, no first-run work, no sandbox (the
# job's child may run as root in a container, where Chromium's sandbox cannot start)
BASE_FLAGS = ["--headless", "--no-sandbox", "--disable-quic", "--no-first-run", "--disable-background-networking",
              "--disable-component-update", "--disable-sync", "--disable-default-apps", "--mute-audio"]
# Headless Chromium hides WebGPU unless asked; on a machine without a GPU it then offers Dawn's
# SwiftShader (Vulkan on the CPU) adapter. The wasm backend keeps the GPU process off.
WEBGPU_FLAGS = ["--enable-unsafe-webgpu"]
WASM_FLAGS = ["--disable-gpu"]

TYPES = {".html": "text/html", ".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
         ".json": "application/json", ".onnx": "application/octet-stream", ".map": "application/json"}
CHUNK = 1 << 20
BEAT_S = 1.0  # an event stream's comment this often: a page that went away is seen within it
RETRY_MS = 500  # how soon a page's EventSource reconnects after a lost connection


# what a page may POST: outputs' bytes, a device page's answer and its description (user agent, adapter)
POSTED = ("/output/", "/answer/", "/about/")
LOOPBACK = "127.0.0.1"
KEY_COOKIE = "kokoro_parity_key"  # suffixed with the port: a browser keeps cookies per host, not per port


class PageServer:
    """Serves `files` (URL path -> file), `trees` (URL prefix -> directory), `blobs` (URL path ->
    bytes), `routes` (URL path -> a function of the request's query ({name: value}) giving the
    bytes at each request) and `streams` (URL path -> a function told (query, True) when a page
    opens that event stream and (query, False) when the connection is gone) on `host` (loopback
    unless a caller names another address) and keeps what the page POSTs under `/output/`,
    `/answer/` and `/about/` in `posted` (path -> bytes). A context manager: the server runs in a
    thread while the `with` block lasts; its streams' handlers end with it.

    An event stream (text/event-stream, a page's `EventSource`) gets a comment every BEAT_S for as
    long as the page holds it: a closed or crashed tab closes its connection, which the server
    sees at once (the socket reads as closed) or at the next comment (the write fails); a page
    busy in a long synchronous run does not (the browser's network stack holds the connection).

    With a `key`, a request is answered only when it carries it: the URL's `?key=` (the URL the
    harness prints; the answer sets it as a cookie) or that cookie (what the page's own fetches,
    scripts and event stream send). Anyone else who reaches the address (another machine on the
    LAN, another user of this one) gets 403 and neither the model, the inputs nor a run to answer."""

    def __init__(self, files: dict[str, Path] | None = None, trees: dict[str, Path] | None = None,
                 blobs: dict[str, bytes] | None = None, routes: dict | None = None,
                 streams: dict | None = None, host: str = LOOPBACK, port: int = 0, key: str | None = None) -> None:
        self.files = {k: Path(v) for k, v in (files or {}).items()}
        self.trees = {k.rstrip("/") + "/": Path(v) for k, v in (trees or {}).items()}
        self.blobs = dict(blobs or {})
        self.routes = dict(routes or {})
        self.streams = dict(streams or {})
        self.host, self.port, self.key = host, port, key
        self.posted: dict[str, bytes] = {}
        self.requests: list[str] = []  # "GET /path 200", in order: what the page asked for
        self.served: set[str] = set()  # every path answered 200 since the server started (not cleared per run)
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._closing = threading.Event()  # the streams' handlers end when set
        self._streaming: set[threading.Thread] = set()  # handler threads holding a stream open
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        if host in ("0.0.0.0", "::"):  # every interface: the address a device on the LAN would use
            host = lan_address()
        return f"http://{host}:{port}"

    def __enter__(self) -> "PageServer":
        self._closing.clear()
        self._server = ThreadingHTTPServer((self.host, self.port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="page-server", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._closing.set()  # every stream's handler ends within BEAT_S
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        deadline = time.monotonic() + 2 * BEAT_S + 1
        with self._lock:
            streaming = list(self._streaming)
        for thread in streaming:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def admits(self, path: str, cookies: str) -> tuple[bool, str]:
        """(whether a request for `path` with these Cookie headers may be answered, the Set-Cookie
        header to send with the answer: the key's cookie when the URL carried it)."""
        if self.key is None:
            return True, ""
        name = f"{KEY_COOKIE}_{self._server.server_address[1]}"
        given = dict(parse_qsl(path.partition("?")[2])).get("key", "")
        if hmac.compare_digest(given.encode(), self.key.encode()):
            return True, f"{name}={self.key}; Path=/; HttpOnly; SameSite=Strict"
        jar = dict(part.strip().partition("=")[::2] for part in cookies.split(";") if "=" in part)
        return hmac.compare_digest(jar.get(name, "").encode(), self.key.encode()), ""

    def resolve(self, path: str) -> Path | bytes | None:
        """What a GET of `path` serves: a file, bytes, or None (404). A tree never serves outside itself."""
        path, _, query = path.partition("?")
        if path in self.routes:
            return self.routes[path](dict(parse_qsl(query)))
        if path in self.blobs:
            return self.blobs[path]
        if path in self.files:
            return self.files[path]
        for prefix, root in self.trees.items():
            if path.startswith(prefix):
                target = (root / path[len(prefix):]).resolve()
                if target.is_file() and target.is_relative_to(root.resolve()):
                    return target
        return None


class _KeyedHandler(BaseHTTPRequestHandler):
    """What every request of a PageServer (`page`) goes through first: its key, and no access log."""

    page: PageServer
    cookie = ""  # the Set-Cookie of this answer: the key's cookie when the URL carried the key

    def refused(self) -> bool:
        """Answer 403 to a request without the server's key (see PageServer.admits)."""
        ok, self.cookie = self.page.admits(self.path, "; ".join(self.headers.get_all("Cookie") or []))
        if not ok:
            self.page.requests.append(f"{self.command} {self.path.partition('?')[0]} 403")
            self.send_error(403, "kokoro-parity: open the URL the harness printed (it carries the run's key)")
        return not ok

    def end_headers(self) -> None:
        if self.cookie:
            self.send_header("Set-Cookie", self.cookie)
        super().end_headers()

    def log_message(self, *args) -> None:  # the run's log keeps the page's console, not every GET
        pass


def _handler_for(server: PageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_KeyedHandler):
        page = server

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.refused():
                return
            path, _, query = self.path.partition("?")
            if path in server.streams:
                self.stream(server.streams[path], dict(parse_qsl(query)))
                return
            what = server.resolve(self.path)
            server.requests.append(f"GET {self.path} {200 if what is not None else 404}")
            if what is None:
                self.send_error(404)
                return
            server.served.add(path)
            size = len(what) if isinstance(what, bytes) else what.stat().st_size
            suffix = "" if isinstance(what, bytes) else what.suffix
            self.send_response(200)
            self.send_header("Content-Type", TYPES.get(suffix, "application/octet-stream"))
            self.send_header("Content-Length", str(size))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            try:
                if isinstance(what, bytes):
                    self.wfile.write(what)
                else:
                    with open(what, "rb") as f:
                        shutil.copyfileobj(f, self.wfile, CHUNK)
            except ConnectionError:  # the page went away mid-file (a closed tab): its run's verdict says so
                self.close_connection = True

        def do_POST(self) -> None:  # noqa: N802
            if self.refused():
                return
            if not self.path.startswith(POSTED):
                self.send_error(404)
                return
            length = int(self.headers.get("Content-Length", "0"))
            server.posted[self.path] = self.rfile.read(length)
            server.requests.append(f"POST {self.path} 200")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def stream(self, told, query: dict) -> None:
            """An event stream held open until the page goes or the server closes; `told` hears both ends."""
            server.requests.append(f"GET {self.path} 200")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            me = threading.current_thread()
            with server._lock:
                server._streaming.add(me)
            told(query, True)
            try:
                self.wfile.write(f"retry: {RETRY_MS}\n\n".encode())
                while not server._closing.is_set():
                    readable, _, _ = select.select([self.connection], [], [], BEAT_S)
                    if readable and not self.connection.recv(1024):  # the page closed its end (EOF)
                        break
                    self.wfile.write(b": alive\n\n")  # fails once the page's end is gone
            except OSError:  # reset or broken pipe: the page is gone
                pass
            finally:
                told(query, False)
                with server._lock:
                    server._streaming.discard(me)
                self.close_connection = True

    return Handler


def lan_address() -> str:
    """This machine's address on the network its default route leaves by (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only the route is looked up
            return s.getsockname()[0]
        except OSError:
            return socket.gethostname()


def launch_chromium(playwright, webgpu: bool):
    """Debian's Chromium, headless, through Playwright (`executable_path`: its downloads unused)."""
    flags = BASE_FLAGS + (WEBGPU_FLAGS if webgpu else WASM_FLAGS)
    return playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)


# What a shared browser adds to BASE_FLAGS (Playwright's launch passes these itself): no throttling
# of a page's timers or renderer, /tmp rather than a small container's /dev/shm, no crash reporter,
# no hang monitor (a long synchronous run is a run, not a hang: the run limit judges it)
SHARED_FLAGS = ["--disable-dev-shm-usage", "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
                "--disable-backgrounding-occluded-windows", "--disable-breakpad", "--disable-hang-monitor",
                "--disable-extensions", "--no-default-browser-check", "--password-store=basic"]
START_S = 30  # how long a shared browser may take to open its DevTools port
_LIVE: "set[SharedBrowser]" = set()  # stopped at exit (a session that was never closed)


class SharedBrowser:
    """One headless Chromium a harness run (harness.runner.Session) keeps for its items' runs, as
    it keeps a warm worker: started on first use, with DevTools on a loopback port of its own
    (`--remote-debugging-port=0`); each run's child process connects to `endpoint` over CDP and
    opens its page in a fresh context of its own, which Chromium disposes of when the child
    disconnects or is killed. The browser is the parent's, in its own process group: a child
    killed at the run limit leaves it running; one that died (a crash, the OOM killer) or stopped
    answering is started again at the next `ensure`. `close` ends it and its profile."""

    def __init__(self, webgpu: bool) -> None:
        self.webgpu = webgpu
        self.launches = 0  # browsers started (1 unless one died)
        self.proc: subprocess.Popen | None = None
        self.endpoint: str | None = None  # ws://127.0.0.1:PORT/devtools/browser/ID
        self.port: int | None = None
        self._dir: Path | None = None  # the profile and the browser's log
        self._first_page: str | None = None
        self.error = ""  # why it could not start: its session's runs then start their own, without waiting again
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        """The browser's process runs and its DevTools port answers."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            self._get("/json/version", timeout=5)
            return True
        except (OSError, ValueError):
            return False

    def ensure(self) -> str:
        """The endpoint of a running browser: this one, or a new one when it is gone."""
        with self._lock:
            if self.endpoint is None or not self.alive():
                self._stop()
                self._start()
            return self.endpoint

    def tidy(self) -> None:
        """After a run that failed (crash, timeout, error): close the pages its child left open,
        and stop a browser that no longer answers (the next `ensure` starts another)."""
        with self._lock:
            if self.proc is None:
                return
            if not self.alive():
                self._stop()
                return
            try:
                for target in json.loads(self._get("/json/list", timeout=5)):
                    if target.get("type") == "page" and target.get("id") != self._first_page:
                        self._get(f"/json/close/{target['id']}", timeout=5)
            except (OSError, ValueError):
                self._stop()

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _get(self, path: str, timeout: float) -> str:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.port}{path}", timeout=timeout) as r:
            return r.read().decode()

    def _start(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="kokoro-parity-chromium-"))
        flags = BASE_FLAGS + SHARED_FLAGS + (WEBGPU_FLAGS if self.webgpu else WASM_FLAGS)
        with open(self._dir / "chromium.log", "wb") as log:
            self.proc = subprocess.Popen(
                [CHROMIUM, *flags, "--remote-debugging-port=0", f"--remote-debugging-address={LOOPBACK}",
                 f"--user-data-dir={self._dir / 'profile'}", "about:blank"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _LIVE.add(self)
        active = self._dir / "profile" / "DevToolsActivePort"  # "PORT\n/devtools/browser/ID"
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            lines = active.read_text().split() if active.exists() else []
            if len(lines) == 2:
                self.port = int(lines[0])
                self.endpoint = f"ws://{LOOPBACK}:{self.port}{lines[1]}"
                break
            time.sleep(0.05)
        if self.endpoint is None:
            tail = (self._dir / "chromium.log").read_text(errors="replace").strip().splitlines()[-3:]
            code = self.proc.poll()
            self._stop()
            why = f"exited with code {code}" if code is not None else f"opened no DevTools port within {START_S} s"
            raise RuntimeError(f"{CHROMIUM} {why}" + (f": {' / '.join(tail)}" if tail else ""))
        try:
            pages = [t for t in json.loads(self._get("/json/list", timeout=10)) if t.get("type") == "page"]
        except (OSError, ValueError):
            pages = []
        self._first_page = pages[0]["id"] if pages else None  # the startup about:blank, kept
        self.launches += 1

    def _stop(self) -> None:
        proc, self.proc, self.endpoint, self.port = self.proc, None, None, None
        if proc is not None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the browser and every process it started
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        _LIVE.discard(self)


@atexit.register
def _stop_shared_browsers() -> None:
    for browser in list(_LIVE):
        browser.close()
