"""Review of the one-record writes by primary key (``store.write_one``, the gateway's
``insert_one``, ``db.BY_KEY``).

One failing test (a bug): ``insert_one`` skips the gateway's claim bookkeeping that the batch
path does (``Claims.learn`` moves a trajectory in use to the newest end), so a trajectory fed by
lone actions ages out of the bounded cache as if unused.

The others pass and pin behaviour the change put at risk that ``test_write_one.py`` does not
cover: ``write_one`` against ``write`` for more records (a success with or without an exit code,
a finish of an action never started, no node, GPU units and no units, a missing row) and a
one-record write caught in flight by a takeover (blocked behind it, before or after its update)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import asyncpg
import msgspec
import pytest

from services.gateway import store as gateway_store
from services.scheduler import store
from services.scheduler.core.effects import Finish, StartOnNode
from tangram.contract import (
    ActionError,
    ActionResult,
    Allocation,
    ErrorKind,
    Timings,
    UnifiedAction,
)

from ..support import eventually, postgres_pool
from .test_write_one import action, by_key, events, intake, row

pytestmark = pytest.mark.slow


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[asyncpg.Pool]:
    async with postgres_pool(tmp_path / "pg") as p:
        yield p


# ---------------------------------------------------------------- the gateway's claims (a bug)


def owned(aid: str, trajectory: str, owner: str = "alice") -> gateway_store.Owned:
    return gateway_store.Owned(action(aid, trajectory), owner)


async def test_a_lone_action_keeps_its_trajectory_claim_among_the_newest(
    pool: asyncpg.Pool,
) -> None:
    """The batch path (``insert_actions``, ``_INSERT_CLAIMED``) calls ``Claims.learn`` for a
    covered action it inserts, which moves its trajectory to the newest end of the bounded
    cache. ``insert_one`` does not: a trajectory used again and again through lone actions (a
    quiet gateway's every batch) is evicted first, as if unused, and its next action pays the
    claim statement again. The same sequence must leave the same claims whichever path wrote
    the lone action."""

    async def sequence(lone_path: str) -> gateway_store.Claims:
        claims = gateway_store.Claims(limit=2)
        tag = lone_path
        async with pool.acquire() as conn:  # two first actions: their claims are made, learned
            await gateway_store.insert_actions(conn, [owned(f"{tag}-1", f"{tag}-t1")], claims)
            await gateway_store.insert_actions(conn, [owned(f"{tag}-2", f"{tag}-t2")], claims)
        lone = owned(f"{tag}-3", f"{tag}-t1")  # t1 used again: now the newest
        assert gateway_store.one_row([lone], claims)
        conn = await by_key(pool)
        try:
            if lone_path == "one":
                (got,) = await gateway_store.insert_one(conn, lone, claims)
            else:
                (got,) = await gateway_store.insert_actions(conn, [lone], claims)
            assert got.new
            # a third trajectory claimed: the oldest (t2, not t1) must go
            await gateway_store.insert_actions(conn, [owned(f"{tag}-4", f"{tag}-t3")], claims)
        finally:
            await pool.release(conn)
        return claims

    def kept(claims: gateway_store.Claims, tag: str) -> list[bool]:
        return [claims.covers([owned("probe", f"{tag}-t{i}")]) for i in (1, 2, 3)]

    batch, one = await sequence("batch"), await sequence("one")
    assert kept(batch, "batch") == [True, False, True]  # the batch path's bookkeeping
    assert kept(one, "one") == kept(batch, "batch"), (
        "insert_one left t1 the oldest claim (evicted) though it was just used"
    )


# ------------------------------------------------ write_one == write (passing: pinned behaviour)


def started(
    act: UnifiedAction, attempt: int, cores: tuple[int, ...] = (0, 1), gpus: tuple[int, ...] = ()
) -> store.Started:
    act = msgspec.structs.replace(act, attempt=attempt)
    return store.Started(StartOnNode("n0", act, cores, "inc0", gpus=gpus), at=2.0)


def finished(
    act: UnifiedAction,
    attempt: int,
    status: str,
    kind: ErrorKind | None = None,
    exit_code: int | None = None,
    node: str | None = "n0",
) -> Finish:
    result = ActionResult(
        action_id=act.spec.action_id,
        status=status,
        exit_code=exit_code,
        error=ActionError(kind=kind, message="why") if kind else None,
        allocation=Allocation(node_id=node) if node else None,
        timings=Timings(submitted_at=1.0, finished_at=3.0),
        attempt=attempt,
    )
    return Finish(act, result)


STEPS: dict[str, Callable[[UnifiedAction], store.Started | Finish]] = {
    "start": lambda a: started(a, 1),
    "start-again": lambda a: started(a, 2),
    "start-gpus": lambda a: started(a, 3, cores=(), gpus=(4, 5)),
    "start-no-units": lambda a: started(a, 4, cores=()),
    "succeeded": lambda a: finished(a, 1, "succeeded", exit_code=0),
    "succeeded-no-exit-code": lambda a: finished(a, 1, "succeeded"),
    "failed": lambda a: finished(a, 2, "failed", ErrorKind.INTERNAL, exit_code=3),
    "failed-no-node": lambda a: finished(a, 0, "failed", ErrorKind.NODE_DIED, node=None),
    "cancelled-never-started": lambda a: finished(a, 0, "cancelled", ErrorKind.CANCELLED),
}


@pytest.mark.parametrize(
    "steps", [*itertools.product(STEPS, repeat=2), ("start-again", "start", "succeeded")]
)
async def test_one_record_equals_the_batch_statement(
    pool: asyncpg.Pool, steps: tuple[str, ...]
) -> None:
    epoch = await store.take_lead(pool)
    batch, one = action("batch"), action("one")
    await intake(pool, batch, one)
    conn = await by_key(pool)
    try:
        for step in steps:
            await store.write(conn, [STEPS[step](batch)], time.time(), epoch)
            await store.write_one(conn, STEPS[step](one), time.time(), epoch)
            assert await row(pool, "one") == await row(pool, "batch"), step
            assert await events(pool, "one") == await events(pool, "batch"), step
        # a record of an action that has no row: nothing written, no error, either way
        await store.write(conn, [STEPS[steps[0]](action("no-batch"))], time.time(), epoch)
        await store.write_one(conn, STEPS[steps[0]](action("no-one")), time.time(), epoch)
        assert await events(pool, "no-batch") == await events(pool, "no-one") == []
    finally:
        await pool.release(conn)


# ------------------------------------- the fence on a write in flight (passing: pinned behaviour)

NEXT_EPOCH = "UPDATE scheduler_leader SET epoch = nextval('scheduler_epoch') WHERE id = 1"
BLOCKED = (
    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    " AND query ILIKE '%lead AS (SELECT 1 FROM scheduler_leader%'"
)


@pytest.mark.parametrize("updated_first", [False, True])
@pytest.mark.parametrize("kind", ["started", "finished"])
async def test_a_one_record_write_blocked_behind_a_takeover_changes_nothing(
    pool: asyncpg.Pool, updated_first: bool, kind: str
) -> None:
    """A takeover holds the leader row (FOR UPDATE), before or after its epoch update; the old
    scheduler's one-record write (its generic plan made already) waits on that row, then must
    change nothing and say Deposed."""
    old = await store.take_lead(pool)
    acts = [action(f"x{i}") for i in range(6)]
    await intake(pool, *acts)
    conn = await by_key(pool)
    try:
        for a in acts[:5]:  # the statement planned and run on this session before
            await store.write_one(conn, started(a, 1), time.time(), old)
        target = acts[5] if kind == "started" else acts[0]
        record = started(target, 1) if kind == "started" else finished(target, 1, "succeeded")
        async with pool.acquire() as taker:
            tx = taker.transaction()
            await tx.start()
            await taker.execute("SELECT epoch FROM scheduler_leader WHERE id = 1 FOR UPDATE")
            if updated_first:
                await taker.execute(NEXT_EPOCH)
            write = asyncio.ensure_future(store.write_one(conn, record, time.time(), old))
            await eventually(lambda: pool.fetchval(BLOCKED), what="the write to wait")
            assert not write.done()
            if not updated_first:
                await taker.execute(NEXT_EPOCH)
            await tx.commit()
        with pytest.raises(store.Deposed):
            await write
        status = await pool.fetchval(
            "SELECT status FROM actions WHERE action_id = $1", target.spec.action_id
        )
        assert status == ("queued" if kind == "started" else "running")
    finally:
        await pool.release(conn)
