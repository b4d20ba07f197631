"""The scheduler's records against a real Postgres it does not control: a dispatch leaves only
once its ``started`` record is committed, and a terminal record whose write fails is retried
until it commits (the node's completion is acked only then)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import msgspec
import pytest
from nats.aio.msg import Msg

from tangram import ActionSpec, ExecAction, subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import Dispatch, NodeCommand, codec
from tangram.launcher import Mesh

from ..support import commands_in, eventually

pytestmark = pytest.mark.slow

LOCK_WAITERS = """
SELECT pid, query_start FROM pg_stat_activity
WHERE wait_event_type = 'Lock' AND query ILIKE '%UPDATE actions%' ORDER BY query_start
"""


async def _connection(mesh: Mesh) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(mesh.postgres_dsn)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.fixture
async def pg(mesh: Mesh) -> AsyncIterator[asyncpg.Connection]:
    async for conn in _connection(mesh):
        yield conn


@pytest.fixture
async def locker(mesh: Mesh) -> AsyncIterator[asyncpg.Connection]:
    """A second connection that holds row locks (``pg`` watches from outside its transaction:
    pg_stat_activity is a snapshot inside one)."""
    async for conn in _connection(mesh):
        yield conn


@pytest.fixture
async def dispatches(mesh: Mesh) -> AsyncIterator[dict[str, asyncio.Event]]:
    """action_id -> set when a Dispatch of it is seen on node0's subject."""
    seen: dict[str, asyncio.Event] = {}
    bus = await Bus.connect(mesh.nats_url, "test-observer")

    async def on_msg(msg: Msg) -> None:
        try:
            cmd = codec.decode(msg.data, NodeCommand)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        for one in commands_in(cmd):
            if isinstance(one, Dispatch):
                seen.setdefault(one.action.spec.action_id, asyncio.Event()).set()

    await bus.nc.subscribe(subjects.node("node0").subject, cb=on_msg)
    await bus.nc.flush()
    try:
        yield seen
    finally:
        await bus.close()


def spec(action_id: str, command: str, cpus: int = 1) -> ActionSpec:
    return ActionSpec(
        action_id=action_id,
        job_id=action_id,
        trajectory_id=action_id,
        action=ExecAction(command=command),
        cpus=cpus,
    )


async def status_of(pg: asyncpg.Connection, action_id: str) -> tuple[str, int]:
    row = await pg.fetchrow("SELECT status, attempt FROM actions WHERE action_id = $1", action_id)
    return row["status"], row["attempt"]


async def test_dispatch_waits_for_its_started_record(
    mesh: Mesh,
    client: Client,
    uid: str,
    pg: asyncpg.Connection,
    dispatches,
    locker: asyncpg.Connection,
    tmp_path: Path,
):
    """A scheduler killed between dispatch and record would rebuild the action as queued and
    run it again: so the dispatch must not leave while the record cannot commit."""
    cores = (await mesh.status(client.bus)).free_cores
    marker = tmp_path / "blocker-running"
    blocker = spec(f"{uid}-blocker", f"touch {marker}; sleep 0.5", cpus=cores)
    # its own queue timeout keeps it queued (a grant behind the blocker, as pipelining gives
    # a new trajectory on a node whose actions ran short, would be recorded at once)
    target = msgspec.structs.replace(spec(f"{uid}-target", "echo ran"), queue_timeout_s=60.0)
    await client.submit(blocker)
    await eventually(lambda: asyncio.to_thread(marker.exists), what="the blocker to run")
    await client.submit(target)  # queued: every core is busy
    lock = locker.transaction()
    await lock.start()
    try:
        await locker.execute(
            "SELECT 1 FROM actions WHERE action_id = $1 FOR UPDATE", target.action_id
        )
        # The blocker ends, the target is started, and its record waits for our row lock.
        await eventually(lambda: pg.fetch(LOCK_WAITERS), what="the started record to block")
        sent = dispatches.setdefault(target.action_id, asyncio.Event())
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sent.wait(), 0.5)
        assert await status_of(pg, target.action_id) == ("queued", 0)
    finally:
        await lock.rollback()
    res = await client.result(target.action_id, timeout=30)
    assert res.ok, res.error
    assert (res.stdout, res.attempt) == ("ran\n", 1)
    assert dispatches[target.action_id].is_set()
    await eventually(
        lambda: _terminal(pg, target.action_id), what="the terminal record", timeout_s=10
    )
    assert await status_of(pg, target.action_id) == ("succeeded", 1)


async def test_a_failed_terminal_write_is_retried_until_it_commits(
    mesh: Mesh,
    client: Client,
    uid: str,
    pg: asyncpg.Connection,
    locker: asyncpg.Connection,
    tmp_path: Path,
):
    """A real Postgres error on the terminal record (a cancelled statement, SQLSTATE 57014)
    must not lose it: the node's completion is acked only once it is committed."""
    marker = tmp_path / "running"
    action = spec(f"{uid}-a", f"touch {marker}; sleep 0.3; echo done")
    await client.submit(action)
    await eventually(lambda: asyncio.to_thread(marker.exists), what="the action to run")
    assert await status_of(pg, action.action_id) == ("running", 1)
    lock = locker.transaction()
    await lock.start()
    try:
        await locker.execute(
            "SELECT 1 FROM actions WHERE action_id = $1 FOR UPDATE", action.action_id
        )
        first = (
            await eventually(lambda: pg.fetch(LOCK_WAITERS), what="the terminal record to block")
        )[0]
        assert await pg.fetchval("SELECT pg_cancel_backend($1)", first["pid"])

        async def retried() -> list[asyncpg.Record]:
            rows = await pg.fetch(LOCK_WAITERS)
            return [r for r in rows if r["query_start"] > first["query_start"]]

        await eventually(retried, what="the terminal record to be written again")
    finally:
        await lock.rollback()
    res = await client.result(action.action_id, timeout=30)
    assert res.ok, res.error
    await eventually(
        lambda: _terminal(pg, action.action_id), what="the terminal record", timeout_s=10
    )
    events = await pg.fetchval(
        "SELECT count(*) FROM action_events WHERE action_id = $1"
        " AND status IN ('succeeded', 'failed', 'cancelled')",
        action.action_id,
    )
    assert events == 1


async def _terminal(pg: asyncpg.Connection, action_id: str) -> bool:
    status, _ = await status_of(pg, action_id)
    return status == "succeeded"
