"""The gateway's SQL: durable intake of actions (one statement per batch) and result lookup."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import asyncpg

from tangram.contract import ActionResult, UnifiedAction, codec, encode, kind_of

# No 'queued' event row: the action row's submitted_at is that transition.
_INSERT = """
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                         $6::float8[])
        AS t(action_id, job_id, trajectory_id, kind, spec, submitted_at)
), ins AS (
    INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec, submitted_at)
    SELECT action_id, job_id, trajectory_id, kind, 'queued', spec, submitted_at FROM input
    ON CONFLICT (action_id) DO NOTHING
    RETURNING action_id
)
SELECT action_id FROM ins
"""

_EXISTING = "SELECT action_id, status, result FROM actions WHERE action_id = ANY($1::text[])"


@dataclass(frozen=True, slots=True)
class Intake:
    """Outcome of one submit: new, or a duplicate with the stored status (and result)."""

    action_id: str
    duplicate: bool
    status: str = "queued"
    result: ActionResult | None = None


def _columns(actions: Sequence[UnifiedAction]) -> list[list[object]]:
    return [
        [a.spec.action_id for a in actions],
        [a.spec.job_id for a in actions],
        [a.spec.trajectory_id for a in actions],
        [kind_of(a.spec.action) for a in actions],
        [encode(a) for a in actions],
        [a.submitted_at for a in actions],
    ]


def decode_result(raw: bytes | None) -> ActionResult | None:
    return None if raw is None else codec.decode(raw, ActionResult)


def _first_copies(actions: Sequence[UnifiedAction], inserted: set[str]) -> list[bool]:
    """For each action: True when it is the copy that was inserted now."""
    seen: set[str] = set()
    new = []
    for a in actions:
        aid = a.spec.action_id
        new.append(aid in inserted and aid not in seen)
        seen.add(aid)
    return new


async def insert_actions(
    conn: asyncpg.Connection, actions: Sequence[UnifiedAction]
) -> list[Intake]:
    """Make a batch durable in one statement; duplicates (by action_id) are not re-inserted."""
    rows = await conn.fetch(_INSERT, *_columns(actions))
    new = _first_copies(actions, {r["action_id"] for r in rows})
    dup_ids = [a.spec.action_id for a, n in zip(actions, new, strict=True) if not n]
    existing = {}
    if dup_ids:
        existing = {r["action_id"]: r for r in await conn.fetch(_EXISTING, dup_ids)}
    out = []
    for a, is_new in zip(actions, new, strict=True):
        aid = a.spec.action_id
        row = existing.get(aid)
        if is_new or row is None:
            out.append(Intake(aid, duplicate=not is_new))
        else:
            out.append(Intake(aid, True, row["status"], decode_result(row["result"])))
    return out


async def fetch_result(
    pool: asyncpg.Pool, action_id: str
) -> tuple[str, ActionResult | None] | None:
    """(status, result) of an action, or None when it does not exist."""
    row = await pool.fetchrow("SELECT status, result FROM actions WHERE action_id = $1", action_id)
    if row is None:
        return None
    return row["status"], decode_result(row["result"])


@dataclass(frozen=True, slots=True)
class Existing:
    """A stored action's status, and its result once it has one."""

    status: str
    result: ActionResult | None


async def fetch_existing(pool: asyncpg.Pool, action_ids: Sequence[str]) -> dict[str, Existing]:
    """Those of ``action_ids`` that are stored, in one statement (admission's duplicates)."""
    rows = await pool.fetch(_EXISTING, list(action_ids))
    return {r["action_id"]: Existing(r["status"], decode_result(r["result"])) for r in rows}
