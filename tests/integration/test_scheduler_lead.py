"""The epoch fences the scheduler's writes: a scheduler another one replaced, but still alive,
changes nothing in Postgres and stops; nothing it was handed is lost.

The takeover is taken by the test itself (``store.take_lead``, what a new scheduler does first),
so the old scheduler is alive and unaware, as after a long pause or a partition.

A Postgres restart ends the sessions of the leader and of the standby alike; the leader takes
its lock back, the standby waits again (see leadership), and the mesh serves on under the same
epoch."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from services.scheduler import store
from services.scheduler.core.effects import EnvChanged
from services.scheduler.leadership import lock_sessions
from tangram import ActionSpec, ExecAction, db
from tangram.bus import Bus
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually, postgres_pool, running_mesh

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[asyncpg.Pool]:
    async with postgres_pool(tmp_path / "pg") as p:
        yield p


def env(trajectory_id: str) -> EnvChanged:
    return EnvChanged(trajectory_id, "job", "node0", "inc", 64, "active")


async def env_ids(pool: asyncpg.Pool) -> set[str]:
    return {r["trajectory_id"] for r in await pool.fetch("SELECT trajectory_id FROM envs")}


async def test_a_write_in_flight_commits_before_the_takeover_and_none_after(
    pool: asyncpg.Pool,
) -> None:
    old = await store.take_lead(pool)
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        await store.write(conn, [env("before")], time.time(), old)  # holds the leader row
        takeover = asyncio.ensure_future(store.take_lead(pool))

        async def waiting() -> bool:
            return bool(
                await pool.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                    " AND query ILIKE '%scheduler_leader%FOR UPDATE%'"
                )
            )

        await eventually(waiting, what="the takeover to wait for the write in flight")
        assert not takeover.done()
        await tx.commit()
        new = await takeover
        assert new > old
        with pytest.raises(store.Deposed, match=f"epoch {old} was replaced by epoch {new}"):
            await store.write(conn, [env("after")], time.time(), old)
        await store.write(conn, [env("by-the-new-one")], time.time(), new)
    assert await env_ids(pool) == {"before", "by-the-new-one"}


async def test_a_replaced_scheduler_stops_without_writing_and_loses_nothing(
    tmp_path: Path,
) -> None:
    async with running_mesh(tmp_path / "mesh", quota_manager=False) as mesh:
        async with Client.connect(mesh.nats_url) as client:
            assert (await client.exec("true", trajectory_id="warm", job_id="j")).ok
            pool = await db.connect(mesh.postgres_dsn, max_size=2)
            try:
                await store.take_lead(pool)  # what a new scheduler does first
                spec = ActionSpec(
                    action_id="after-takeover",
                    job_id="j",
                    trajectory_id="t",
                    action=ExecAction(command="true"),
                )
                await client.submit(spec)
                scheduler = mesh.procs["scheduler"]
                await eventually(
                    lambda: scheduler.returncode is not None, what="the old scheduler to stop"
                )
                log = (mesh.opts.state_dir / "logs" / "scheduler.log").read_text()
                assert "was replaced by epoch" in log
                row = await pool.fetchrow(
                    "SELECT status, attempt FROM actions WHERE action_id = $1", spec.action_id
                )
                assert (row["status"], row["attempt"]) == ("queued", 0)
                del mesh.procs["scheduler"]
                await mesh.start_service("scheduler")  # the one that leads now
                result = await client.result(spec.action_id, timeout=60)
                assert result.ok, result.error
                assert result.attempt == 1
            finally:
                await pool.close()


async def leading(mesh: Mesh) -> tuple[str, int]:
    """The process key of the leading scheduler and how many standbys wait ('': none leads)."""
    conn = await asyncpg.connect(mesh.postgres_dsn, timeout=2)
    try:
        holder, waiting = await lock_sessions(conn)
    finally:
        await conn.close()
    if holder is None:
        return "", len(waiting)
    pid = int(holder.split()[1].rsplit(":", 1)[1])  # the session is named by host:pid
    return next((k for k in mesh.procs if mesh.pid(k) == pid), "?"), len(waiting)


async def test_a_postgres_restart_keeps_the_leader_and_the_mesh_serves_again(tmp_path: Path):
    async with running_mesh(tmp_path / "mesh", quota_manager=False, schedulers=2) as mesh:
        bus = await Bus.connect(mesh.nats_url, "test-probe")
        try:
            async with Client.connect(mesh.nats_url) as client:
                assert (await client.exec("true", trajectory_id="warm", job_id="j")).ok
                leader = await eventually(lambda: _with_a_standby(mesh), what="a standby")
                epoch = (await mesh.status(bus)).epoch
                cut = time.monotonic()
                probe = asyncio.ensure_future(
                    client.exec("true", trajectory_id="during", job_id="j")
                )  # submitted as Postgres dies
                await mesh.restart_postgres()
                after = await client.exec("true", trajectory_id="after", job_id="j")
                served_s = time.monotonic() - cut
                assert after.ok, after.error
                assert (await probe).ok
                assert await eventually(lambda: _with_a_standby(mesh), what="a standby") == leader
                assert (await mesh.status(bus)).epoch == epoch  # no takeover
                assert all(p.returncode is None for p in mesh.procs.values())
                log.warning("Postgres restarted: an action served %.2fs after the kill", served_s)
                assert served_s < 8, served_s
        finally:
            await bus.close()


async def _with_a_standby(mesh: Mesh) -> str:
    try:
        key, waiting = await leading(mesh)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return ""
    return key if waiting else ""
