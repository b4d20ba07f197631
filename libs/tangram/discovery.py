"""Finding the running mesh without a URL, and owning a state dir while a mesh runs there.

A client looks, in order, at: the URL it was given, ``TANGRAM_NATS_URL``, the ``mesh.json``
that ``tangram up`` writes in the state dir (``TANGRAM_STATE_DIR``, default ``.state``) if
the process that wrote it is still alive, and last the conventional NATS port on this machine.
Besides the NATS URL, ``mesh.json`` names the Postgres DSN and each service's metrics endpoint
(``metrics_urls``: service key -> URL, added as services start: :func:`update_mesh`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from tangram.errors import TangramError

DEFAULT_PORT = 4222
DEFAULT_URL = f"nats://127.0.0.1:{DEFAULT_PORT}"
URL_VAR = "TANGRAM_NATS_URL"
STATE_VAR = "TANGRAM_STATE_DIR"
MESH_FILE = "mesh.json"
LOCK_FILE = "mesh.lock"


def default_state_dir() -> Path:
    return Path(os.environ.get(STATE_VAR, ".state"))


@dataclass(frozen=True)
class Found:
    """A NATS URL and where it came from (said in connection errors)."""

    url: str
    source: str


def find(url: str | None = None, state_dir: Path | None = None) -> Found:
    """Where the mesh's NATS is, by the rule in this module's docstring."""
    if url:
        return Found(url, "given")
    if os.environ.get(URL_VAR):
        return Found(os.environ[URL_VAR], f"${URL_VAR}")
    path = (state_dir or default_state_dir()) / MESH_FILE
    info = read_mesh(path)
    if info is not None:
        return Found(str(info["nats_url"]), str(path))
    return Found(DEFAULT_URL, "the default port")


def read_mesh(path: Path) -> dict[str, object] | None:
    """A ``mesh.json`` whose writer is still alive (None: missing, unreadable or stale)."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or "nats_url" not in info:
        return None
    pid = info.get("pid")
    return info if isinstance(pid, int) and pid_alive(pid) else None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True


def write_mesh(state_dir: Path, nats_url: str, postgres_dsn: str, **extra: object) -> Path:
    """Write ``mesh.json`` as this process's (``extra``: more fields, JSON values)."""
    path = state_dir / MESH_FILE
    info = {"nats_url": nats_url, "postgres_dsn": postgres_dsn, "pid": os.getpid(), **extra}
    _replace(path, info)
    return path


def update_mesh(state_dir: Path, **fields: object) -> bool:
    """Set fields of the ``mesh.json`` this process wrote (a dict field is merged into the
    one there, so ``metrics_urls={key: url}`` adds one service's URL); False, and nothing
    written, when there is none (missing, unreadable, or another process's)."""
    path = state_dir / MESH_FILE
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("pid") != os.getpid():
        return False
    for name, value in fields.items():
        old = info.get(name)
        info[name] = (
            {**old, **value} if isinstance(old, dict) and isinstance(value, dict) else value
        )
    _replace(path, info)
    return True


def metrics_url(base: str) -> str:
    """The metrics endpoint of an ops server at ``base`` (see ``tangram.ops_http``)."""
    return f"{base.rstrip('/')}/metrics"


# Below the kernel's ephemeral range (Linux's default 32768-60999): a port picked for a server
# started next must not be handed meanwhile to some connection's local end, as a port the kernel
# picked from that range can be (seen in CI: a gateway's ops endpoint found its port taken).
LISTEN_PORTS = range(20_000, 32_768)
PORT_TRIES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for a server started next: one below the ephemeral range
    when such a port binds (see ``LISTEN_PORTS``), else the kernel's pick."""
    below = min(_ephemeral_low(), LISTEN_PORTS.stop) - LISTEN_PORTS.start
    for _ in range(PORT_TRIES if below > 0 else 0):  # none below a range set that low
        port = secrets.randbelow(below) + LISTEN_PORTS.start
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, contextlib.suppress(OSError):
            s.bind((host, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _replace(path: Path, info: dict[str, object]) -> None:
    """Write atomically: a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(info, indent=2))
    tmp.replace(path)


def remove_mesh(state_dir: Path) -> None:
    """Remove ``mesh.json`` if this process wrote it."""
    path = state_dir / MESH_FILE
    with contextlib.suppress(OSError, ValueError):
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()


class StateLock:
    """An exclusive hold on a state dir while a mesh runs there (released by the kernel if
    the holder dies); a second holder is told who holds it."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the hold (idempotent); a TangramError names the pid holding it."""
        if self._file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # held open for the mesh's lifetime
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise TangramError(
                f"state dir {self.path.parent} is in use by pid {holder} (another tangram up?);"
                " stop it or give another --state-dir"
            ) from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
