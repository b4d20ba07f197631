"""The scheduler's lead lock on a real Postgres: a standby waits (its wait re-issued), leads
the moment the leader's lock session ends, and the old leader's watch is deposed once the new
epoch is taken; a leader whose Postgres restarts gets its lock back and leads on, one cut off
for longer than ``lost_s`` is deposed (it must stop serving). A Postgres restart, which ends
the leader's and the standby's sessions alike, leaves the lead with a live leader: the standby
waits in the lock again, not holding it; were the leader gone, the standby leads once the lock
has stayed free for its grace."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import asyncpg
import pytest

from services.scheduler import store
from services.scheduler.leadership import Lead, LeadConfig, lock_sessions
from tangram import db
from tangram.embedded import EmbeddedPostgres

from ..support import eventually

FAST = LeadConfig(check_s=0.1, lost_s=1.0, wait_s=0.3)
# a Postgres restart takes about 1 s here: the leader must not be deposed meanwhile
GRACE = LeadConfig(check_s=0.2, lost_s=5.0, wait_s=0.3, grace_s=1.0, retake_s=0.05, poll_s=0.05)


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


async def sessions(dsn: str) -> tuple[str | None, list[str]]:
    """Who holds the lead lock and who waits for it (nothing while Postgres is down)."""
    try:
        conn = await asyncpg.connect(dsn, timeout=1)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
        return None, []
    try:
        return await lock_sessions(conn)
    finally:
        await conn.close()


async def restart(pg: EmbeddedPostgres) -> float:
    """kill -9 Postgres and start it again; when it answered again (monotonic)."""
    await asyncio.to_thread(pg.kill)
    await asyncio.to_thread(pg.start)
    return time.monotonic()


async def test_a_postgres_restart_leaves_the_lead_with_a_live_leader(tmp_path: Path):
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False).start)
    try:
        leader, watch, standby, waiting = await contended(pg)
        both = (leader.name, [standby.name])
        for _ in range(2):  # twice: it holds every time, not by luck
            old = leader._conn
            up = await restart(pg)
            await eventually(
                lambda o=old: leader._conn not in (None, o), what="the lock taken back"
            )
            await eventually(lambda: _are(pg.dsn, both), what="the standby waiting again")
            assert time.monotonic() - up < GRACE.grace_s + 2
            assert not waiting.done()
            assert not watch.done()  # not deposed: the same epoch leads
        await leader_gone_while_down(pg, leader, watch, standby, waiting)
    finally:
        await asyncio.to_thread(pg.stop)


async def contended(
    pg: EmbeddedPostgres,
) -> tuple[Lead, asyncio.Future[None], Lead, asyncio.Future[None]]:
    """On a migrated database: a leader with its watch running, and a standby waiting."""
    pool = await db.connect(pg.dsn, max_size=1)
    try:
        await db.migrate(pool)
        epoch = await store.take_lead(pool)
    finally:
        await pool.close()
    leader = await Lead(pg.dsn, GRACE).__aenter__()
    watch = asyncio.ensure_future(leader.watch(epoch))
    standby = Lead(pg.dsn, GRACE)
    waiting = asyncio.ensure_future(standby.acquire())
    both = (leader.name, [standby.name])
    await eventually(lambda: _are(pg.dsn, both), what="the standby waiting")
    return leader, watch, standby, waiting


async def _are(dsn: str, want: tuple[str, list[str]]) -> bool:
    return await sessions(dsn) == want


async def leader_gone_while_down(
    pg: EmbeddedPostgres,
    leader: Lead,
    watch: asyncio.Future[None],
    standby: Lead,
    waiting: asyncio.Future[None],
) -> None:
    """The leader dies while Postgres is down: the standby leads once its grace has run out."""
    await asyncio.to_thread(pg.kill)
    watch.cancel()
    await leader.close()
    before = time.monotonic()  # the standby may see Postgres back before start() returns
    await asyncio.to_thread(pg.start)
    up = time.monotonic()
    await asyncio.wait_for(waiting, GRACE.grace_s + 5)
    done = time.monotonic()
    assert done - before >= GRACE.grace_s, done - before  # not before its grace ran out
    assert done - up < GRACE.grace_s + 3, done - up
    assert await sessions(pg.dsn) == (standby.name, [])
    await standby.close()


async def test_the_lead_lock_of_another_database_on_the_server_is_not_this_ones(tmp_path: Path):
    """Advisory locks are per database: a mesh whose Postgres server also holds another mesh's
    database is not led by that one's scheduler, and its standby's grace is not cut short."""
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False).start)
    try:
        conn = await asyncpg.connect(pg.dsn)
        try:
            await conn.execute("CREATE DATABASE other_mesh")
            other_dsn = pg.dsn.rsplit("/", 1)[0] + "/other_mesh"
            other = await Lead(other_dsn, GRACE).__aenter__()
            try:
                assert await lock_sessions(conn) == (None, [])
                standby = Lead(pg.dsn, GRACE)
                began = time.monotonic()
                await standby._grace(conn)  # as after a restart: no one holds it here
                assert time.monotonic() - began >= GRACE.grace_s
            finally:
                await other.close()
        finally:
            await conn.close()
    finally:
        await asyncio.to_thread(pg.stop)


async def test_a_lead_let_go_while_postgres_is_down_never_takes_the_lock_back(tmp_path: Path):
    """Its watch still running (as when a cancellation was lost), a closed lead does not re-take
    the lock once Postgres is back: the watch ends, and the standby leads after its grace."""
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False).start)
    try:
        leader, watch, standby, waiting = await contended(pg)
        await asyncio.to_thread(pg.kill)
        await leader.close()  # the watch is left running on purpose
        await asyncio.to_thread(pg.start)
        await asyncio.wait_for(waiting, GRACE.grace_s + 10)
        await asyncio.wait_for(watch, GRACE.check_s + 5)  # it returned, holding nothing
        assert await sessions(pg.dsn) == (standby.name, [])
        await standby.close()
    finally:
        await asyncio.to_thread(pg.stop)
