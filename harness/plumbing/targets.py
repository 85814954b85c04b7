"""Targets: where a run job executes. `local` (this machine, the default), a machine over SSH, or
a browser on the user's own device (`kind: browser`: harness.backends.web_device).

A job is a directory (plumbing/jobs.py). An SSH target ships what the job needs and runs it there
with OpenSSH's own client (`ssh`, the Debian/macOS binary; no Python SSH library, so the user's
~/.ssh/config, agent, ProxyJump and known_hosts work as they do in a shell):

1. `prepare`: one `ssh` asks which content-addressed entries the target's cache already holds
   (the shipped harness source and the artifact, keyed by their content).
2. `upload`: one `ssh` whose stdin is a tar stream (Python's tarfile here, the target's `tar -x`
   there): the missing cache entries and the run's input files.
3. `run`: one `ssh` runs `python -m harness.plumbing.targets serve RUN_DIR`: the same
   `jobs.run_job` as a local run (child process, its own time limit, peak memory, signals), then
   streams back a tar of the job's result, log and declared outputs, and deletes the run dir.
   Its stdin stays open: when the connection drops or the host kills its `ssh` at the time
   limit, the remote side reads EOF and kills the job's process group.

The remote Python needs torch and the backend's package, not kokoro-parity: the host's `harness`
source is shipped (once per content hash) and put first on PYTHONPATH, so host and target always
run the same harness code. The target's cache (`<work_dir>/cache`) is bounded (`cache_max_gb`,
least recently used entries go first); nothing else stays there after a run.

Faults: an `ssh` exit status 255 is a transport failure (refused, authentication, host key,
dropped connection), anything else is the job's own outcome. A transport failure before the job
started makes the target unreachable (the item is SKIPPED with the reason); during the job it is
retried once, then the job is `crashed` with the reason. No secret (key, password) is ever in a
command line, record or log: only paths to key files go to `ssh -i`.
"""
from __future__ import annotations

import hashlib
import importlib.metadata as md
import io
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import types
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from . import cache, jobs, worker
from .files import atomic_write_bytes, atomic_write_json, content_key
from .jobs import JobResult, first_error_line, run_job
from .errors import UsageError
from .deferred import deferred_import

# imported at their first use (harness.plumbing.deferred)
platformdirs = deferred_import("platformdirs")
pydantic = deferred_import("pydantic")
yaml = deferred_import("yaml")

TARGETS_ENV = "KOKORO_PARITY_TARGETS"  # path of the targets file
FILE_NAME = "targets.yaml"
TRANSPORT_EXIT = 255  # ssh's own failures; a remote command's status is passed through otherwise

# What a job's file kwargs are: "artifact" (shipped once per content hash into the target's cache),
# "artifact_entry" (the same for the directory holding it: a cache entry, with what the backend keeps
# beside its artifact, e.g. ONNX Runtime's io.json), "input" (shipped with each run), "output"
# (fetched back into the local path), "output_dir" (a directory the job fills, fetched back: a
# compile on the target).
FILE_KINDS = ("artifact", "artifact_entry", "input", "output", "output_dir")


class TargetError(UsageError):
    """A malformed targets file or an unknown target: a usage error, naming the file and field."""


class TargetUnreachable(Exception):
    """The target cannot take jobs (connection, authentication, host key, missing Python)."""


class TransportError(Exception):
    """`ssh` itself failed (exit status 255) while a job was under way."""


# ---- the targets file ---------------------------------------------------------------------------

def _models():
    """pydantic models, built on first use (the remote side of a job never imports pydantic)."""
    class LocalSpec(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        kind: Literal["local"] = "local"

    class SshSpec(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        kind: Literal["ssh"]
        host: str = pydantic.Field(min_length=1, description="host name, address or ~/.ssh/config alias")
        user: str | None = None
        port: int | None = pydantic.Field(default=None, ge=1, le=65535)
        identity_file: str | None = None  # a path; the key itself never enters this file
        python: str = pydantic.Field(default="python3", min_length=1,
                                     description="the target's Python (a venv's bin/python)")
        work_dir: str = pydantic.Field(default=".kokoro-parity", min_length=1,
                                       description="the target's directory (relative: to the remote home)")
        known_hosts: str | None = None  # then StrictHostKeyChecking=yes against this file only
        ssh_config: str | None = None  # ssh -F (`none`: no configuration file)
        ssh_options: list[str] = pydantic.Field(default_factory=list, description="extra `-o Key=Value` options")
        connect_timeout_s: float = pydantic.Field(default=10, gt=0)
        multiplex: bool = pydantic.Field(default=True,
                                         description="one SSH connection for a session's jobs (ControlMaster)")
        cache_max_gb: float = pydantic.Field(default=20, gt=0)
        env: dict[Annotated[str, pydantic.Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = pydantic.Field(
            default_factory=dict, description="environment of the target's jobs: thread counts, CPU kernel pins "
                                              "(ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS)")

    class BrowserSpec(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        kind: Literal["browser"]
        listen: str | None = pydantic.Field(
            default=None, pattern=r"^(\[[0-9A-Fa-f:.]+\]|[^\s:]+)(:\d{1,5})?$",
            description="HOST[:PORT] the page is served on; default 127.0.0.1 and a free port. Another "
                        "address (0.0.0.0: the LAN) only when written here")
        wait_s: float = pydantic.Field(default=300, gt=0, description="how long an item waits for a browser")

    class TargetsFile(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        targets: dict[str, Annotated[Union[LocalSpec, SshSpec, BrowserSpec], pydantic.Field(discriminator="kind")]]

    return LocalSpec, SshSpec, TargetsFile


def targets_file(explicit: str | os.PathLike | None = None) -> Path | None:
    """The targets file: `explicit` (--targets-file), $KOKORO_PARITY_TARGETS, ./targets.yaml, or
    targets.yaml in the user's config dir (platformdirs), in that order; None if there is none."""
    if explicit or os.environ.get(TARGETS_ENV):
        path = Path(explicit or os.environ[TARGETS_ENV]).expanduser()
        if not path.is_file():
            raise TargetError(f"{path}: targets file not found")
        return path

    for path in (Path.cwd() / FILE_NAME, Path(platformdirs.user_config_dir("kokoro-parity")) / FILE_NAME):
        if path.is_file():
            return path
    return None


def load_specs(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """name -> validated spec; `local` is always there. Errors name the file and the field."""
    LocalSpec, _, TargetsFile = _models()
    found = targets_file(path)
    specs: dict[str, Any] = {}
    if found is not None:
        try:
            raw = yaml.safe_load(found.read_text())
        except yaml.YAMLError as e:
            raise TargetError(f"{found}: not valid YAML: {first_error_line(e)}") from None
        try:
            specs = dict(TargetsFile.model_validate(raw if raw is not None else {"targets": {}}).targets)
        except pydantic.ValidationError as e:
            problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'] if not str(p).startswith(('LocalSpec', 'SshSpec', 'BrowserSpec')) and p not in ('local', 'ssh', 'browser')) or '(top level)'}: {err['msg']}"
                                 for err in e.errors())
            raise TargetError(f"{found}: {problems}") from None
        if "local" in specs and specs["local"].kind != "local":
            raise TargetError(f"{found}: targets.local: the name `local` is reserved for this machine")
    specs.setdefault("local", LocalSpec())
    return specs


def get_target(name: str, path: str | os.PathLike | None = None) -> "Target":
    specs = load_specs(path)
    if name not in specs:
        where = targets_file(path)
        raise TargetError(f"unknown target {name!r}; known: {', '.join(sorted(specs))} "
                          f"({where or 'no targets file: ./targets.yaml, the user config dir or --targets-file'})")
    spec = specs[name]
    return {"local": lambda: LocalTarget(), "ssh": lambda: SshTarget(name, spec),
            "browser": lambda: BrowserTarget(name, spec)}[spec.kind]()


# ---- what a target is -----------------------------------------------------------------------------

def probe() -> dict[str, Any]:
    """The machine and its Python (the local description; on a target, part of the backends'
    `probe_job`, which adds whether each backend can run there)."""
    out: dict[str, Any] = {"os": platform.system(), "os_release": platform.release(), "machine": platform.machine(),
                           "python": platform.python_version(), "platform": platform.platform()}
    if platform.system() == "Darwin":
        out["macos"] = platform.mac_ver()[0]
    packages = {}
    for pkg in ("torch", "numpy"):
        try:
            packages[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            packages[pkg] = None
    out["packages"] = packages
    return out


class Target:
    name = "local"
    kind = "local"

    def run_job(self, function: str, kwargs: dict[str, Any], workdir: Path, timeout: float,
                files: dict[str, str] | None = None, warm: bool = False, preload: dict | None = None) -> JobResult:
        """`jobs.run_job`, wherever the target is. `files`: kwarg name -> "artifact" | "input" |
        "output" for the kwargs that are paths (the remote run gets its own paths for them).
        `warm`: a torch-free job that may run in a warm worker (harness.plumbing.worker);
        `preload`: what the job's process may import before it (a spare `prestart`ed for it)."""
        raise NotImplementedError

    def job_or_error(self, function: str, kwargs: dict[str, Any], workdir: Path, timeout: float) -> JobResult:
        """`run_job`, with a target that cannot take the job (no page came, the host is gone) as that
        job's error: for a localization's jobs, whose failure is said, never a pass."""
        try:
            return self.run_job(function, kwargs, workdir, timeout)
        except TargetUnreachable as e:
            return JobResult("error", error=f"target {self.name!r}: {e}")

    def prestart(self, preload: dict) -> None:
        """A job with this `preload` will follow: start its process now, where that helps."""

    def runnable(self, backend) -> tuple[bool, str]:
        """Whether the backend's run phase can execute on this target."""
        raise NotImplementedError

    def available(self, backend) -> tuple[bool, str]:
        """Whether this machine has what the backend's items need here (its packages, tools)."""
        return backend.available()

    def describe(self) -> dict[str, Any]:
        """What a record says about where it ran: name, kind, OS, machine, Python, versions."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class LocalTarget(Target):
    def __init__(self) -> None:
        self._info: dict | None = None

    def run_job(self, function, kwargs, workdir, timeout, files=None, warm=False, preload=None) -> JobResult:
        if warm:
            return worker.run_warm_job(function, kwargs, workdir, timeout)
        if preload:
            return worker.run_spare_job(preload, function, kwargs, workdir, timeout)
        return run_job(function, kwargs, workdir, timeout)

    def prestart(self, preload: dict) -> None:
        worker.prestart(preload)

    def runnable(self, backend) -> tuple[bool, str]:
        return backend.runnable()

    def describe(self) -> dict[str, Any]:
        if self._info is None:
            self._info = {"name": "local", "kind": "local", **probe()}
        return dict(self._info)


class BrowserTarget(Target):
    """A `kind: browser` target: a page the user opens on their own device runs the onnxruntime-web
    items (harness.backends.web_device.DeviceTarget, which the session builds from this: the
    plumbing imports no backend)."""

    kind = "browser"

    def __init__(self, name: str, spec) -> None:
        self.name, self.spec = name, spec

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind}


# ---- SSH ------------------------------------------------------------------------------------------------

_DIGESTS: dict[tuple, str] = {}


def content_digest(path: Path) -> str:
    """sha256 of a file, or of a directory's relative paths and contents (an .mlpackage);
    memoized per (path, size, mtime) in this process."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    stamp = (str(path.resolve()), *((str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files))
    if stamp not in _DIGESTS:
        h = hashlib.sha256()
        for p in files:
            h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode() + b"\0")
            with open(p, "rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        _DIGESTS[stamp] = h.hexdigest()
    return _DIGESTS[stamp]


def harness_files() -> list[tuple[Path, str]]:
    """(local path, archive name) of the harness package's source: what a target runs."""
    root = Path(__file__).resolve().parent.parent
    keep = (".py", ".yaml", ".html", ".css", ".js")
    return sorted((p, "harness/" + p.relative_to(root).as_posix()) for p in root.rglob("*")
                  if p.is_file() and p.suffix in keep and "__pycache__" not in p.parts)


def harness_key() -> str:
    h = hashlib.sha256()
    for p, name in harness_files():
        h.update(name.encode() + b"\0" + p.read_bytes())
    return "h-" + content_key("harness", h.hexdigest())


# the harness's own options travel with a job (--no-workaround, Core ML compute units, extra
# backends); paths of this machine do not
FORWARD_PREFIX = "KOKORO_PARITY_"
NOT_FORWARDED = ("KOKORO_PARITY_CACHE", "KOKORO_PARITY_CACHE_MAX_GB", TARGETS_ENV, "KOKORO_PARITY_WEIGHTS",
                 "KOKORO_PARITY_KEEP_FP32")


def forwarded_env() -> str:
    """`K=V ` words for the remote `env`: this process's KOKORO_PARITY_* options, shell-quoted."""
    return "".join(f"{shlex.quote(f'{k}={v}')} " for k, v in sorted(os.environ.items())
                   if k.startswith(FORWARD_PREFIX) and k not in NOT_FORWARDED)


def _transport_reason(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith(("Warning: Permanently",))]
    text = " ".join(lines)
    for needle, why in (("Host key verification failed", "host key verification failed"),
                        ("REMOTE HOST IDENTIFICATION HAS CHANGED", "host key mismatch"),
                        ("Permission denied", "authentication failed"),
                        ("Connection refused", "connection refused"),
                        ("Connection timed out", "connection timed out"),
                        ("Could not resolve hostname", "unknown host"),
                        ("No route to host", "no route to host")):
        if needle in text:
            return f"{why} ({lines[-1][:200]})" if lines else why
    return (lines[-1][:300] if lines else "ssh failed with no message")


@dataclass
class _Proc:
    returncode: int
    stderr: str


class SshTarget(Target):  # ~290 lines: one host's transport (connection, shipping, a job's round trip, cleanup)
    kind = "ssh"

    def __init__(self, name: str, spec) -> None:
        self.name, self.spec = name, spec
        self._probe: dict[str, Any] = {}
        self._unreachable: str | None = None
        self._control_dir: str | None = None
        self._known: set[str] = set()  # cache entries known to be on the target

    # -- ssh -----------------------------------------------------------------------------------
    def ssh_command(self, script: str) -> list[str]:
        """argv of `ssh` running `script` under the target's /bin/sh (its login shell may be zsh)."""
        s = self.spec
        cmd = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(s.connect_timeout_s)}",
               "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3", "-o", "LogLevel=ERROR"]
        if s.ssh_config:
            cmd += ["-F", s.ssh_config]
        if s.port:
            cmd += ["-p", str(s.port)]
        if s.user:
            cmd += ["-l", s.user]
        if s.identity_file:
            cmd += ["-i", str(Path(s.identity_file).expanduser()), "-o", "IdentitiesOnly=yes"]
        if s.known_hosts:
            cmd += ["-o", f"UserKnownHostsFile={Path(s.known_hosts).expanduser()}", "-o", "StrictHostKeyChecking=yes"]
        if s.multiplex:  # each job's 3 commands then share one connection (a handshake costs 0.4-0.8 s here)
            if self._control_dir is None:
                self._control_dir = tempfile.mkdtemp(prefix="kp-ssh-")
            cmd += ["-o", "ControlMaster=auto", "-o", f"ControlPath={self._control_dir}/%C", "-o", "ControlPersist=120"]
        for opt in s.ssh_options:
            cmd += ["-o", opt]
        return cmd + ["--", s.host, "sh -c " + shlex.quote(script)]

    def close(self) -> None:
        """End the shared connection (its master process), if any."""
        if self._control_dir is not None:
            cmd = self.ssh_command("true")
            subprocess.run(cmd[:cmd.index("--")] + ["-O", "exit", self.spec.host], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30, check=False)
            shutil.rmtree(self._control_dir, ignore_errors=True)
            self._control_dir = None

    def _ssh(self, script: str, stdin=None, timeout: float = 120) -> tuple[_Proc, bytes]:
        """Run `script` there; `stdin` a file to stream in (else nothing). Returns (status, stdout)."""
        with tempfile.TemporaryFile() as err:
            try:
                p = subprocess.run(self.ssh_command(script), stdin=stdin if stdin is not None else subprocess.DEVNULL,
                                   stdout=subprocess.PIPE, stderr=err, timeout=timeout)
            except subprocess.TimeoutExpired:
                raise TransportError(f"no answer from {self.name} within {timeout:.0f} s") from None
            err.seek(0)
            return _Proc(p.returncode, err.read().decode(errors="replace")), p.stdout

    def _wd(self) -> str:
        return shlex.quote(self.spec.work_dir)

    # -- what runs there ---------------------------------------------------------------------------
    def check(self, backends: list[str] = ()) -> dict[str, Any]:
        """The target's probe (cached): raises TargetUnreachable with the reason."""
        wanted = sorted(set(backends) - set(self._probe.get("backends", {})))
        if self._unreachable:
            raise TargetUnreachable(self._unreachable)
        if not self._probe or wanted:
            with tempfile.TemporaryDirectory(prefix="kp-probe-") as tmp:
                try:
                    r = self._run_once("harness.backends:probe_job", {"backends": wanted}, Path(tmp), 120, {})
                except (TransportError, TargetUnreachable) as e:
                    self._unreachable = f"target {self.name!r} unreachable: {e}"
                    raise TargetUnreachable(self._unreachable) from None
            if not r.ok:
                self._unreachable = f"target {self.name!r}: its Python cannot run the harness: {r.error}"
                raise TargetUnreachable(self._unreachable)
            backends_seen = {**self._probe.get("backends", {}), **(r.value.get("backends") or {})}
            self._probe = {**r.value, "backends": backends_seen}
        return self._probe

    def runnable(self, backend) -> tuple[bool, str]:
        try:
            info = self.check([backend.name])["backends"][backend.name]
        except TargetUnreachable as e:
            return False, str(e)
        if not info["ok"]:
            return False, f"on target {self.name!r}: {info['why']}"
        return True, ""

    def describe(self) -> dict[str, Any]:
        try:
            info = self.check()
        except TargetUnreachable as e:
            return {"name": self.name, "kind": "ssh", "reachable": False, "reason": str(e)}
        out = {"name": self.name, "kind": "ssh", **{k: v for k, v in info.items() if k != "backends"}}
        out["runtimes"] = {k: v["version"] for k, v in info.get("backends", {}).items() if v.get("version")}
        if self.spec.env:
            out["env"] = dict(self.spec.env)
        return out

    # -- a job ----------------------------------------------------------------------------------------------
    def run_job(self, function, kwargs, workdir, timeout, files=None, warm=False, preload=None) -> JobResult:
        """Ship, run, fetch. A transport failure during the job is retried once, then the job is
        `crashed` with the reason; TargetUnreachable when it never started."""
        last = ""
        for attempt in (1, 2):
            try:
                result = self._run_once(function, kwargs, Path(workdir), timeout, files or {})
                if attempt == 2:
                    result.extra["transport_retries"] = 1
                return result
            except TransportError as e:
                last = str(e)
            except TargetUnreachable as e:  # before the first start: unreachable; on the retry: the job's end
                if attempt == 1:
                    raise
                last = f"then unreachable: {e}"
        return JobResult("crashed", error=f"transport failure on target {self.name!r} during the job, "
                                          f"twice: {last}", log_tail="(the remote log could not be fetched)",
                         extra={"transport_retries": 1})

    def _run_once(self, function, kwargs, workdir: Path, timeout: float, files: dict[str, str]) -> JobResult:
        start = time.monotonic()
        workdir.mkdir(parents=True, exist_ok=True)
        run_id = f"{time.strftime('%Y%m%d%H%M%S')}-{uuid.uuid4().hex[:12]}"
        hkey = harness_key()
        entries: dict[str, tuple[Path, str]] = {}  # cache key -> (what to ship, its name in the entry)
        remote_kwargs, inputs, outputs, dirs = dict(kwargs), {}, {}, []
        for k, kind in files.items():
            local = Path(kwargs[k])
            if kind in ("artifact", "artifact_entry"):
                shipped = local if kind == "artifact" else local.parent
                key = "a-" + content_key("artifact", content_digest(shipped))
                entries[key] = (shipped, local.name if kind == "artifact" else "")
                remote_kwargs[k] = f"@CACHE@/{key}/{local.name}"
            elif kind == "input":
                inputs[f"in-{k}-{local.name}"] = local
                remote_kwargs[k] = f"@RUN@/in-{k}-{local.name}"
            elif kind in ("output", "output_dir"):
                outputs[f"out-{k}-{local.name}"] = local
                remote_kwargs[k] = f"@RUN@/out-{k}-{local.name}"
                if kind == "output_dir":
                    dirs.append(f"out-{k}-{local.name}")
            else:
                raise UsageError(f"files[{k!r}]: {kind!r} is not one of {FILE_KINDS}")
        if hkey not in self._known or not set(entries) <= self._known:
            self._prepare(hkey, list(entries))
        job = {"function": function, "kwargs": remote_kwargs, "timeout": timeout, "outputs": sorted(outputs),
               "need": sorted(entries), "keep": sorted([hkey, *entries]), "dirs": dirs,
               "cache_max_bytes": int(self.spec.cache_max_gb * 2**30)}
        ship = {k: v for k, v in entries.items() if k not in self._known}
        script = (f"cd {self._wd()} && exec env PYTHONPATH=\"$PWD/cache/{hkey}\" PYTHONDONTWRITEBYTECODE=1 "
                  f"{self._env_words()}{forwarded_env()}{shlex.quote(self.spec.python)} "
                  f"-m harness.plumbing.targets serve {run_id}")
        result = self._serve(script, run_id, job, ship, inputs, timeout, workdir, outputs)
        if result.extra.get("missing"):  # pruned there since we last looked: ship them and go again
            self._known -= set(result.extra["missing"])
            ship = {k: v for k, v in entries.items() if k not in self._known}
            result = self._serve(script, run_id, job, ship, inputs, timeout, workdir, outputs)
        self._known |= set(entries)
        result.extra.update(target=self.name, upload_bytes=result.extra.get("upload_bytes", 0),
                            transport_s=round(max(time.monotonic() - start - result.seconds, 0.0), 3))
        return result

    def _env_words(self) -> str:
        """The spec's `env:` as `K=V ` words: the target's own numerics settings, never this machine's."""
        return "".join(f"{shlex.quote(f'{k}={v}')} " for k, v in sorted(self.spec.env.items()))

    def _prepare(self, hkey: str, keys: list[str]) -> None:
        """Which cache entries the target holds (marked used); ships the harness source if missing.
        A failure here means the target cannot take jobs at all: TargetUnreachable."""
        quoted = " ".join(shlex.quote(k) for k in [hkey, *keys])
        p, out = self._ssh(f"mkdir -p {self._wd()}/cache {self._wd()}/runs && cd {self._wd()} && "
                           f"for k in {quoted}; do if [ -e cache/$k/.complete ]; then touch cache/$k/.complete; "
                           f"echo $k; fi; done", timeout=self.spec.connect_timeout_s + 60)
        if p.returncode == TRANSPORT_EXIT:
            raise TargetUnreachable(_transport_reason(p.stderr))
        if p.returncode != 0:
            raise TargetUnreachable(f"cannot use {self.spec.work_dir} there: {p.stderr.strip()[-300:]}")
        self._known = set(out.decode().split())
        if hkey in self._known:
            return
        part = f"{hkey}.part-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryFile() as buf:
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for path, name in harness_files():
                    tar.add(path, f"{part}/{name}")
            buf.seek(0)
            p, _ = self._ssh(f"cd {self._wd()}/cache && tar -x -f - && if [ -e {hkey}/.complete ]; then rm -rf {part}; "
                             f"else rm -rf {hkey} && mv {part} {hkey} && touch {hkey}/.complete; fi", stdin=buf,
                             timeout=self.spec.connect_timeout_s + 120)
        if p.returncode == TRANSPORT_EXIT:
            raise TargetUnreachable(_transport_reason(p.stderr))
        if p.returncode != 0:
            raise TargetUnreachable(f"cannot ship the harness to {self.spec.work_dir}: {p.stderr.strip()[-300:]}")
        self._known.add(hkey)

    # ~90 lines: the host half of one job's stream protocol; `serve` below is the target's half
    def _serve(self, script: str, run_id: str, job: dict, ship: dict[str, tuple], inputs: dict[str, Path],
               timeout: float, workdir: Path, outputs: dict) -> JobResult:
        """One `ssh`: a tar of the job (remote.json, inputs, missing artifacts) on its stdin, which then
        stays open (EOF there kills the job), and a tar of the job's result on its stdout. The
        target's half of the protocol is `serve`."""
        grace = 30 + self.spec.connect_timeout_s
        sent = {"bytes": 0}
        with tempfile.TemporaryFile() as err:
            proc = subprocess.Popen(self.ssh_command(script), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=err, start_new_session=True)
            expired = threading.Event()

            def expire() -> None:
                expired.set()
                proc.kill()  # the remote side reads EOF on its stdin and kills the job's process group

            timer = threading.Timer(timeout + grace, expire)
            timer.start()
            writer = threading.Thread(target=_send_job, args=(proc, job, inputs, ship, sent), daemon=True)
            upload_start = time.monotonic()
            writer.start()
            try:
                got, broken = _read_answer(proc)
            finally:
                timer.cancel()
                writer.join(timeout=5)
                with _suppress():
                    proc.stdin.close()
                proc.stdout.close()
                code = proc.wait()
            err.seek(0)
            stderr = err.read().decode(errors="replace")
        if expired.is_set():
            self._cleanup(run_id)
            return JobResult("timeout", error=f"no result after {timeout:.0f} s (+{grace:.0f} s) from target "
                                              f"{self.name!r}: killed", seconds=timeout + grace)
        result = self._result_of(got, code, stderr, broken, workdir, outputs)
        if result.ok or not result.extra.get("missing"):
            result.extra.update(upload_bytes=sent["bytes"], ssh_s=round(time.monotonic() - upload_start, 3))
        return result

    def _result_of(self, got: dict[str, bytes], code: int, stderr: str, broken: str, workdir: Path,
                   outputs: dict) -> JobResult:
        """The job's result from the answer's files (its outputs written where the job wanted them),
        or the transport's failure as an exception that says whose fault it is."""
        if code == TRANSPORT_EXIT:
            raise TransportError(_transport_reason(stderr))
        if "jobresult.json" not in got:
            if code == 127:
                raise TargetUnreachable(f"the target's Python {self.spec.python!r} was not found")
            why = stderr.strip().splitlines()[-1][:300] if stderr.strip() else broken or f"exit status {code}"
            if "No module named" in stderr:
                raise TargetUnreachable(f"the target's Python cannot run the harness: {why}")
            raise TransportError(f"no result from the target (exit status {code}): {why}")
        d = json.loads(got.pop("jobresult.json"))
        if d.get("missing"):
            return JobResult("error", error="missing cache entries", extra={"missing": d["missing"]})

        for name, data in got.items():
            top, _, rest = name.partition("/")
            if rest and top in outputs:  # a file inside an output_dir
                atomic_write_bytes(outputs[top] / rest, data)
            else:
                atomic_write_bytes(outputs.get(name) or workdir / Path(name).name, data)
        return JobResult(**d)

    def _cleanup(self, run_id: str) -> None:
        """After a host-side time limit: kill what the run left (pids it wrote) and remove its dir."""
        d = f"{self._wd()}/runs/{run_id}"
        with_pids = (f"for f in {d}/child.pid {d}/serve.pid; do [ -e $f ] && kill -KILL -- -$(cat $f) 2>/dev/null; "
                     f"[ -e $f ] && kill -KILL $(cat $f) 2>/dev/null; done; rm -rf {d}")
        try:
            self._ssh(with_pids, timeout=self.spec.connect_timeout_s + 20)
        except TransportError:
            pass


def compile_on_target(target: Target, backend, key: str, make_kwargs, timeout: float,
                      counts=None) -> tuple[Path, JobResult | None]:
    """`jobs.cached_job` for a compile that happens on `target` (a backend's compile_where =
    "target"): the program is shipped, the out dir comes back into a local cache entry keyed by the
    artifact key, the target's name and its runtime's version. Returns (entry, None) on a hit."""
    runtime = target.describe().get("runtimes", {}).get(backend.name, "")
    key = content_key("artifact-on-target", key, target.name, runtime)
    entry = cache.entry("artifacts", key)
    if cache.lookup("artifacts", key):
        if counts is not None:
            counts["artifacts_hits"] += 1
        return entry, None
    outcome: dict = {}

    class Failed(Exception):
        pass

    def build(tmp: Path) -> None:
        try:
            result = target.run_job("harness.backends:compile_job", make_kwargs(tmp), tmp, timeout,
                                    files={"program_path": "artifact", "out_dir": "output_dir"})
        except TargetUnreachable as e:
            result = JobResult("crashed", error=f"target {target.name!r} unreachable: {e}")
        outcome["result"] = result
        if not result.ok:
            raise Failed()
        atomic_write_json(tmp / "result.json", {"status": "ok", "value": result.value})

    if counts is not None:
        counts["artifacts_misses"] += 1
    try:
        entry, _ = cache.get_or_build("artifacts", key, build)
    except Failed:
        pass
    return entry, outcome.get("result")


# ---- the remote side ----------------------------------------------------------------------------------

def _prune_remote(cache: Path, keep: set[str], max_bytes: int, recent_s: float = 600) -> None:
    """Least recently used entries (by their `.complete`) go until the cache fits; the job's own and
    those used in the last `recent_s` stay. Half-written `.part-*` dirs and run dirs older than a day
    (a target rebooted mid-run) go."""
    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    now = time.time()
    entries = []
    for d in cache.iterdir():
        try:
            if ".part-" in d.name:
                if now - d.stat().st_mtime > 86400:
                    shutil.rmtree(d, ignore_errors=True)
                continue
            entries.append(((d / ".complete").stat().st_mtime if (d / ".complete").exists() else 0, d))
        except OSError:
            continue
    for d in (cache.parent / "runs").iterdir():
        with _suppress():
            if now - d.stat().st_mtime > 86400:
                shutil.rmtree(d, ignore_errors=True)
    sizes = {d: size(d) for _, d in entries}
    total = sum(sizes.values())
    for used, d in sorted(entries):
        if total <= max_bytes:
            break
        if d.name in keep or now - used < recent_s:
            continue
        shutil.rmtree(d, ignore_errors=True)
        total -= sizes[d]


def _send_job(proc, job: dict, inputs: dict[str, Path], ship: dict[str, tuple], sent: dict) -> None:
    """The job's tar onto the ssh's stdin (counting the bytes sent); a connection that went away is
    said by the answer, or its absence."""
    class Counting(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            proc.stdin.write(b)
            sent["bytes"] += len(b)
            return len(b)

    try:
        with tarfile.open(fileobj=Counting(), mode="w|") as tar:
            data = json.dumps(job).encode()
            info = tarfile.TarInfo("remote.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
            for name, local in inputs.items():
                tar.add(local, name)
            for key, (local, name) in ship.items():
                tar.add(local, f"cache/{key}/{name}".rstrip("/"))
        proc.stdin.flush()
    except (OSError, ValueError):
        pass


def _read_answer(proc) -> tuple[dict[str, bytes], str]:
    """The files of the answer's tar, and why it broke off ("" when it did not)."""
    got: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
            for m in tar:
                if m.isfile():
                    got[m.name] = tar.extractfile(m).read()
    except (tarfile.TarError, OSError, EOFError) as e:
        return got, first_error_line(e)
    return got, ""


def serve(run_id: str) -> int:
    """`python -m harness.plumbing.targets serve RUN_ID`, in the target's work dir: read the job's
    tar from stdin (remote.json, inputs, artifacts missing from the cache), run it with
    `jobs.run_job`, write a tar of its result, log and outputs to stdout, remove the run dir. EOF on
    stdin afterwards (the host went away or gave up) kills the job's process group. The host's half
    of the protocol is SshTarget._serve."""
    root = Path.cwd()
    run = root / "runs" / run_id
    run.mkdir(parents=True)
    cache = root / "cache"
    _unpack_job(run, cache, run_id)
    spec = json.loads((run / "remote.json").read_text())
    (run / "serve.pid").write_text(str(os.getpid()))
    try:
        missing = [k for k in spec["need"] if not (cache / k / ".complete").exists()]
        if missing:
            _answer(run, {"missing": missing})
            return 0
        for k in spec["keep"]:
            with _suppress():
                (cache / k / ".complete").touch()
        _record_children_and_watch_host(run)
        with _suppress():
            _prune_remote(cache, set(spec["keep"]), spec["cache_max_bytes"])
        for d in spec.get("dirs", []):
            (run / d).mkdir(parents=True, exist_ok=True)
        kwargs = {k: v.replace("@RUN@", str(run)).replace("@CACHE@", str(cache)) if isinstance(v, str) else v
                  for k, v in spec["kwargs"].items()}
        result = run_job(spec["function"], kwargs, run / "job", spec["timeout"])
        if platform.system() == "Darwin":  # ru_maxrss is in bytes there, not KiB; /proc does not exist
            result.peak_rss_mb /= 1024
        _answer(run, asdict(result), spec["outputs"])
    finally:
        shutil.rmtree(run, ignore_errors=True)
    return 0


def _unpack_job(run: Path, cache: Path, run_id: str) -> None:
    """The job's tar from stdin into the run dir; the artifacts it ships (cache/<key>/...) into
    <key>.part-<run>, renamed into the cache unless another run completed that key first."""
    part = f".part-{run_id}"
    with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
        for m in tar:
            if m.name.startswith("cache/"):
                key, _, rest = m.name[len("cache/"):].partition("/")
                m.name = f"{key}{part}/{rest}".rstrip("/")
                tar.extract(m, cache, filter="data")
            else:
                tar.extract(m, run, filter="data")
    for d in cache.glob(f"*{part}"):
        final = cache / d.name[: -len(part)]
        if (final / ".complete").exists():
            shutil.rmtree(d, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            d.rename(final)
            (final / ".complete").touch()


def _answer(run: Path, result: dict, names=()) -> None:
    """The result as a tar on stdout: the named outputs (files, or an output dir), the job's log,
    jobresult.json."""
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        for name in names:
            if (run / name).exists():
                tar.add(run / name, name)
        if (run / "job" / "log.txt").is_file():
            tar.add(run / "job" / "log.txt", "log.txt")
        data = json.dumps(result, default=str).encode()
        info = tarfile.TarInfo("jobresult.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    sys.stdout.buffer.flush()


def _record_children_and_watch_host(run: Path) -> None:
    """The job's child process records its pid (its own process group, a new session); a thread
    reads stdin to its end (the host went away or gave up) and then kills that group."""
    class Recorded(subprocess.Popen):
        last = None

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            (run / "child.pid").write_text(str(self.pid))
            Recorded.last = self

    jobs.subprocess = types.SimpleNamespace(PIPE=subprocess.PIPE, STDOUT=subprocess.STDOUT, Popen=Recorded)

    def watch_stdin() -> None:
        while sys.stdin.buffer.read(65536):
            pass
        child = Recorded.last
        if child is not None and child.poll() is None:
            with _suppress():
                os.killpg(child.pid, signal.SIGKILL)
        shutil.rmtree(run, ignore_errors=True)
        os._exit(3)

    threading.Thread(target=watch_stdin, daemon=True).start()


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], OSError)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        code = serve(sys.argv[2])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # not sys.exit: the stdin watcher thread blocks in read() at interpreter shutdown
    print("usage: python -m harness.plumbing.targets serve RUN_DIR", file=sys.stderr)
    sys.exit(2)
