"""Every Docker SDK call of the Docker backend, synchronous, for its thread pool.

Nothing here runs on the event loop. Third-party errors are translated at this boundary into
``DockerFailure`` carrying the ``ErrorKind`` the client will see.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import psutil
import requests.exceptions
from docker.constants import DEFAULT_DOCKER_API_VERSION, MINIMUM_DOCKER_API_VERSION
from docker.utils.socket import STDERR, frames_iter

from services.cpu_manager.cpulist import format_cpulist
from services.cpu_manager.docker.cgroup import CFS_PERIOD_US, PARK_QUOTA_US, quota_us
from services.cpu_manager.docker.config import DockerConfig
from tangram.contract import ErrorKind

log = logging.getLogger(__name__)

EXECUTOR_SOURCE = Path(__file__).with_name("executor.py")
EXECUTOR_PATH = "/opt/tangram/executor.py"
CTL_DIR = "/run/tangram"
SOCKET_NAME = "exec.sock"
LABEL_NODE = "tangram.node"
LABEL_INCARNATION = "tangram.incarnation"
DEFAULT_UNIX_SOCKET = "unix:///var/run/docker.sock"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# An image labelled LABEL_ROOTFS=HOST_ROOTFS (the offline sandbox image, sandbox_image.py) is an
# empty rootfs: its containers get these host dirs bound read-only. A fixed list, never paths
# read from the label: an image chosen by a client cannot ask for more of the host.
LABEL_ROOTFS = "tangram.rootfs"
HOST_ROOTFS = "host-ro"
HOST_SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc")
# runc's words when the entrypoint is missing (no python3 in the image); not its generic
# "unable to start container process", which mount and cgroup errors begin with too
ENTRYPOINT_MISSING = "executable file not found"


class DockerFailure(Exception):
    """A Docker operation failed for a reason the client can tell apart."""

    def __init__(self, failure: ErrorKind, detail: str) -> None:
        super().__init__(detail)
        self.failure = failure
        self.detail = detail


class ExecutorUnavailable(DockerFailure):
    """The in-container executor cannot run in this image (no usable interpreter)."""

    def __init__(self, detail: str) -> None:
        super().__init__(ErrorKind.INTERNAL, detail)


def translate(exc: Exception, what: str) -> DockerFailure:
    """Map an SDK/transport error to the typed failure it means."""
    if isinstance(exc, DockerFailure):
        return exc
    if isinstance(exc, docker.errors.ImageNotFound):
        return DockerFailure(ErrorKind.IMAGE_MISSING, f"{what}: image missing: {exc.explanation}")
    if isinstance(exc, docker.errors.NotFound):
        return DockerFailure(ErrorKind.ENVIRONMENT_LOST, f"{what}: container gone")
    if isinstance(exc, docker.errors.APIError) and exc.status_code == 409:
        return DockerFailure(ErrorKind.ENVIRONMENT_LOST, f"{what}: {exc.explanation}")
    if isinstance(exc, requests.exceptions.ConnectionError | requests.exceptions.Timeout):
        return DockerFailure(
            ErrorKind.BACKEND_UNAVAILABLE, f"{what}: docker daemon unreachable: {exc}"
        )
    if isinstance(exc, docker.errors.DockerException) and "Error while fetching" in str(exc):
        return DockerFailure(
            ErrorKind.BACKEND_UNAVAILABLE, f"{what}: docker daemon unreachable: {exc}"
        )
    return DockerFailure(ErrorKind.INTERNAL, f"{what}: {type(exc).__name__}: {exc}")


def server_version(docker_host: str = "", timeout_s: float = 2.0) -> dict[str, Any]:
    """The engine's ``/version`` answer (blocking); raises ``DockerFailure`` if none answers."""
    host = docker_host or os.environ.get("DOCKER_HOST", "") or DEFAULT_UNIX_SOCKET
    if host.startswith(("unix://", "http+unix://")):
        return _unix_version(host.split("://", 1)[1], timeout_s)
    api = docker.APIClient(base_url=host, version=MINIMUM_DOCKER_API_VERSION, timeout=timeout_s)
    try:
        return dict(api.version(api_version=False))
    except Exception as exc:
        raise translate(exc, "version") from exc
    finally:
        api.close()


def _unix_version(path: str, timeout_s: float) -> dict[str, Any]:
    # A raw request: the SDK leaks its socket when connecting fails (daemon down).
    request = b"GET /version HTTP/1.0\r\nHost: docker\r\n\r\n"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            sock.sendall(request)
            reply = b"".join(iter(lambda: sock.recv(65536), b""))
        head, _, body = reply.partition(b"\r\n\r\n")
        status = head.split(b"\r\n", 1)[0].split()
        if len(status) < 2 or status[1] != b"200":
            raise OSError(f"unexpected answer {head[:80]!r}")
        return dict(json.loads(body))
    except (OSError, ValueError) as exc:
        raise DockerFailure(
            ErrorKind.BACKEND_UNAVAILABLE, f"docker daemon unreachable at unix://{path}: {exc}"
        ) from exc


def probe(docker_host: str = "", timeout_s: float = 2.0) -> str | None:
    """The engine's version if a Docker engine answers at ``docker_host``, else None (blocking)."""
    try:
        return str(server_version(docker_host, timeout_s).get("Version", "unknown"))
    except DockerFailure:
        return None


@dataclass(frozen=True, slots=True)
class ContainerSpec:
    """One container to make: its image, memory, network and host directory."""

    name: str
    image: str
    memory_mb: int
    network: bool
    host_dir: Path
    labels: dict[str, str] = field(default_factory=dict)
    exec_mode: str = "executor"  # "executor": the executor is the entrypoint; "docker_exec"

    @property
    def socket_path(self) -> Path:
        """Where the executor's socket appears on this host."""
        return self.host_dir / "ctl" / SOCKET_NAME


@dataclass(frozen=True, slots=True)
class Started:
    """A running container: its id and the host pid of its init (for its cgroup)."""

    container_id: str
    pid: int


class Engine:
    """The blocking Docker layer. Thread-safe (one HTTP session with a connection pool)."""

    def __init__(self, cfg: DockerConfig) -> None:
        self.cfg = cfg
        self._api: docker.APIClient | None = None
        self.executor_file = EXECUTOR_SOURCE
        self._host_rootfs: dict[str, bool] = {}  # image -> built to borrow the host's dirs

    def install_executor(self, root: Path) -> None:
        """Copy the executor under ``root``: the one host path dockerd must see anyway."""
        root.mkdir(parents=True, exist_ok=True)
        target = root / "executor.py"
        shutil.copyfile(EXECUTOR_SOURCE, target)
        target.chmod(0o644)
        self.executor_file = target

    @property
    def api(self) -> docker.APIClient:
        if self._api is None:
            raise DockerFailure(ErrorKind.BACKEND_UNAVAILABLE, "docker backend not started")
        return self._api

    def connect(self) -> str:
        """Open the client and return the engine version."""
        info = server_version(self.cfg.docker_host, self.cfg.api_timeout_s)
        api_version = min(
            str(info.get("ApiVersion", DEFAULT_DOCKER_API_VERSION)),
            DEFAULT_DOCKER_API_VERSION,
            key=lambda v: tuple(int(p) for p in v.split(".")),
        )
        self._api = docker.APIClient(
            base_url=self.cfg.docker_host or None,
            version=api_version,
            timeout=self.cfg.api_timeout_s,
            max_pool_size=self.cfg.threads + 1,  # the pool's threads and the canary's
        )
        return str(info.get("Version", "unknown"))

    def close(self) -> None:
        """Close the HTTP session."""
        if self._api is not None:
            self._api.close()

    def create(self, spec: ContainerSpec) -> Started:
        """Create and start a locked-down container for ``spec``."""
        _prepare_dirs(spec.host_dir, self.cfg.user)
        try:
            created = self.api.create_container(
                image=spec.image,
                name=spec.name,
                entrypoint=self._entrypoint(spec),
                user=self.cfg.user or None,
                working_dir=self.cfg.workdir,
                environment={"HOME": self.cfg.workdir, "PATH": PATH, "LANG": "C.UTF-8"},
                labels=spec.labels,
                network_disabled=not spec.network,
                host_config=self.api.create_host_config(**self._host_config(spec)),
            )
            cid = created["Id"]
            self._start(cid, spec)
            pid = int(self.api.inspect_container(cid)["State"]["Pid"])
        except Exception as exc:
            raise translate(exc, f"create {spec.name}") from exc
        return Started(cid, pid)

    def _start(self, container_id: str, spec: ContainerSpec) -> None:
        try:
            self.api.start(container_id)
        except docker.errors.APIError as exc:
            text = str(exc.explanation or exc)
            missing = ENTRYPOINT_MISSING in text or (
                f"{self.cfg.python}: no such file or directory" in text.lower()
            )
            if spec.exec_mode == "executor" and missing:
                raise ExecutorUnavailable(
                    f"the executor cannot start in {spec.image} ({self.cfg.python}): {text}"
                ) from exc
            raise

    def _entrypoint(self, spec: ContainerSpec) -> list[str]:
        if spec.exec_mode == "executor":
            return [self.cfg.python, "-I", EXECUTOR_PATH, f"{CTL_DIR}/{SOCKET_NAME}"]
        return ["sleep", "infinity"]

    def _host_config(self, spec: ContainerSpec) -> dict[str, Any]:
        binds = [
            f"{spec.host_dir / 'work'}:{self.cfg.workdir}:rw",
            f"{spec.host_dir / 'ctl'}:{CTL_DIR}:rw",
            f"{self.executor_file}:{EXECUTOR_PATH}:ro",
            *(m if m.count(":") >= 2 else f"{m}:ro" for m in self.cfg.mounts),
            *self._rootfs_binds(spec.image),
        ]
        return {
            "binds": binds,
            "network_mode": self.cfg.network_mode if spec.network else "none",
            "cap_drop": ["ALL"],
            "security_opt": ["no-new-privileges"],
            "read_only": True,
            "pids_limit": self.cfg.pids_limit,
            "mem_limit": f"{spec.memory_mb}m",
            "memswap_limit": f"{spec.memory_mb}m",  # no swap: the limit is the limit
            "tmpfs": {"/tmp": f"rw,nosuid,nodev,size={self.cfg.tmpfs_mb}m"},
            "ipc_mode": "private",
            "cpu_period": CFS_PERIOD_US,
            "cpu_quota": quota_us(1),
        }

    def _rootfs_binds(self, image: str) -> list[str]:
        """The host's system dirs, read-only, for an image labelled as an empty host-ro rootfs
        (minus container paths the configured mounts already cover)."""
        if image not in self._host_rootfs:
            labels = self.api.inspect_image(image).get("Config", {}).get("Labels") or {}
            self._host_rootfs[image] = labels.get(LABEL_ROOTFS) == HOST_ROOTFS
        if not self._host_rootfs[image]:
            return []
        taken = {m.split(":")[1] for m in self.cfg.mounts if ":" in m}
        return [f"{d}:{d}:ro" for d in HOST_SYSTEM_DIRS if d not in taken and os.path.exists(d)]

    def import_image(self, rootfs_tar: bytes, tag: str, changes: list[str]) -> None:
        """``docker import`` a rootfs tarball as ``tag`` (no registry involved)."""
        repo, _, version = tag.partition(":")
        try:
            self.api.import_image_from_data(
                rootfs_tar, repository=repo, tag=version or "latest", changes=changes
            )
        except Exception as exc:
            raise translate(exc, f"import {tag}") from exc
        self._host_rootfs.pop(tag, None)

    def has_image(self, image: str) -> bool:
        """True when the engine has ``image``."""
        try:
            self.api.inspect_image(image)
        except docker.errors.ImageNotFound:
            return False
        except Exception as exc:
            raise translate(exc, f"inspect image {image}") from exc
        return True

    def remove(self, container_id: str) -> None:
        """Kill and remove a container (gone already is fine)."""
        try:
            self.api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:
            raise translate(exc, f"remove {container_id[:12]}") from exc

    def state(self, container_id: str) -> dict[str, Any] | None:
        """The container's ``State``; None if it no longer exists."""
        try:
            return dict(self.api.inspect_container(container_id)["State"])
        except docker.errors.NotFound:
            return None
        except Exception as exc:
            raise translate(exc, f"inspect {container_id[:12]}") from exc

    def state_after_exit(self, container_id: str, timeout_s: float) -> dict[str, Any] | None:
        """The container's ``State`` once the engine has seen its init exit (within
        ``timeout_s``; else as it is then): a process seen gone from here may still be
        ``Running`` to a busy engine for a moment."""
        try:
            self.api.wait(container_id, timeout=timeout_s)
        except docker.errors.NotFound:
            return None
        except Exception:  # a read timeout (requests'): say what the state is now
            log.debug("no exit of %s seen within %ss", container_id[:12], timeout_s)
        return self.state(container_id)

    def update_cpus(self, container_id: str, cores: tuple[int, ...]) -> None:
        """``docker update --cpuset-cpus --cpu-quota`` to exactly ``cores``."""
        try:
            self.api.update_container(
                container_id, cpuset_cpus=format_cpulist(cores), cpu_quota=quota_us(len(cores))
            )
        except Exception as exc:
            raise translate(exc, f"update {container_id[:12]}") from exc

    def park(self, container_id: str) -> None:
        """Between actions: throttle whatever is left (1% of a core) so it cannot use cores
        granted to other actions; the next action's ``update_cpus`` lifts it."""
        try:
            self.api.update_container(container_id, cpu_quota=PARK_QUOTA_US)
        except Exception as exc:
            raise translate(exc, f"park {container_id[:12]}") from exc

    def oom_killed_since(self, container_id: str, since: float) -> bool:
        """Did the kernel OOM-kill a process of the container since ``since`` (epoch seconds)?

        The engine's ``oom`` events cover any process; ``State.OOMKilled`` only the init (on
        this engine it stays false when an exec'd process is the victim).
        """
        try:
            stream = self.api.events(
                since=f"{since:.9f}",
                until=f"{time.time():.9f}",
                decode=True,
                filters={"container": container_id, "event": "oom"},
            )
            try:
                if any(True for _ in stream):
                    return True
            finally:
                stream.close()
            return bool(self.api.inspect_container(container_id)["State"].get("OOMKilled"))
        except docker.errors.NotFound:
            return False
        except Exception as exc:
            raise translate(exc, f"oom check {container_id[:12]}") from exc

    def pause(self, container_id: str) -> None:
        """``docker pause``: freeze every process of the container (its memory stays)."""
        try:
            self.api.pause(container_id)
        except Exception as exc:
            raise translate(exc, f"pause {container_id[:12]}") from exc

    def unpause(self, container_id: str) -> None:
        """``docker unpause``: thaw a paused container."""
        try:
            self.api.unpause(container_id)
        except Exception as exc:
            raise translate(exc, f"unpause {container_id[:12]}") from exc

    def update_memory(self, container_id: str, memory_mb: int) -> None:
        """Change a container's memory limit (a pool container taken by a trajectory)."""
        try:
            self.api.update_container(
                container_id, mem_limit=f"{memory_mb}m", memswap_limit=f"{memory_mb}m"
            )
        except Exception as exc:
            raise translate(exc, f"update memory {container_id[:12]}") from exc

    def exec_create(self, container_id: str, argv: tuple[str, ...], env: dict[str, str]) -> str:
        """Create a ``docker exec`` of ``argv``; returns its id."""
        try:
            return str(
                self.api.exec_create(
                    container_id,
                    list(argv),
                    environment=env,
                    workdir=self.cfg.workdir,
                    user=self.cfg.user,
                )["Id"]
            )
        except Exception as exc:
            raise translate(exc, f"exec {container_id[:12]}") from exc

    def exec_collect(self, exec_id: str, cap: int) -> tuple[bytes, bytes, bool, bool]:
        """Start an exec and read its output, keeping at most ``cap`` bytes per stream."""
        out, err = bytearray(), bytearray()
        trunc = [False, False]
        try:
            sock = self.api.exec_start(exec_id, socket=True)
            try:
                for stream_id, chunk in frames_iter(sock, tty=False):
                    i = 1 if stream_id == STDERR else 0
                    buf = (out, err)[i]
                    room = max(cap - len(buf), 0)
                    trunc[i] = trunc[i] or len(chunk) > room
                    buf += chunk[:room]
            finally:
                _close_hijacked(sock)  # the SDK never closes the hijacked connection itself
        except Exception as exc:
            raise translate(exc, f"exec {exec_id[:12]}") from exc
        return bytes(out), bytes(err), trunc[0], trunc[1]

    def exec_status(self, exec_id: str) -> tuple[int | None, int]:
        """An exec's exit code (None while running) and its host pid."""
        try:
            info = self.api.exec_inspect(exec_id)
        except Exception as exc:
            raise translate(exc, f"exec inspect {exec_id[:12]}") from exc
        return info.get("ExitCode"), int(info.get("Pid") or 0)

    def kill_exec(self, exec_id: str, wait_s: float = 2.0) -> None:
        """SIGKILL an exec's process and everything it started (seen from the host)."""
        deadline = time.monotonic() + wait_s
        code, pid = self.exec_status(exec_id)
        while pid <= 0 and code is None and time.monotonic() < deadline:
            time.sleep(0.005)  # a worker thread: the exec is being started right now
            code, pid = self.exec_status(exec_id)
        if pid <= 0 or code is not None:
            return
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for proc in [*root.children(recursive=True), root]:
                with contextlib.suppress(psutil.Error):
                    proc.kill()

    def containers(self, mine: bool) -> list[tuple[str, str]]:
        """(id, name) of this node's containers made by this incarnation, or by any other."""
        try:
            found = self.api.containers(
                all=True, filters={"label": f"{LABEL_NODE}={self.cfg.node_id}"}
            )
        except Exception as exc:
            raise translate(exc, "list containers") from exc
        return [
            (c["Id"], c["Names"][0].lstrip("/") if c.get("Names") else "")
            for c in found
            if (c.get("Labels", {}).get(LABEL_INCARNATION) == self.cfg.incarnation) == mine
        ]

    def logs_tail(self, container_id: str, lines: int = 20) -> str:
        """The last lines of a container's output (for error details)."""
        try:
            return str(self.api.logs(container_id, tail=lines).decode("utf-8", "replace")).strip()
        except Exception:
            return ""


def _close_hijacked(sock: Any) -> None:
    raw = getattr(sock, "_sock", None)
    sock.close()
    if raw is not None:
        raw.close()


def _prepare_dirs(host_dir: Path, user: str) -> None:
    """work/ and ctl/ writable by the container's user, private to it on the host."""
    uid, gid = _numeric_user(user)
    for sub in ("work", "ctl"):
        path = host_dir / sub
        path.mkdir(parents=True, exist_ok=True)
        if uid is not None and os.geteuid() == 0:
            os.chown(path, uid, gid if gid is not None else uid)
        else:
            path.chmod(0o777)


def _numeric_user(user: str) -> tuple[int | None, int | None]:
    name, _, group = user.partition(":")
    if not name.isdigit():
        return None, None
    return int(name), int(group) if group.isdigit() else None


def remove_dir(path: Path) -> None:
    """Delete an environment's host directory."""
    shutil.rmtree(path, ignore_errors=True)
