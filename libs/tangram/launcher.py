"""Part of the CLI's composition root: a whole mesh on one machine.

Starts embedded nats-server and PostgreSQL (unless URLs are given), then each service as its
own process (``python -m services.NAME``), waits until the mesh answers, and stops it in drain
order: intake first, then the node agents (they finish and report in-flight work), then the
schedulers, then the servers. Tests use the same class to kill -9 and restart single services.

With ``supervise`` (``tangram up`` turns it on) a service or embedded server that dies
unexpectedly is started again with backoff (:mod:`tangram.supervisor`); a deliberate stop or
:meth:`Mesh.kill` cancels its supervisor first, so tests that kill on purpose are not fought.
With ``schedulers`` > 1 the first scheduler leads and the others stand by, each waiting for the
lead lock (``services/scheduler/leadership.py``) to take over when the leader dies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from tangram import auth, config, pg_roles, subjects
from tangram.bus import Bus
from tangram.config import MeshConfig
from tangram.contract import SchedulerStatus, StatusQuery
from tangram.discovery import (
    StateLock,
    free_port,
    metrics_url,
    remove_mesh,
    update_mesh,
    write_mesh,
)
from tangram.embedded import EmbeddedNats, EmbeddedPostgres, die_with_parent
from tangram.errors import TangramError, Unavailable
from tangram.supervisor import RestartPolicy, exited, supervise

log = logging.getLogger(__name__)

SERVICES = (
    *("gateway", "scheduler", "cpu_manager", "quota_manager", "gpu_manager", "dashboard"),
    "reward_front",  # HTTP reward endpoints (slime, OpenRLHF): an intake, so it stops first
)
STOP_ORDER = (
    "reward_front",
    *("gateway", "cpu_manager", "quota_manager", "gpu_manager", "scheduler", "dashboard"),
)

# A service stopping on SIGTERM may take up to twice its drain bound (the scheduler drains its
# handlers, then its durable writers) plus fixed waits, each bounded in its own ``on_stop``. The
# largest are the cpu_manager's, when the scheduler does not answer: draining notice 2 s,
# post-kill wait 2 s, outbox flush 2 s, gone notice 2 s, NATS drain 5 s (13 s in all).
STOP_FIXED_S = 15.0


@dataclass
class MeshOptions:
    state_dir: Path
    nats_url: str | None = None
    postgres_dsn: str | None = None
    nodes: int = 1
    backend: str = "auto"
    policy: str = "elastic"
    fsync: bool = True
    env: dict[str, str] = field(default_factory=dict)  # extra TANGRAM_* settings
    quiet: bool = False
    nats_port: int | None = None  # the embedded NATS's port, if free (None: any free port)
    quota_manager: bool = True  # run the quota node agent (HTTP calls under quotas)
    gpu_manager: bool = True  # run one GPU node agent (CPU stand-ins where no GPU answers)
    dashboard: bool = True  # run the dashboard (its URL in mesh.json as dashboard_url)
    dashboard_port: int | None = None  # its port, if free (None: any free port)
    reward_front: bool = True  # run services/reward_front (its URL: reward_front_url)
    reward_front_port: int | None = None  # its port, if free (None: any free port)
    # Locked down (`tangram up`): credentials per role and subject permissions on the embedded
    # NATS, and the process backend's actions as per-trajectory uids (when run as root).
    secure: bool = False
    schedulers: int = 1  # the first leads, the others stand by (`tangram up`: 2)
    supervise: bool = False  # restart what dies unexpectedly (`tangram up` turns it on)
    restart: RestartPolicy = field(default_factory=RestartPolicy)


class Mesh:
    """A running mesh: embedded servers and one process per service."""

    def __init__(self, opts: MeshOptions) -> None:
        self.opts = opts
        self.nats: EmbeddedNats | None = None
        self.pg: EmbeddedPostgres | None = None
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.nats_url = opts.nats_url or ""
        self.postgres_dsn = opts.postgres_dsn or ""
        self.lock = StateLock(opts.state_dir)
        self.dashboard_url = ""
        self.reward_front_url = ""
        self.auth: auth.MeshAuth | None = None  # made with the embedded NATS when opts.secure
        self.pg_roles: pg_roles.MeshRoles | None = None  # embedded Postgres when opts.secure
        self.supervising = False
        self._supervisors: dict[str, asyncio.Task[None]] = {}  # by process key
        self.ops_ports: dict[str, int] = {}  # service key -> its ops endpoint's port (kept)

    async def __aenter__(self) -> Mesh:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ servers

    async def start_servers(self) -> None:
        state = self.opts.state_dir
        state.mkdir(parents=True, exist_ok=True)
        self.lock.acquire()  # before any server touches the dir: a second mesh is told who
        if not self.nats_url:
            conf = self._auth_config()
            nats = EmbeddedNats(state / "nats", port=_if_free(self.opts.nats_port), config=conf)
            self.nats = await asyncio.to_thread(nats.start)
            self.nats_url = self.nats.url
        if not self.postgres_dsn:
            keys = state / auth.AUTH_DIR
            pw = pg_roles.superuser_passfile(keys) if self.opts.secure else None
            pg = EmbeddedPostgres(state / "postgres", fsync=self.opts.fsync, passfile=pw)
            self.pg = await asyncio.to_thread(pg.start)
            self.postgres_dsn = self.pg.dsn
            if self.opts.secure:  # migrated by the schema's owner; a role for each service
                self.pg_roles = await pg_roles.provision(self.pg, keys)
        creds = self.auth.mesh_fields() if self.auth is not None else {}
        if self.opts.dashboard and not self.dashboard_url:
            port = _if_free(self.opts.dashboard_port) or free_port()
            self.dashboard_url = f"http://127.0.0.1:{port}"
        if self.opts.dashboard:  # its token: in the keyring, never in mesh.json (others read it)
            auth.Keyring(state).write_dashboard_url(self.dashboard_url)
        creds["dashboard_url"] = self.dashboard_url
        write_mesh(state, self.nats_url, self.postgres_dsn, **creds)

    def _auth_config(self) -> Path | None:
        """With auth on: every principal's credentials, and the broker's config admitting them."""
        if not self.opts.secure:
            return None
        self.auth = auth.MeshAuth(self.opts.state_dir)
        agents = [("cpu_manager", i) for i in range(self.opts.nodes)]
        agents += [("quota_manager", 0), ("gpu_manager", 0)]
        return self.auth.server_config((n, self.service_env(n, i)) for n, i in agents)

    @property
    def dashboard_token(self) -> str:
        """The token the dashboard's pages ask for (made once, kept in the keyring)."""
        return auth.read_token(auth.Keyring(self.opts.state_dir).dashboard_token())

    @property
    def dashboard_login_url(self) -> str:
        """The dashboard's URL with its token, as `tangram up` prints it ("": no dashboard)."""
        return (
            auth.login_url(self.dashboard_url, self.dashboard_token) if self.dashboard_url else ""
        )

    @property
    def client_creds(self) -> Path | None:
        return self.auth.client_creds if self.auth is not None else None

    @property
    def ops_creds(self) -> Path | None:
        return self.auth.ops_creds if self.auth is not None else None

    async def restart_nats(self) -> None:
        assert self.nats is not None
        await self._unwatch("nats-server")
        await asyncio.to_thread(self.nats.kill)
        await asyncio.to_thread(self.nats.start)
        self._watch_servers()

    async def restart_postgres(self) -> None:
        assert self.pg is not None
        await self._unwatch("postgres")
        await asyncio.to_thread(self.pg.kill)
        await asyncio.to_thread(self.pg.start)
        self._watch_servers()

    # ------------------------------------------------------------------ supervision

    def supervise(self) -> None:
        """From now on restart every process of this mesh that dies unexpectedly."""
        self.supervising = True
        self._watch_servers()
        for key in self.procs:
            self._watch_service(key)

    def _watch_servers(self) -> None:
        if self.nats is not None:
            self._watch("nats-server", _server_exit(self.nats), _server_start(self.nats))
        if self.pg is not None:
            self._watch("postgres", _server_exit(self.pg), _server_start(self.pg))

    def _watch_service(self, key: str) -> None:
        async def wait() -> int | None:
            return await self.procs[key].wait()

        name, _, index = key.partition(".")
        self._watch(key, wait, lambda: self._spawn(name, int(index or 0)))

    def _watch(
        self,
        key: str,
        wait: Callable[[], Awaitable[int | None]],
        start: Callable[[], Awaitable[None]],
    ) -> None:
        if not self.supervising or key in self._supervisors:
            return
        task = asyncio.get_running_loop().create_task(
            supervise(key, wait, start, self.opts.restart), name=f"supervise:{key}"
        )
        self._supervisors[key] = task
        task.add_done_callback(_supervisor_done)

    async def _unwatch(self, key: str) -> None:
        """Stop supervising ``key`` (before it is stopped or killed on purpose)."""
        task = self._supervisors.pop(key, None)
        if task is not None:
            task.cancel()
            await asyncio.wait([task])

    # ------------------------------------------------------------------ services

    def service_env(self, name: str, index: int = 0) -> dict[str, str]:
        dsn = self.pg_roles.dsn(name) if self.pg_roles else self.postgres_dsn  # its own role
        env = dict(os.environ)
        env.update(
            {
                "TANGRAM_NATS_URL": self.nats_url,
                "TANGRAM_POSTGRES_DSN": dsn,
                "TANGRAM_SCHEDULER_POLICY": self.opts.policy,
                "TANGRAM_CPU_BACKEND": self.opts.backend,
                "TANGRAM_CPU_STATE_DIR": str(self.opts.state_dir),
                "TANGRAM_CPU_TRAJECTORY_UIDS": str(self.opts.secure).lower(),
                "TANGRAM_DASHBOARD_PORT": self.dashboard_url.rpartition(":")[2] or "0",
                "PYTHONUNBUFFERED": "1",
            }
        )
        if name == "cpu_manager":
            env["TANGRAM_CPU_NODE_ID"] = f"node{index}"
        env.update(self.opts.env)
        creds = self.auth.service_creds(name, env) if self.auth is not None else None
        if creds is not None:
            env[auth.CREDS_VAR] = str(creds)
        if name == "dashboard":  # the keyring's token, so the URL printed is the one it takes
            env.pop("TANGRAM_DASHBOARD_TOKEN", None)
            token = auth.Keyring(self.opts.state_dir).dashboard_token()
            env["TANGRAM_DASHBOARD_TOKEN_FILE"] = str(token)
        if name == "reward_front":  # a client of the gateway, on the port chosen for it
            env["TANGRAM_REWARD_FRONT_PORT"] = self.reward_front_url.rpartition(":")[2] or "0"
        return env

    async def start_service(self, name: str, index: int = 0) -> None:
        """Start one service process (its ``index``-th), supervised if this mesh supervises."""
        await self._spawn(name, index)
        self._watch_service(service_key(name, index))

    async def _spawn(self, name: str, index: int) -> None:
        key = service_key(name, index)
        log_path = self.opts.state_dir / "logs" / f"{key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        port = self.ops_ports.setdefault(key, free_port())
        env = {**self.service_env(name, index), "TANGRAM_OPS_PORT": str(port)}
        url = metrics_url(f"http://127.0.0.1:{port}")
        update_mesh(self.opts.state_dir, metrics_urls={key: url})
        with open(log_path, "ab") as out:  # noqa: ASYNC230 (a local file, opened once)
            self.procs[key] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                f"services.{name}",
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                preexec_fn=die_with_parent,
                start_new_session=True,  # a terminal's Ctrl-C reaches `tangram up` alone,
            )  # which stops the services in drain order, then the servers

    async def start(self, timeout_s: float = 60.0) -> None:
        await self.start_servers()
        await self.start_service("scheduler")
        for i in range(self.opts.nodes):
            await self.start_service("cpu_manager", i)
        if self.opts.quota_manager:
            await self.start_service("quota_manager")
        if self.opts.gpu_manager:
            await self.start_service("gpu_manager")
        await self.start_service("gateway")
        if self.opts.dashboard:
            await self.start_service("dashboard")
        if self.opts.reward_front:
            await self.start_reward_front()
        await self.wait_ready(timeout_s)
        for i in range(1, self.opts.schedulers):  # once the first one leads
            await self.start_service("scheduler", i)
        if self.opts.supervise:
            self.supervise()

    async def start_reward_front(self) -> None:
        """The reward endpoints' HTTP front on its port (when free), a client of the mesh."""
        port = _if_free(self.opts.reward_front_port) or free_port()
        self.reward_front_url = f"http://127.0.0.1:{port}"
        update_mesh(self.opts.state_dir, reward_front_url=self.reward_front_url)
        await self.start_service("reward_front")

    async def status(self, bus: Bus, timeout: float = 2.0) -> SchedulerStatus:
        st = await bus.request(subjects.SCHED_STATUS, StatusQuery(), timeout=timeout)
        if not isinstance(st, SchedulerStatus):
            raise Unavailable(f"the scheduler answered a status query with {type(st).__name__}")
        return st

    async def wait_ready(self, timeout_s: float = 60.0) -> SchedulerStatus:
        """Until the scheduler knows every node and a gateway answers (or a service died)."""
        deadline = time.monotonic() + timeout_s
        bus = await Bus.connect(self.nats_url, "launcher", creds=self.ops_creds)
        try:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(TangramError):
                    st = await self.status(bus, timeout=1.0)
                    if st.nodes >= self.expected_nodes() and await self.gateway_answers(bus):
                        return st
                await asyncio.sleep(0.1)
        finally:
            await bus.close()
        raise Unavailable(f"mesh not ready after {timeout_s}s; logs in {self.opts.state_dir}/logs")

    async def gateway_answers(self, bus: Bus) -> bool:
        """Whether a gateway answers a request (a result query for no action)."""
        from tangram.contract import GetResult
        from tangram.errors import NotFound

        try:
            await bus.request(subjects.GATEWAY, GetResult(action_id="readiness-probe"), timeout=1.0)
        except NotFound:
            return True
        except TangramError:
            return False
        return True

    def expected_nodes(self) -> int:
        """Node agents of every kind the scheduler counts once this mesh is up."""
        return self.opts.nodes + (1 if self.opts.quota_manager else 0)

    def _check_alive(self) -> None:
        for key, proc in self.procs.items():
            if proc.returncode is not None and key not in self._supervisors:
                raise Unavailable(f"{key} exited with {proc.returncode}; see its log")

    def pid(self, key: str) -> int:
        return self.procs[key].pid

    async def kill(self, key: str) -> None:
        """kill -9 one service process (not restarted: its supervisor is stopped first)."""
        await self._unwatch(key)
        proc = self.procs.pop(key)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()

    def drain_s(self, name: str) -> float:
        """The drain bound a service started by this mesh runs with."""
        return config.load(MeshConfig, "TANGRAM_", environ=self.service_env(name)).drain_s

    def stop_limit_s(self, key: str) -> float:
        """How long a service may take to stop on SIGTERM before it is killed (see
        ``STOP_FIXED_S``): beyond its worst case, so a drain is never cut short."""
        return 2 * self.drain_s(key.split(".")[0]) + STOP_FIXED_S

    async def stop_service(self, key: str, timeout_s: float | None = None) -> int | None:
        """SIGTERM one service and wait for it to drain; SIGKILL it after ``timeout_s``
        (default: :meth:`stop_limit_s`). Returns its exit status."""
        await self._unwatch(key)
        proc = self.procs.pop(key, None)
        if proc is None:
            return None
        limit = self.stop_limit_s(key) if timeout_s is None else timeout_s
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(proc.wait(), limit)
        except TimeoutError:
            log.warning("%s did not stop within %.0fs of SIGTERM; killing it", key, limit)
            proc.kill()
            return await proc.wait()

    async def stop(self) -> None:
        """Stop services in drain order, then the embedded servers; nothing is restarted
        meanwhile. The processes of one service stop together: a standby scheduler is gone
        before the leader lets its lock go, so it does not take over a mesh that is stopping."""
        self.supervising = False
        for key in list(self._supervisors):
            await self._unwatch(key)
        for name in STOP_ORDER:
            keys = [k for k in self.procs if k.split(".")[0] == name]
            await asyncio.gather(*(self.stop_service(key) for key in keys))
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
        remove_mesh(self.opts.state_dir)
        self.lock.release()


def service_key(name: str, index: int = 0) -> str:
    """The key of a service process: its name, with its index when it runs several (the node
    agents always: ``cpu_manager.0``; a standby scheduler: ``scheduler.1``)."""
    return f"{name}.{index}" if name == "cpu_manager" or index else name


def _server_exit(server: EmbeddedNats | EmbeddedPostgres) -> Callable[[], Awaitable[int | None]]:
    async def wait() -> int | None:
        assert server.proc is not None
        return await exited(server.proc)

    return wait


def _server_start(server: EmbeddedNats | EmbeddedPostgres) -> Callable[[], Awaitable[None]]:
    async def start() -> None:  # on its port and data dir as before: URLs do not change
        await asyncio.to_thread(server.start)

    return start


def _supervisor_done(task: asyncio.Task[None]) -> None:
    """A supervisor ends only when cancelled; one that died says so (it restarts no more)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("%s died: %r", task.get_name(), task.exception())


def _if_free(port: int | None) -> int | None:
    """``port`` if nothing listens on it now (else None: any free port)."""
    if port is None:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port
