"""The scheduler's SQL: transitions (one transaction per batch, attempt-guarded), environment
records, the epoch, and the rebuild of its books after a restart.

Every write is fenced by the scheduler's epoch: its statement locks the one row of
``scheduler_leader`` (FOR KEY SHARE) where the epoch is this scheduler's, and changes nothing
when it is not. A scheduler taking over updates that row under FOR UPDATE, which waits for the
writes in flight and makes every later write of the one it replaced see the new epoch (a row
lock re-reads the newest version under READ COMMITTED). So a replaced scheduler that is still
alive cannot change the books after the new one read them; it finds out on its next write
(:class:`Deposed`) and stops."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from services.scheduler.core.books import EnvPlacement
from services.scheduler.core.effects import EnvChanged, Finish, StartOnNode
from tangram.contract import UnifiedAction, codec, encode

# An open action is one not terminal, said so, not as status IN ('queued', 'running'): that
# would let the planner look the rows up through the partial index of open actions, which it
# does when its statistics predate a backlog (measured: 4.7 ms a single-row write at 20k open
# actions against 0.2 ms by primary key). Said so, the only index is the primary key.
_TERMINAL = "'succeeded', 'failed', 'cancelled'"
_LEAD = "lead AS (SELECT 1 FROM scheduler_leader WHERE id = 1 AND epoch = $%d FOR KEY SHARE)"

_STARTED = f"""
WITH {_LEAD % 7}, t AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::text[], $4::text[], $5::text[],
                         $6::float8[]) AS t(action_id, attempt, node_id, incarnation, cores, at)
), up AS (
    UPDATE actions a SET status = 'running', attempt = t.attempt, node_id = t.node_id,
        incarnation = t.incarnation, cores = t.cores::int[], started_at = t.at,
        updated_at = now()
    FROM t, lead WHERE a.action_id = t.action_id AND a.status NOT IN ({_TERMINAL})
        AND a.attempt < t.attempt
    RETURNING a.action_id
)
INSERT INTO action_events (action_id, attempt, status, node_id, at)
SELECT t.action_id, t.attempt, 'running', t.node_id, t.at FROM t JOIN up USING (action_id)
ON CONFLICT DO NOTHING
"""

_FINISHED = f"""
WITH {_LEAD % 9}, t AS (
    SELECT * FROM unnest($1::text[], $2::int[], $3::text[], $4::bytea[], $5::text[],
                         $6::int[], $7::float8[], $8::text[])
        AS t(action_id, attempt, status, result, error_kind, exit_code, at, node_id)
), up AS (
    UPDATE actions a SET status = t.status, result = t.result, error_kind = t.error_kind,
        exit_code = t.exit_code, finished_at = t.at, attempt = t.attempt, updated_at = now()
    FROM t, lead WHERE a.action_id = t.action_id AND a.status NOT IN ({_TERMINAL})
    RETURNING a.action_id
)
INSERT INTO action_events (action_id, attempt, status, node_id, detail, at)
SELECT t.action_id, t.attempt, t.status, t.node_id, coalesce(t.error_kind, ''), t.at
FROM t JOIN up USING (action_id)
ON CONFLICT DO NOTHING
"""

# One record alone (the batch of a quiet mesh): the same writes for one action, found by its
# primary key, with no arrays to unnest. Run on a connection that plans it once for the session
# (``db.BY_KEY``): a started write 0.15-0.18 ms against 0.34-0.42 ms for the batch statement
# planned afresh each time, a terminal one 0.53 against 0.80 ms (p50, 20k open actions, two
# runs of ``python -m bench.write_cost``).
_STARTED_ONE = f"""
WITH {_LEAD % 7}, up AS (
    UPDATE actions a SET status = 'running', attempt = $2, node_id = $3, incarnation = $4,
        cores = $5::text::int[], started_at = $6, updated_at = now()
    FROM lead WHERE a.action_id = $1 AND a.status NOT IN ({_TERMINAL}) AND a.attempt < $2
    RETURNING a.action_id
)
INSERT INTO action_events (action_id, attempt, status, node_id, at)
SELECT action_id, $2, 'running', $3, $6 FROM up
ON CONFLICT DO NOTHING
"""

_FINISHED_ONE = f"""
WITH {_LEAD % 9}, up AS (
    UPDATE actions a SET status = $3, result = $4, error_kind = $5, exit_code = $6,
        finished_at = $7, attempt = $2, updated_at = now()
    FROM lead WHERE a.action_id = $1 AND a.status NOT IN ({_TERMINAL})
    RETURNING a.action_id
)
INSERT INTO action_events (action_id, attempt, status, node_id, detail, at)
SELECT action_id, $2, $3, $8, coalesce($5, ''), $7 FROM up
ON CONFLICT DO NOTHING
"""

_ENVS = f"""
WITH {_LEAD % 9}
INSERT INTO envs (trajectory_id, job_id, node_id, incarnation, memory_mb, status, reason,
                  created_at)
SELECT t.* FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::int[], $6::text[],
                       $7::text[], $8::float8[]) AS t, lead
ON CONFLICT (trajectory_id) DO UPDATE SET job_id = excluded.job_id,
    node_id = excluded.node_id, incarnation = excluded.incarnation,
    memory_mb = excluded.memory_mb, status = excluded.status, reason = excluded.reason,
    updated_at = now()
"""


@dataclass(frozen=True, slots=True)
class Started:
    effect: StartOnNode
    at: float


Record = Started | Finish | EnvChanged


def _started_columns(rows: Sequence[Started]) -> list[list[object]]:
    return [
        [r.effect.action.spec.action_id for r in rows],
        [r.effect.action.attempt for r in rows],
        [r.effect.node_id for r in rows],
        [r.effect.incarnation for r in rows],
        ["{" + ",".join(map(str, r.effect.units)) + "}" for r in rows],  # cores or GPUs
        [r.at for r in rows],
    ]


def _finished_columns(rows: Sequence[Finish]) -> list[list[object]]:
    res = [f.result for f in rows]
    return [
        [r.action_id for r in res],
        [r.attempt for r in res],
        [r.status for r in res],
        [encode(r) for r in res],
        [r.error.kind.value if r.error else None for r in res],
        [r.exit_code for r in res],
        [r.timings.finished_at if r.timings else None for r in res],
        [r.allocation.node_id if r.allocation else None for r in res],
    ]


def _env_columns(rows: Sequence[EnvChanged], now: float) -> list[list[object]]:
    last = {r.trajectory_id: r for r in rows}.values()  # in-batch order: the last change wins
    return [
        [r.trajectory_id for r in last],
        [r.job_id for r in last],
        [r.node_id for r in last],
        [r.incarnation for r in last],
        [r.memory_mb for r in last],
        [r.status for r in last],
        [r.reason for r in last],
        [now for _ in last],
    ]


class Deposed(Exception):
    """Another scheduler took over (a newer epoch leads): this one must stop writing."""


async def write(
    conn: asyncpg.Connection, records: Sequence[Record], now: float, epoch: int
) -> list[None]:
    """Apply a batch of records atomically, starts before finishes: one statement (one
    transaction, no BEGIN/COMMIT round trips) unless the batch mixes kinds. Raises
    :class:`Deposed`, having changed nothing, when ``epoch`` no longer leads."""
    started = [r for r in records if isinstance(r, Started)]
    finished = [r for r in records if isinstance(r, Finish)]
    envs = [r for r in records if isinstance(r, EnvChanged)]
    statements: list[tuple[str, list[object], int]] = []
    if envs:
        columns = _env_columns(envs, now)
        statements.append((_ENVS, [*columns, epoch], len(columns[0])))
    if started:
        statements.append((_STARTED, [*_started_columns(started), epoch], len(started)))
    if finished:
        statements.append((_FINISHED, [*_finished_columns(finished), epoch], len(finished)))
    if len(statements) == 1:
        sql, args, rows = statements[0]
        short = _count(await conn.execute(sql, *args)) < rows
    else:
        async with conn.transaction():
            short = False
            for sql, args, rows in statements:
                short = _count(await conn.execute(sql, *args)) < rows or short
    if short:  # rows the guards skipped (already terminal, an older attempt) or a lost lead
        await check_lead(conn, epoch)
    return [None] * len(records)


def alone(records: Sequence[Record]) -> Started | Finish | None:
    """The record of a batch that is one start or one finish alone (``write_one`` writes it)."""
    one = records[0] if len(records) == 1 else None
    return one if isinstance(one, Started | Finish) else None


async def write_one(
    conn: asyncpg.Connection, record: Started | Finish, now: float, epoch: int
) -> list[None]:
    """``write`` of one start or finish by its primary key (see ``_STARTED_ONE``): the same
    guards and the same rows; on a connection set up with ``db.BY_KEY``."""
    if isinstance(record, Started):
        sql, columns = _STARTED_ONE, _started_columns([record])
    else:
        sql, columns = _FINISHED_ONE, _finished_columns([record])
    if _count(await conn.execute(sql, *(c[0] for c in columns), epoch)) < 1:
        await check_lead(conn, epoch)
    return [None]


def _count(status: str) -> int:
    """The row count of a command status such as ``INSERT 0 3``."""
    return int(status.rsplit(" ", 1)[-1])


async def check_lead(conn: asyncpg.Connection, epoch: int) -> None:
    """Raise :class:`Deposed` when ``epoch`` is not the leading one."""
    leading = int(await conn.fetchval("SELECT epoch FROM scheduler_leader WHERE id = 1"))
    if leading != epoch:
        raise Deposed(f"scheduler epoch {epoch} was replaced by epoch {leading}")


SESSIONS = "tangram-scheduler"  # the prefix of every scheduler's Postgres session names

_FENCE = """
SELECT count(pg_terminate_backend(pid, 5000)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE $1 || ' %'
  AND application_name <> $2
"""


async def fence(pool: asyncpg.Pool, own_name: str) -> int:
    """End the Postgres sessions of every other scheduler: a write a killed scheduler left
    waiting is cut off (rolled back) before this scheduler reads its books, so it cannot
    commit later over what the new one decides. (A deposed scheduler that is still alive
    is fenced by the epoch instead: see :func:`take_lead`.)"""
    return int(await pool.fetchval(_FENCE, SESSIONS, own_name))


async def take_lead(pool: asyncpg.Pool) -> int:
    """A new epoch that leads from now on. Waits for the writes in flight of the scheduler it
    replaces (they hold the row); every later write of that one changes nothing. Taken by the
    holder of the lead lock (``leadership``): the lock says who may lead, the epoch fences."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT epoch FROM scheduler_leader WHERE id = 1 FOR UPDATE")
        return int(
            await conn.fetchval(
                "UPDATE scheduler_leader SET epoch = nextval('scheduler_epoch') WHERE id = 1"
                " RETURNING epoch"
            )
        )


@dataclass(frozen=True, slots=True)
class OpenAction:
    action: UnifiedAction
    status: str
    node_id: str | None
    incarnation: str | None
    cores: tuple[int, ...]


def _open(row: asyncpg.Record) -> OpenAction:
    action = codec.decode(row["spec"], UnifiedAction)
    import msgspec

    action = msgspec.structs.replace(action, attempt=row["attempt"])
    return OpenAction(
        action, row["status"], row["node_id"], row["incarnation"], tuple(row["cores"] or ())
    )


async def load_open(pool: asyncpg.Pool, *, older_than: float | None = None) -> list[OpenAction]:
    """Actions not yet terminal, FCFS; ``older_than`` limits to queued ones submitted before."""
    if older_than is None:
        rows = await pool.fetch(
            "SELECT spec, status, attempt, node_id, incarnation, cores FROM actions"
            " WHERE status IN ('queued', 'running') ORDER BY submitted_at"
        )
    else:
        rows = await pool.fetch(
            "SELECT spec, status, attempt, node_id, incarnation, cores FROM actions"
            " WHERE status = 'queued' AND submitted_at < $1 ORDER BY submitted_at LIMIT 5000",
            older_than,
        )
    return [_open(r) for r in rows]


async def load_envs(pool: asyncpg.Pool) -> tuple[list[EnvPlacement], dict[str, str]]:
    """Active environments, and why the recently gone ones are gone."""
    rows = await pool.fetch(
        "SELECT trajectory_id, job_id, node_id, incarnation, memory_mb, status, reason FROM envs"
        " WHERE status <> 'closed'"
    )
    active = [
        EnvPlacement(
            r["trajectory_id"], r["job_id"], r["node_id"], r["incarnation"], r["memory_mb"]
        )
        for r in rows
        if r["status"] == "active"
    ]
    gone = {r["trajectory_id"]: r["reason"] for r in rows if r["status"] != "active"}
    return active, gone
