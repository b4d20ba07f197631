"""Part of the CLI's composition root: a whole mesh on one machine.

Starts embedded nats-server and PostgreSQL (unless URLs are given), then each service as its
own process (``python -m services.NAME``), waits until the mesh answers, and stops it in drain
order: intake first, then the node agents (they finish and report in-flight work), then the
scheduler, then the servers. Tests use the same class to kill -9 and restart single services.
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
from dataclasses import dataclass, field
from pathlib import Path

from tangram import config, subjects
from tangram.bus import Bus
from tangram.config import MeshConfig
from tangram.contract import SchedulerStatus, StatusQuery
from tangram.discovery import StateLock, remove_mesh, write_mesh
from tangram.embedded import EmbeddedNats, EmbeddedPostgres, die_with_parent
from tangram.errors import TangramError, Unavailable

log = logging.getLogger(__name__)

SERVICES = ("gateway", "scheduler", "cpu_manager", "quota_manager", "gpu_manager")
STOP_ORDER = ("gateway", "cpu_manager", "quota_manager", "gpu_manager", "scheduler")

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
            nats = EmbeddedNats(state / "nats", port=_if_free(self.opts.nats_port))
            self.nats = await asyncio.to_thread(nats.start)
            self.nats_url = self.nats.url
        if not self.postgres_dsn:
            pg = EmbeddedPostgres(state / "postgres", fsync=self.opts.fsync)
            self.pg = await asyncio.to_thread(pg.start)
            self.postgres_dsn = self.pg.dsn
        write_mesh(state, self.nats_url, self.postgres_dsn)

    async def restart_nats(self) -> None:
        assert self.nats is not None
        await asyncio.to_thread(self.nats.kill)
        await asyncio.to_thread(self.nats.start)

    async def restart_postgres(self) -> None:
        assert self.pg is not None
        await asyncio.to_thread(self.pg.kill)
        await asyncio.to_thread(self.pg.start)

    # ------------------------------------------------------------------ services

    def service_env(self, name: str, index: int = 0) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "TANGRAM_NATS_URL": self.nats_url,
                "TANGRAM_POSTGRES_DSN": self.postgres_dsn,
                "TANGRAM_SCHEDULER_POLICY": self.opts.policy,
                "TANGRAM_CPU_BACKEND": self.opts.backend,
                "TANGRAM_CPU_STATE_DIR": str(self.opts.state_dir),
                "PYTHONUNBUFFERED": "1",
            }
        )
        if name == "cpu_manager":
            env["TANGRAM_CPU_NODE_ID"] = f"node{index}"
        env.update(self.opts.env)
        return env

    async def start_service(self, name: str, index: int = 0) -> None:
        key = name if name != "cpu_manager" else f"cpu_manager.{index}"
        log_path = self.opts.state_dir / "logs" / f"{key}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:  # noqa: ASYNC230 (a local file, opened once)
            self.procs[key] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                f"services.{name}",
                env=self.service_env(name, index),
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
        await self.wait_ready(timeout_s)

    async def status(self, bus: Bus, timeout: float = 2.0) -> SchedulerStatus:
        st = await bus.request(subjects.SCHED_ACTIONS, StatusQuery(), timeout=timeout)
        if not isinstance(st, SchedulerStatus):
            raise Unavailable(f"the scheduler answered a status query with {type(st).__name__}")
        return st

    async def wait_ready(self, timeout_s: float = 60.0) -> SchedulerStatus:
        """Until the scheduler knows every node and a gateway answers (or a service died)."""
        deadline = time.monotonic() + timeout_s
        bus = await Bus.connect(self.nats_url, "launcher")
        try:
            while time.monotonic() < deadline:
                self._check_alive()
                with contextlib.suppress(TangramError):
                    st = await self.status(bus, timeout=1.0)
                    if st.nodes >= self.expected_nodes() and await self._gateway_answers(bus):
                        return st
                await asyncio.sleep(0.1)
        finally:
            await bus.close()
        raise Unavailable(f"mesh not ready after {timeout_s}s; logs in {self.opts.state_dir}/logs")

    async def _gateway_answers(self, bus: Bus) -> bool:
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
            if proc.returncode is not None:
                raise Unavailable(f"{key} exited with {proc.returncode}; see its log")

    def pid(self, key: str) -> int:
        return self.procs[key].pid

    async def kill(self, key: str) -> None:
        """kill -9 one service process."""
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
        """Stop services in drain order, then the embedded servers."""
        for name in STOP_ORDER:
            for key in [k for k in self.procs if k.split(".")[0] == name]:
                await self.stop_service(key)
        if self.pg is not None:
            await asyncio.to_thread(self.pg.stop)
        if self.nats is not None:
            await asyncio.to_thread(self.nats.stop)
        remove_mesh(self.opts.state_dir)
        self.lock.release()


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
