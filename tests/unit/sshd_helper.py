"""A throwaway OpenSSH server on 127.0.0.1 and a separate virtualenv as a target's Python, for the
remote-target tests (test_targets.py) and benchmarks/target_overhead.py. Nothing reaches beyond
this machine.

The target's virtualenv is a real venv (its own sys.prefix, no system site-packages) whose
site-packages holds symlinks to exactly the distributions asked for and their requirements, taken
from this venv: torch and numpy, plus a backend's package or not. kokoro-parity is NOT installed
there (a target receives the harness source from the host), so nothing leaks from the host's
environment: a module the target lacks fails there as it would on another machine.
"""
from __future__ import annotations

import getpass
import importlib.metadata as md
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CPU_PINS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")  # conftest.py's

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


def have_openssh() -> tuple[bool, str]:
    if not Path(SSHD).exists():
        return False, "sshd not installed (Debian: apt-get install openssh-server; .ci/run installs it)"
    if not shutil.which("ssh") or not shutil.which("ssh-keygen"):
        return False, "ssh / ssh-keygen not installed (Debian: openssh-client)"
    return True, ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kokoro-parity-test", "-f", str(path)],
                   check=True)
    return path


@dataclass
class Sshd:
    root: Path
    port: int
    user: str
    client_key: Path
    known_hosts: Path
    proc: subprocess.Popen | None = None

    def start(self) -> "Sshd":
        cfg = self.root / "sshd_config"
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # its privilege separation directory
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(cfg), "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=open(self.root / "sshd.log", "ab"),
                                     start_new_session=True)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()[-500:]}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise RuntimeError("sshd did not listen within 10 s")

    def stop(self) -> None:
        """The listener and the sshd processes of its connections (as when a machine goes away: the
        users' processes there are left to notice on their own)."""
        if self.proc is not None and self.proc.poll() is None:
            for pid in [*_sshd_descendants(self.proc.pid), self.proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        self.proc = None

    def target(self, python: Path, work_dir: Path, key: Path | None = None, known_hosts: Path | None = None,
               **extra) -> dict:
        """A targets.yaml entry for this server. Its jobs get this process's CPU kernel and thread pins
        (conftest.py): sshd gives them a clean environment, and on an AVX-512 CPU the unpinned kernels,
        or two threads instead of one, differ in the last bits, so a loopback run would no longer
        equal the local one."""
        env = {k: os.environ[k] for k in CPU_PINS if k in os.environ}
        return {"kind": "ssh", "host": "127.0.0.1", "port": self.port, "user": self.user,
                "identity_file": str(key or self.client_key), "known_hosts": str(known_hosts or self.known_hosts),
                "ssh_config": "none", "python": str(python), "work_dir": str(work_dir),
                **({"env": env} if env else {}), **extra}


def _sshd_descendants(root: int) -> list[int]:
    """sshd processes descending from the listener `root` (its per-connection processes call
    setsid, so they are not in its process group)."""
    parent, comm = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                fields = stat[stat.rindex(")") + 2:].split()
                parent[int(d.name)], comm[int(d.name)] = int(fields[1]), stat[stat.index("(") + 1:stat.rindex(")")]
            except (OSError, ValueError):
                pass
    found, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        found += [c for c in kids if comm.get(c, "").startswith("sshd")]
        todo += kids
    return found


def start_sshd(root: Path) -> Sshd:
    """sshd on 127.0.0.1:<free port>, a fresh host key, one authorized client key, this user."""
    root.mkdir(parents=True, exist_ok=True)
    host_key = keygen(root / "host_ed25519")
    client_key = keygen(root / "client_ed25519")
    (root / "authorized_keys").write_text((root / "client_ed25519.pub").read_text())
    port = free_port()
    (root / "known_hosts").write_text(f"[127.0.0.1]:{port} {(root / 'host_ed25519.pub').read_text()}")
    (root / "sshd_config").write_text(f"""ListenAddress 127.0.0.1
HostKey {host_key}
AuthorizedKeysFile {root / 'authorized_keys'}
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PidFile none
LogLevel ERROR
MaxStartups 50
MaxSessions 50
""")
    return Sshd(root, port, getpass.getuser(), client_key, root / "known_hosts").start()


def _closure(names: list[str]) -> dict[str, md.Distribution]:
    from packaging.requirements import Requirement

    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        dist = md.distribution(name)
        seen[key] = dist
        for r in dist.requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def target_venv(path: Path, packages: list[str]) -> Path:
    """A venv at `path` that sees `packages` (and their requirements) and nothing else; its python."""
    if (path / "bin" / "python").exists():
        return path / "bin" / "python"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next((path / "lib").glob("python3*/site-packages"))
    host_site = {Path(p).resolve() for p in sys.path if p.endswith("site-packages")}
    for dist in _closure(packages).values():
        root = Path(dist.locate_file("")).resolve()
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            src = root / top
            if root in host_site and src.exists() and not (site / top).exists():
                (site / top).symlink_to(src)
    return path / "bin" / "python"
