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

import select
import shutil
import socket
import threading
import time
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
    busy in a long synchronous run does not (the browser's network stack holds the connection)."""

    def __init__(self, files: dict[str, Path] | None = None, trees: dict[str, Path] | None = None,
                 blobs: dict[str, bytes] | None = None, routes: dict | None = None,
                 streams: dict | None = None, host: str = LOOPBACK, port: int = 0) -> None:
        self.files = {k: Path(v) for k, v in (files or {}).items()}
        self.trees = {k.rstrip("/") + "/": Path(v) for k, v in (trees or {}).items()}
        self.blobs = dict(blobs or {})
        self.routes = dict(routes or {})
        self.streams = dict(streams or {})
        self.host, self.port = host, port
        self.posted: dict[str, bytes] = {}
        self.requests: list[str] = []  # "GET /path 200", in order: what the page asked for
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


def _handler_for(server: PageServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path, _, query = self.path.partition("?")
            if path in server.streams:
                self.stream(server.streams[path], dict(parse_qsl(query)))
                return
            what = server.resolve(self.path)
            server.requests.append(f"GET {self.path} {200 if what is not None else 404}")
            if what is None:
                self.send_error(404)
                return
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

        def log_message(self, *args) -> None:  # the run's log keeps the page's console, not every GET
            pass

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
