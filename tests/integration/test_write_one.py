"""One record alone is written by its primary key (``store.write_one``, ``insert_one``) on a
session that plans once (``db.BY_KEY``): the same rows, guards and fence as the batch
statements, and a plan that stays on the primary key when the table grows after it was made."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest

from services.gateway import store as gateway_store
from services.gateway.formulation import Limits, formulate
from services.scheduler import store
from services.scheduler.core.effects import Finish, StartOnNode, verdict
from tangram import ActionSpec, ExecAction, db
from tangram.contract import ErrorKind, UnifiedAction

from ..support import postgres_pool

pytestmark = pytest.mark.slow

# what the two paths must leave the same (not the id, nor updated_at: now())
COLUMNS = "status, attempt, node_id, incarnation, cores, started_at, finished_at, result, \
error_kind, exit_code"


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[asyncpg.Pool]:
    async with postgres_pool(tmp_path / "pg") as p:
        yield p


def action(aid: str, owner_tid: str = "t") -> UnifiedAction:
    spec = ActionSpec(
        action_id=aid, job_id="j", trajectory_id=owner_tid, action=ExecAction(command="true")
    )
    return formulate(spec, now=1.0, limits=Limits())


def start(act: UnifiedAction, attempt: int = 1) -> store.Started:
    act = msgspec.structs.replace(act, attempt=attempt)
    return store.Started(StartOnNode("n0", act, (0, 1), "inc0"), at=2.0)


def finish(act: UnifiedAction, kind: ErrorKind | None = None) -> Finish:
    why = "it failed" if kind else ""
    return Finish(act, verdict(act, kind or ErrorKind.CANCELLED, why, now=3.0))


async def row(pool: asyncpg.Pool, aid: str) -> dict[str, Any]:
    found = await pool.fetchrow(f"SELECT {COLUMNS} FROM actions WHERE action_id = $1", aid)
    assert found is not None
    out = dict(found)
    result = gateway_store.decode_result(out["result"])  # its own id inside: not compared
    out["result"] = None if result is None else msgspec.structs.replace(result, action_id="")
    return out


async def events(pool: asyncpg.Pool, aid: str) -> list[tuple[Any, ...]]:
    rows = await pool.fetch(
        "SELECT attempt, status, node_id, detail, at FROM action_events WHERE action_id = $1"
        " ORDER BY at, status",
        aid,
    )
    return [tuple(r) for r in rows]


async def intake(pool: asyncpg.Pool, *acts: UnifiedAction) -> None:
    async with pool.acquire() as conn:
        await gateway_store.insert_actions(conn, [gateway_store.Owned(a, "") for a in acts])


async def by_key(pool: asyncpg.Pool) -> asyncpg.Connection:
    conn = await pool.acquire()
    for setting in db.BY_KEY:
        await conn.execute(setting)
    return conn


async def test_one_record_leaves_what_the_batch_statement_leaves(pool: asyncpg.Pool) -> None:
    epoch = await store.take_lead(pool)
    batch, one = action("batch"), action("one")
    await intake(pool, batch, one)
    conn = await by_key(pool)
    try:
        steps = [  # a start, a stale start (an older attempt), a finish, a finish again
            lambda a: start(a, 2),
            lambda a: start(a, 1),
            lambda a: finish(a),
            lambda a: finish(a, ErrorKind.INTERNAL),
        ]
        for step in steps:
            await store.write(conn, [step(batch)], time.time(), epoch)
            await store.write_one(conn, step(one), time.time(), epoch)
            assert await row(pool, "one") == await row(pool, "batch")
            assert await events(pool, "one") == await events(pool, "batch")
        assert (await row(pool, "one"))["status"] == "cancelled"  # the first finish held
        assert len(await events(pool, "one")) == 2  # running, cancelled: nothing else
    finally:
        await pool.release(conn)


async def test_one_record_of_a_replaced_scheduler_changes_nothing(pool: asyncpg.Pool) -> None:
    old = await store.take_lead(pool)
    act = action("fenced")
    await intake(pool, act)
    new = await store.take_lead(pool)
    conn = await by_key(pool)
    try:
        with pytest.raises(store.Deposed, match=f"epoch {old} was replaced by epoch {new}"):
            await store.write_one(conn, start(act), time.time(), old)
        with pytest.raises(store.Deposed):
            await store.write_one(conn, finish(act), time.time(), old)
        assert (await row(pool, "fenced"))["status"] == "queued"
        await store.write_one(conn, start(act), time.time(), new)
        assert (await row(pool, "fenced"))["status"] == "running"
    finally:
        await pool.release(conn)


async def test_one_intake_is_new_once_then_a_duplicate_with_what_is_stored(
    pool: asyncpg.Pool,
) -> None:
    claims = gateway_store.Claims()
    act = action("in")
    item = gateway_store.Owned(act, "")
    assert gateway_store.one_row([item], claims)
    conn = await by_key(pool)
    try:
        (first,) = await gateway_store.insert_one(conn, item, claims)
        assert first.new
        assert not first.duplicate
        epoch = await store.take_lead(pool)
        await store.write_one(conn, finish(act), time.time(), epoch)
        (again,) = await gateway_store.insert_one(conn, item, claims)
        assert again.duplicate
        assert again.status == "cancelled"
        assert again.result is not None
        assert again.result.action_id == "in"
    finally:
        await pool.release(conn)


def test_an_owned_action_in_a_trajectory_not_yet_claimed_takes_the_batch_path() -> None:
    claims = gateway_store.Claims()
    owned = gateway_store.Owned(action("o", "t-new"), "alice")
    assert not gateway_store.one_row([owned], claims)  # its claim is made and checked
    assert not gateway_store.one_row([owned, owned], claims)
    claims.learn([owned], {"o": "alice"})
    assert gateway_store.one_row([owned], claims)


# (name, statement, its arguments as SQL literals)
BY_KEY_STATEMENTS = [
    ("started_one", store._STARTED_ONE, "'a9', 1, 'n0', 'i0', '{0}', 1.0, 0"),
    (
        "finished_one",
        store._FINISHED_ONE,
        "'a9', 1, 'succeeded', '\\x00'::bytea, NULL, 0, 1.0, 'n0', 0",
    ),
]


def rows(status: str, prefix: str, n: int) -> str:
    return (
        "INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec, submitted_at)"
        f" SELECT '{prefix}' || i, 'j', 't', 'exec', '{status}', '\\x00', i"
        f" FROM generate_series(1, {n}) i"
    )


async def test_a_plan_made_on_a_small_table_stays_on_the_primary_key_as_it_grows(
    pool: asyncpg.Pool,
) -> None:
    """Planned once for the session, a statement keeps its plan: one made while the table held
    a few rows must not be a scan that the backlog then makes cost milliseconds a write."""
    conn = await by_key(pool)
    try:
        await conn.execute("ALTER TABLE actions SET (autovacuum_enabled = false)")
        await conn.execute(rows("queued", "s", 5))
        await conn.execute("ANALYZE actions")
        plans: dict[str, list[str]] = {}
        for name, sql, args in BY_KEY_STATEMENTS:
            await conn.execute(f"PREPARE {name} AS {sql}")
            plans[name] = [f"EXPLAIN EXECUTE {name}({args})"]
        plain = await pool.acquire()  # a generic plan alone, for contrast: a scan
        try:
            await plain.execute("SET plan_cache_mode = force_generic_plan")
            name, sql, args = BY_KEY_STATEMENTS[0]
            await plain.execute(f"PREPARE {name} AS {sql}")
            plan = "\n".join(r[0] for r in await plain.fetch(f"EXPLAIN EXECUTE {name}({args})"))
            assert "Seq Scan on actions" in plan, plan
        finally:
            await pool.release(plain)
        for grown in (False, True):
            if grown:
                await conn.execute(rows("queued", "a", 20_000))  # unknown to the statistics
            for name, (explain,) in plans.items():
                plan = "\n".join(r[0] for r in await conn.fetch(explain))
                assert "Seq Scan on actions" not in plan, f"{name} (grown={grown}):\n{plan}"
                assert "actions_open" not in plan, f"{name} (grown={grown}):\n{plan}"
                assert "actions_pkey" in plan, f"{name} (grown={grown}):\n{plan}"
    finally:
        await pool.release(conn)
