"""The scheduler's lead lock on a real Postgres: a standby waits (its wait re-issued), leads
the moment the leader's lock session ends, and the old leader's watch is deposed once the new
epoch is taken; a leader whose Postgres restarts gets its lock back and leads on, one cut off
for longer than ``lost_s`` is deposed (it must stop serving)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from services.scheduler import store
from services.scheduler.leadership import Lead, LeadConfig
from tangram import db
from tangram.embedded import EmbeddedPostgres

from ..support import eventually

FAST = LeadConfig(check_s=0.1, lost_s=1.0, wait_s=0.3)


async def test_lead_lock_takeover_and_loss(tmp_path: Path):
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False).start)
    try:
        pool = await db.connect(pg.dsn, max_size=2)
        try:
            await db.migrate(pool)
            await standby_takes_over(pool, pg.dsn)
            epoch = await store.take_lead(pool)
        finally:
            await pool.close()
        await leader_cut_off(pg, epoch)
    finally:
        await asyncio.to_thread(pg.stop)


async def wait_started(pool: asyncpg.Pool, lead: Lead) -> object:
    """When the session of ``lead`` issued its current statement."""
    sql = "SELECT query_start FROM pg_stat_activity WHERE application_name = $1"
    return await pool.fetchval(sql, lead.name)


async def standby_takes_over(pool: asyncpg.Pool, dsn: str) -> None:
    leader = await Lead(dsn, FAST).__aenter__()
    standby = Lead(dsn, FAST)
    waiting = asyncio.ensure_future(standby.acquire())
    watch = asyncio.ensure_future(leader.watch(await store.take_lead(pool)))
    first = await eventually(lambda: wait_started(pool, standby), what="the standby waiting")
    await eventually(lambda: _later(pool, standby, first), what="its wait issued again")
    assert not waiting.done()
    assert not watch.done()
    assert leader._conn is not None
    leader._conn.terminate()  # as when its connection breaks: the lock is let go
    await asyncio.wait_for(waiting, 5)
    new = await store.take_lead(pool)
    with pytest.raises(store.Deposed, match=f"replaced by epoch {new}"):
        await asyncio.wait_for(watch, 5)
    await asyncio.gather(leader.close(), standby.close())


async def _later(pool: asyncpg.Pool, lead: Lead, first: object) -> bool:
    return await wait_started(pool, lead) != first


async def leader_cut_off(pg: EmbeddedPostgres, epoch: int) -> None:
    leader = await Lead(pg.dsn, FAST).__aenter__()
    watch = asyncio.ensure_future(leader.watch(epoch))
    old = leader._conn
    await asyncio.to_thread(pg.kill)
    await asyncio.to_thread(pg.start)
    await eventually(lambda: leader._conn not in (None, old), what="the lock taken back")
    assert not watch.done()
    await asyncio.to_thread(pg.kill)  # and down for good
    with pytest.raises(store.Deposed, match="lost its lead lock"):
        await asyncio.wait_for(watch, 10)
    await leader.close()
