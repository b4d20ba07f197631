"""The epoch fences the scheduler's writes: a scheduler another one replaced, but still alive,
changes nothing in Postgres and stops; nothing it was handed is lost.

The takeover is taken by the test itself (``store.take_lead``, what a new scheduler does first),
so the old scheduler is alive and unaware, as after a long pause or a partition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from services.scheduler import store
from services.scheduler.core.effects import EnvChanged
from tangram import ActionSpec, ExecAction, db
from tangram.client import Client

from ..support import eventually, postgres_pool, running_mesh

pytestmark = pytest.mark.slow


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
