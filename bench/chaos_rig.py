"""The rig around the mesh that ``bench.chaos`` hits: the mesh with one agent behind a proxy
(and the partition of that proxy), the HTTP server counting calls per action, the supervisor's
log, what the bench reads of the mesh (status, lock sessions, ``health_events``), and the load
(every acknowledged action tracked to its end, probes of serving again)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from services.scheduler.leadership import LOCK_ID
from tangram import ActionResult, ActionSpec, ExecAction
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import HttpAction
from tangram.errors import TangramError
from tangram.launcher import Mesh
from tests.ratelimited_server import RateLimitedServer, ServerConfig

log = logging.getLogger("bench.chaos")
PARTITIONED = "cpu_manager.1"  # reaches NATS through the proxy
LOST = ("node_died", "environment_lost")
PROBE_EVERY_S = 0.25
PROBE = "p"  # a probe's trajectory: p<n>, one of its own
WINDOW_S = 30.0  # a fault's figures are looked for this long after its injection


class Partition:
    """A TCP proxy from one agent to NATS, and the partition of that path: an iptables DROP of
    both directions on the proxy's port (loopback), else the proxy ceasing to forward."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.server: asyncio.Server | None = None
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.method = ""
        self._rules: list[list[str]] = []
        self._pipes: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(cls, upstream: int) -> Partition:
        p = cls(upstream)
        p.server = await asyncio.start_server(p._serve, "127.0.0.1", 0)
        return p

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.flowing.wait()
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        for src, dst in ((reader, up_w), (up_r, writer)):
            task = asyncio.get_running_loop().create_task(self._pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await src.read(65536):
                await self.flowing.wait()
                dst.write(data)
                await dst.drain()
        dst.close()

    async def cut(self) -> None:
        port = str(self.port)
        rules = [
            ["INPUT", "-i", "lo", "-p", "tcp", flag, port, "-j", "DROP"]
            for flag in ("--dport", "--sport")
        ]
        try:
            for rule in rules:
                await _iptables("-I", rule)
                self._rules.append(rule)
            self.method = "iptables DROP on the agent's proxy port (loopback, both directions)"
        except (OSError, RuntimeError) as exc:
            await self.heal()
            self.method = f"the proxy stopped forwarding (iptables unusable: {exc})"
            self.flowing.clear()

    async def heal(self) -> None:
        while self._rules:
            await _iptables("-D", self._rules.pop())
        self.flowing.set()

    async def close(self) -> None:
        await self.heal()
        if self.server is not None:
            self.server.close()
        for task in list(self._pipes):
            task.cancel()


async def _iptables(op: str, rule: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(
        "iptables", "-w", op, *rule, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"iptables {op}: {err.decode().strip()}")


class ChaosMesh(Mesh):
    """The launcher's mesh, with one agent reaching NATS through the partition's proxy."""

    partition: Partition | None = None

    async def start_servers(self) -> None:
        await super().start_servers()
        port = int(self.nats_url.rpartition(":")[2])
        self.partition = await Partition.open(port)

    def service_env(self, name: str, index: int = 0) -> dict[str, str]:
        env = super().service_env(name, index)
        if self.partition is not None and f"{name}.{index}" == PARTITIONED:
            env["TANGRAM_NATS_URL"] = self.partition.url
        return env

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            if self.partition is not None:
                await self.partition.close()


class SupervisorLog(logging.Handler):
    """What the launcher's supervisor said, with when (wall clock)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.created, record.getMessage()))

    def first(self, key: str, words: str, after: float) -> float | None:
        return next(
            (t for t, m in self.lines if t >= after and m.startswith(f"{key} ") and words in m),
            None,
        )


class CountingServer(RateLimitedServer):
    """The rate-limited server, counting every call it gets per action (``X-Job``)."""

    def __init__(self, cfg: ServerConfig) -> None:
        super().__init__(cfg)
        self.calls: collections.Counter[str] = collections.Counter()

    async def _call(self, request: Any) -> Any:
        self.calls[request.headers.get("X-Job", "-")] += 1
        return await super()._call(request)


# --------------------------------------------------------------------------- observing


@dataclass
class Watch:
    """What the bench reads about the mesh: its status (as the operator), the lock sessions
    and ``health_events`` (Postgres, reconnecting as the database comes and goes)."""

    mesh: ChaosMesh
    bus: Bus
    said: SupervisorLog
    conn: asyncpg.Connection | None = None

    async def db(self, sql: str, *args: object) -> list[asyncpg.Record] | None:
        try:
            if self.conn is None or self.conn.is_closed():
                self.conn = await asyncpg.connect(self.mesh.postgres_dsn, timeout=2)
            return await self.conn.fetch(sql, *args, timeout=2)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
            if self.conn is not None:
                self.conn.terminate()
            self.conn = None
            return None

    async def epoch(self) -> int:
        try:
            return (await self.mesh.status(self.bus, timeout=0.5)).epoch
        except TangramError:
            return 0

    async def leader(self) -> tuple[str, int]:
        """The leading scheduler's process key and how many standbys wait ('' : none leads)."""
        rows = await self.db(
            "SELECT l.granted, s.application_name FROM pg_locks l JOIN pg_stat_activity s"
            " USING (pid) WHERE l.locktype = 'advisory' AND l.classid = 0 AND l.objid = $1"
            " AND l.objsubid = 1",
            LOCK_ID,
        )
        holder = next((r["application_name"] for r in rows or [] if r["granted"]), None)
        waiting = sum(1 for r in rows or [] if not r["granted"])
        if holder is None:
            return "", waiting
        pid = int(holder.split()[1].rsplit(":", 1)[1])  # named by host:pid (leadership.py)
        key = next((k for k, p in self.mesh.procs.items() if p.pid == pid), "")
        return key, waiting

    async def transitions(self, t0: float) -> list[dict[str, Any]]:
        rows = await self.db(
            "SELECT node_id, old_state, new_state, reason, extract(epoch FROM at)::float8 AS at"
            " FROM health_events WHERE at >= to_timestamp($1) ORDER BY at, id",
            t0,
        )
        return [
            {
                "node": r["node_id"],
                "change": f"{r['old_state']}->{r['new_state']}",
                "after_s": round(r["at"] - t0, 3),
                "why": r["reason"],
            }
            for r in rows or []
        ]

    def alive(self) -> bool:
        servers = [s.proc for s in (self.mesh.nats, self.mesh.pg) if s is not None]
        return all(p is not None and p.poll() is None for p in servers) and all(
            p.returncode is None for p in self.mesh.procs.values()
        )

    async def unsettled(self) -> str:
        """What keeps the mesh from being whole ('' : nothing): every process up, every agent
        known and healthy, a leader and a standby."""
        if not self.alive():
            return "a process is down"
        try:
            st = await self.mesh.status(self.bus, timeout=1.0)
        except TangramError as exc:
            return f"no status: {exc}"
        rows = st.node_rows  # the CPU nodes (``nodes`` counts the quota agent too)
        if st.nodes < self.mesh.expected_nodes() or any(r.health != "healthy" for r in rows):
            known = ", ".join(f"{r.node_id}:{r.health or '?'}" for r in rows)
            return f"{st.nodes} agents known ({known})"
        key, waiting = await self.leader()
        return "" if key and waiting >= 1 else f"leader {key or 'none'}, {waiting} standing by"


# --------------------------------------------------------------------------- load


@dataclass
class Sent:
    """One acknowledged action."""

    spec: ActionSpec
    kind: str  # exec / http
    phase: str  # the fault whose window it was submitted in
    acked_at: float
    result: ActionResult | None = None
    done_at: float | None = None
    waiting_failed: str = ""  # why waiting for its result raised, if it did

    @property
    def node(self) -> str:
        alloc = self.result.allocation if self.result is not None else None
        return alloc.node_id if alloc is not None else ""

    @property
    def lost(self) -> bool:
        err = self.result.error if self.result is not None else None
        return err is not None and str(err.kind) in LOST


@dataclass
class Load:
    """An open-loop stream of exec actions (and HTTP calls), every one tracked to its end."""

    client: Client
    marks: Path
    server: RateLimitedServer
    quota: str
    trajectories: int
    phase: str = "warm-up"
    sent: dict[str, Sent] = field(default_factory=dict)
    unacked: collections.Counter[str] = field(default_factory=collections.Counter)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _ids: int = 0

    def exec_spec(self, trajectory: str) -> ActionSpec:
        self._ids += 1
        aid = f"x{self._ids}"
        cmd = f"echo 1 >> {self.marks}/{aid}; sleep 0.1"
        action = ExecAction(command=cmd)
        # small environments: every probe opens one of its own
        return ActionSpec(
            action_id=aid, job_id="chaos", trajectory_id=trajectory, action=action, memory_mb=16
        )

    def http_spec(self) -> ActionSpec:
        self._ids += 1
        aid = f"h{self._ids}"
        act = HttpAction(
            method="GET",
            url=f"{self.server.url}/call",
            quota=self.quota,
            headers={"X-Job": aid},  # the server counts the calls it gets per action
            max_retries=0,  # so a second call is a second run, not a retry
        )
        return ActionSpec(action_id=aid, job_id="chaos-http", trajectory_id="", action=act)

    async def stream(self, rate: float, http_rate: float, stop: asyncio.Event) -> None:
        """Submit at ``rate`` (exec) and ``http_rate`` per second until ``stop``."""
        start, n, h = time.monotonic(), 0, 0
        while not stop.is_set():
            elapsed = time.monotonic() - start
            while n < elapsed * rate:
                self.spawn(self.exec_spec(f"t{n % self.trajectories}"), "exec")
                n += 1
            while h < elapsed * http_rate:
                self.spawn(self.http_spec(), "http")
                h += 1
            await asyncio.sleep(0.01)  # the stream's pace

    def spawn(self, spec: ActionSpec, kind: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(self.track(spec, kind))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def track(self, spec: ActionSpec, kind: str) -> None:
        phase = self.phase
        try:
            await self.client.submit(spec)
        except TangramError as exc:  # not acknowledged: nothing is promised for it
            self.unacked[phase] += 1
            log.info("%s not acknowledged: %s", spec.action_id, exc)
            return
        sent = self.sent[spec.action_id] = Sent(spec, kind, phase, time.time())
        try:
            sent.result = await self.client.result(spec.action_id, timeout=300)
            sent.done_at = time.time()
            if spec.trajectory_id.startswith(PROBE):
                await self.client.close_env(spec.trajectory_id)
        except TangramError as exc:
            sent.waiting_failed = f"{type(exc).__name__}: {exc}"

    async def serving_again(self, t0: float, kind: str) -> float | None:
        """Seconds from ``t0`` until the first action submitted after it succeeds: a probe of
        a fresh trajectory every ``PROBE_EVERY_S`` until one has (one still in flight can only
        end later than the first success, so the first is the earliest)."""
        probes: list[str] = []
        while time.time() - t0 < WINDOW_S:
            won = self._succeeded(probes)
            if won:
                return min(won) - t0
            spec = self.http_spec() if kind == "http" else self.exec_spec(f"{PROBE}{self._ids}")
            probes.append(spec.action_id)
            self.spawn(spec, kind)
            await asyncio.sleep(PROBE_EVERY_S)
        return None

    def _succeeded(self, aids: list[str]) -> list[float]:
        return [
            s.done_at
            for aid in aids
            if (s := self.sent.get(aid)) is not None
            and s.result is not None
            and s.result.ok
            and s.done_at is not None
        ]
