"""A private Docker engine for tests and benchmarks: dockerd on a socket in a temp dir.

``dockerd --iptables=false --bridge=none --storage-driver=vfs`` with its data root, exec root,
pidfile and socket all under one temporary directory, so it clashes with nothing. The test
image is made with ``docker import`` of an empty rootfs that only has mount points: the
host's /usr, /lib, /lib64, /bin, /sbin and /etc are bind-mounted read-only at run time, which
is enough for ``sh`` and ``python3``. No registry is needed. Install the engine first with
``scripts/docker-engine.sh``.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import docker

from services.cpu_manager.docker.engine import HOST_SYSTEM_DIRS, probe
from services.cpu_manager.docker.sandbox_image import rootfs_tar

IMAGE = "tangram-test:latest"


class EngineUnavailable(RuntimeError):
    """dockerd cannot run here; the message says why."""


@dataclass(frozen=True)
class Engine:
    """A running private engine: where it listens, the test image, the binds that image needs."""

    host: str
    socket: Path
    image: str
    mounts: tuple[str, ...]
    pid: int


def test_mounts() -> tuple[str, ...]:
    """Read-only binds of the host's system dirs that make the empty test image runnable."""
    return tuple(f"{d}:{d}:ro" for d in HOST_SYSTEM_DIRS if os.path.exists(d))


def _import(host: str, data: bytes, tag: str) -> str:
    repo, _, version = tag.partition(":")
    api = docker.APIClient(base_url=host, version="1.41")
    try:
        api.import_image_from_data(data, repository=repo, tag=version or "latest")
    finally:
        api.close()
    return tag


def build_test_image(host: str, tag: str = IMAGE) -> str:
    """``docker import`` an empty rootfs (mount points only) as ``tag``; no label, so its
    containers get exactly the binds the test config names (``test_mounts``)."""
    return _import(host, rootfs_tar(), tag)


SHELL_ONLY = ("/bin/sh", "/bin/sleep", "/bin/cat")
SANDBOX_DIRS = ("/tmp", "/work", "/proc", "/sys", "/dev", "/opt/tangram", "/run/tangram")


def build_shell_only_image(host: str, tag: str) -> str:
    """An image with ``sh``, ``sleep`` and ``cat`` (and their libraries) but no python3."""
    libraries = sorted({lib for binary in SHELL_ONLY for lib in _libraries(binary)})
    files = {p: p for p in [*libraries, *SHELL_ONLY]} | {f"/usr{p}": p for p in SHELL_ONLY}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", dereference=True) as tar:
        dirs = {str(Path(f).parent) for f in files} | set(SANDBOX_DIRS)
        with tarfile.open(fileobj=io.BytesIO(rootfs_tar(tuple(dirs)))) as skeleton:
            for member in skeleton.getmembers():  # every directory, world-readable
                tar.addfile(member)
        for inside, host_path in sorted(files.items()):
            tar.add(host_path, arcname=inside.lstrip("/"))
    return _import(host, buf.getvalue(), tag)


def _libraries(binary: str) -> set[str]:
    """The shared libraries (as the loader names them) that ``binary`` needs."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    words = (w for line in out.splitlines() for w in line.split())
    return {w for w in words if w.startswith("/")}


def _answers(host: str) -> bool:
    return probe(host, timeout_s=2.0) is not None


class LocalDockerd:
    """Start and stop one private dockerd (by its own pid)."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="tgd-"))  # short: unix socket paths are capped
        self.socket = self.base / "docker.sock"
        self.host = f"unix://{self.socket}"
        self.proc: subprocess.Popen[bytes] | None = None

    def _argv(self, dockerd: str) -> list[str]:
        return [
            dockerd,
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            "--storage-driver=vfs",
            "--data-root",
            str(self.base / "data"),
            "--exec-root",
            str(self.base / "exec"),
            "--pidfile",
            str(self.base / "dockerd.pid"),
            "--host",
            self.host,
            "--log-level=warn",
        ]

    def start(self, timeout_s: float = 60.0) -> Engine:
        """Start dockerd, wait until it answers, build the test image."""
        dockerd = shutil.which("dockerd")
        if dockerd is None:
            raise EngineUnavailable("dockerd is not installed (run scripts/docker-engine.sh)")
        if os.geteuid() != 0:
            raise EngineUnavailable("dockerd needs root here (rootless engine not set up)")
        log = (self.base / "dockerd.log").open("wb")
        self.proc = subprocess.Popen(
            self._argv(dockerd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while not _answers(self.host):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_tail()
                self.stop()
                raise EngineUnavailable(f"dockerd did not come up: {tail}")
            time.sleep(0.1)  # polling a starting daemon, bounded by the deadline
        image = build_test_image(self.host)
        return Engine(self.host, self.socket, image, test_mounts(), self.proc.pid)

    def log_tail(self, lines: int = 15) -> str:
        """The end of dockerd's log."""
        try:
            text = (self.base / "dockerd.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM our dockerd, SIGKILL it if it lingers, then delete its directory."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for mount in _mounts_under(self.base):  # dockerd leaves exec/netns/default mounted
            subprocess.run(["umount", "-l", mount], capture_output=True, check=False)
        shutil.rmtree(self.base, ignore_errors=True)


def _mounts_under(base: Path) -> list[str]:
    """Mount points below ``base``, deepest first."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    prefix = f"{base}/"
    points = [line.split()[4] for line in lines]
    return sorted((p for p in points if p.startswith(prefix)), key=len, reverse=True)
