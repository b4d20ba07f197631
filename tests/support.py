"""Helpers every test shares: waiting on a condition (``eventually``) and starting a mesh
(``running_mesh``). Tests wait on conditions with a deadline, never on bare sleeps."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from tangram import auth, db, subjects
from tangram.bus import Bus, _Nats
from tangram.client import Client
from tangram.contract import (
    ActionResult,
    ActionSpec,
    Commands,
    Completions,
    ExecAction,
    GatewayRequest,
    NodeCommand,
    NodeMessage,
    codec,
    encode,
)
from tangram.embedded import EmbeddedPostgres
from tangram.launcher import Mesh, MeshOptions

T = TypeVar("T")


class FakeGateway:
    """A stand-in on the gateway's subject for client tests: each request decoded and kept in
    ``seen`` (in arrival order), then answered with what ``reply`` returns (None: left
    unanswered, as an overloaded gateway would)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.seen: list[GatewayRequest] = []

    async def start(self) -> None:
        await self.bus.nc.subscribe(subjects.GATEWAY.subject, cb=self._on_msg)

    async def _on_msg(self, msg: Msg) -> None:
        req = codec.decode(msg.data, GatewayRequest)
        self.seen.append(req)
        answer = await self.reply(req)
        if answer is not None:
            await msg.respond(encode(answer))

    async def reply(self, req: GatewayRequest) -> msgspec.Struct | None:
        raise NotImplementedError


FAST_SERVICES = {
    "TANGRAM_SCHEDULER_NODE_TIMEOUT_S": "3",
    "TANGRAM_SCHEDULER_RECONCILE_GRACE_S": "0.5",
    "TANGRAM_SCHEDULER_SWEEP_S": "1",
    "TANGRAM_CPU_HEARTBEAT_S": "0.5",
}


async def eventually(
    probe: Callable[[], T | Awaitable[T]],
    *,
    what: str,
    timeout_s: float = 15.0,
    interval_s: float = 0.02,
) -> T:
    """Call ``probe`` (sync or async) until it returns something truthy, and return that.

    Fails loudly: after ``timeout_s`` raises AssertionError naming ``what`` and the last value
    (or the last exception) the probe gave."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        try:
            value = probe()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
            last = value
        except AssertionError as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}; last: {last!r}")
        await asyncio.sleep(interval_s)


def mesh_options(root: Path, **kw: object) -> MeshOptions:
    """Options for a test mesh under ``root``: the process backend and fast service timers;
    ``env`` adds to (or overrides) those timers, other keywords go to MeshOptions."""
    env = dict(FAST_SERVICES)
    env.update(kw.pop("env", {}) or {})  # type: ignore[arg-type]
    kw.setdefault("backend", "process")
    kw.setdefault("gpu_manager", False)  # torch in one more process: only where a test asks
    kw.setdefault("reward_front", False)  # an HTTP front only where a test asks
    kw.setdefault("dashboard", False)  # the web UI (and its span store) only where a test asks
    return MeshOptions(state_dir=root, fsync=False, env=env, **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_mesh(
    root: Path, *, servers_only: bool = False, **kw: object
) -> AsyncIterator[Mesh]:
    """A mesh under ``root`` (see :func:`mesh_options`), stopped on exit even when its start
    failed half-way. ``servers_only`` starts NATS and Postgres alone (the test starts services)."""
    mesh = Mesh(mesh_options(root, **kw))
    try:
        if servers_only:
            await mesh.start_servers()
        else:
            await mesh.start()
        yield mesh
    finally:
        await mesh.stop()


@contextlib.asynccontextmanager
async def process_backend(
    root: Path, node_id: str, spawner: bool = True
) -> AsyncIterator[ProcessBackend]:
    """A started process backend with its environments under ``root`` (actions as this test's
    own user; ``spawner`` off: forked by the agent itself), closed on exit."""
    backend = ProcessBackend(
        ProcessConfig(root=root / "envs", node_id=node_id, trajectory_uids=False, spawner=spawner)
    )
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


@contextlib.asynccontextmanager
async def postgres_pool(root: Path, max_size: int = 6) -> AsyncIterator[asyncpg.Pool]:
    """A migrated pool on a Postgres of its own under ``root`` (fsync off), stopped on exit."""
    pg = await asyncio.to_thread(EmbeddedPostgres(root, fsync=False).start)
    try:
        pool = await db.connect(pg.dsn, max_size=max_size)
        try:
            await db.migrate(pool)
            yield pool
        finally:
            await pool.close()
    finally:
        await asyncio.to_thread(pg.stop)


def exec_spec(uid: str, name: str, command: str) -> ActionSpec:
    """An exec action with its own trajectory, named ``{uid}-{name}``."""
    return ActionSpec(
        action_id=f"{uid}-{name}",
        job_id=uid,
        trajectory_id=f"{uid}-{name}",
        action=ExecAction(command=command),
    )


def unbatched(msg: NodeMessage) -> list[NodeMessage]:
    """A node message as the messages it carries (completions may travel together)."""
    return list(msg.items) if isinstance(msg, Completions) else [msg]


def commands_in(cmd: NodeCommand) -> list[NodeCommand]:
    """A node command as the commands it carries (a pass's commands for a node travel
    together)."""
    return list(cmd.items) if isinstance(cmd, Commands) else [cmd]


@contextlib.asynccontextmanager
async def spying(nats_url: str, subject: str, typ: Any) -> AsyncIterator[list[Any]]:
    """Every message on ``subject`` while inside, decoded as ``typ`` (undecodable ones left
    out)."""
    seen: list[Any] = []

    async def on_msg(msg: Any) -> None:
        with contextlib.suppress(msgspec.ValidationError, msgspec.DecodeError):
            seen.append(codec.decode(msg.data, typ))

    bus = await Bus.connect(nats_url, "test-spy")
    try:
        await bus.nc.subscribe(subject, cb=on_msg)
        await bus.nc.flush()
        yield seen
    finally:
        await bus.close()


async def burst(
    nats_url: str, ran: Path, n: int, trajectories: int, then: str = ""
) -> list[ActionResult]:
    """``n`` actions at once from one client, each appending its id to ``ran`` (then running
    ``then``); asserts each succeeded and ran exactly once."""
    async with Client.connect(nats_url) as client:
        results = await asyncio.gather(
            *(
                client.exec(
                    f'echo "$TANGRAM_ACTION_ID" >> {ran}{then}',
                    trajectory_id=f"burst{k % trajectories}",
                    job_id="burst",
                    wait_s=60,
                )
                for k in range(n)
            )
        )
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    lines = (await asyncio.to_thread(ran.read_text)).split()
    assert sorted(lines) == sorted(r.action_id for r in results)
    return list(results)


async def raw_nats(url: str, creds: Path, errors: list[Exception]) -> NATS:
    """A bare connection (no reconnecting) presenting the credential in ``creds``; what the
    broker refuses it (a permissions violation) is appended to ``errors``. nats-py's client as
    the bus subclasses it: nats-py's own ``flush`` writes its PING ahead of a SUB still in its
    buffer, so a message published right after ``subscribe`` + ``flush`` could beat the SUB to
    the broker and be lost (seen in CI: ``test_the_normal_paths_work_under_their_grants``)."""
    who = auth.load_creds(creds)

    async def on_error(exc: Exception) -> None:
        errors.append(exc)

    nc = _Nats()
    await nc.connect(url, **who.login(), error_cb=on_error, allow_reconnect=False)
    return nc


async def tables_holding(dsn: str, needle: str) -> list[str]:
    """The public tables of the database at ``dsn`` with a row whose text holds ``needle``
    (a secret that must be nowhere in Postgres)."""
    conn = await asyncpg.connect(dsn)
    try:
        tables = await conn.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public'"
        )
        found = []
        for t in tables:
            rows = await conn.fetch(f'SELECT t::text AS row FROM "{t["table_name"]}" t')
            if any(needle in r["row"] for r in rows):
                found.append(t["table_name"])
        return found
    finally:
        await conn.close()
