"""The writers' statements find their rows by primary key whatever the plan: generic or custom,
and with statistics that predate a backlog (the overload cliff: a write that reaches its rows
through the index of open actions scans the whole backlog each time).

The adversarial case is built on purpose: statistics taken when every action was finished,
then a backlog of open actions the planner has not been told about (autovacuum off)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from services.gateway import store as gateway_store
from services.scheduler import store

from ..support import postgres_pool

pytestmark = pytest.mark.slow

# (name, statement, its arguments as SQL literals: one row each)
STATEMENTS = [
    (
        "started",
        store._STARTED,
        "'{a9}', '{1}', '{n0}', '{i0}', ARRAY['{0}'], '{1.0}', 0",
    ),
    (
        "finished",
        store._FINISHED,
        "'{a9}', '{1}', '{succeeded}', ARRAY['\\x00'::bytea], '{NULL}', '{0}', '{1.0}', '{n0}', 0",
    ),
    (
        "intake",
        gateway_store._INSERT,
        "'{b1}', '{j}', '{t}', '{exec}', ARRAY['\\x00'::bytea], '{1.0}', '{alice}'",
    ),
    (
        "intake_anon",  # no owner in the batch (a mesh without auth)
        gateway_store._INSERT_ANON,
        "'{b2}', '{j}', '{t}', '{exec}', ARRAY['\\x00'::bytea], '{1.0}'",
    ),
]


@pytest.fixture
async def conn(tmp_path: Path) -> AsyncIterator[asyncpg.Connection]:
    async with postgres_pool(tmp_path / "pg", max_size=1) as pool, pool.acquire() as c:
        yield c


def rows(status: str, prefix: str, n: int) -> str:
    return (
        "INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec, submitted_at)"
        f" SELECT '{prefix}' || i, 'j', 't', 'exec', '{status}', '\\x00', i"
        f" FROM generate_series(1, {n}) i"
    )


@pytest.mark.parametrize("mode", ["force_generic_plan", "force_custom_plan"])
async def test_writes_reach_their_rows_by_primary_key_with_a_backlog_the_stats_missed(
    conn: asyncpg.Connection, mode: str
) -> None:
    await conn.execute("ALTER TABLE actions SET (autovacuum_enabled = false)")
    await conn.execute(rows("succeeded", "d", 50_000))
    await conn.execute("ANALYZE actions")
    await conn.execute(rows("queued", "a", 20_000))  # the backlog, unknown to the statistics
    await conn.execute(f"SET plan_cache_mode = {mode}")
    for name, sql, args in STATEMENTS:
        await conn.execute(f"PREPARE {name} AS {sql}")
        plan = "\n".join(r[0] for r in await conn.fetch(f"EXPLAIN EXECUTE {name}({args})"))
        assert "actions_open" not in plan, f"{name} ({mode}) goes through open actions:\n{plan}"
        assert "Seq Scan on actions" not in plan, f"{name} ({mode}) scans actions:\n{plan}"
        # an insert looks nothing up but its conflict, by primary key
        if not name.startswith("intake"):
            assert "actions_pkey" in plan, f"{name} ({mode}):\n{plan}"
