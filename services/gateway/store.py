"""The gateway's SQL: durable intake of actions (one statement per batch) and result lookup."""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

import asyncpg

from tangram.contract import ActionResult, UnifiedAction, codec, encode, kind_of

# No 'queued' event row: the action row's submitted_at is that transition. A client's first
# action in a trajectory claims it (an owner of '' claims none and may use any: the operator's
# door, or a mesh without auth); an action in a trajectory another client claimed is not
# inserted, and comes back refused (``allowed`` false, ``n`` its place in the batch: a refused
# copy and an inserted one may share an action id). The inserted rows come back with the owner
# that was stored, so a batch holding one action id twice knows whose copy won.
_INSERT = """
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                         $6::float8[], $7::text[]) WITH ORDINALITY
        AS t(action_id, job_id, trajectory_id, kind, spec, submitted_at, owner, n)
), claimed AS (
    INSERT INTO trajectory_owners (trajectory_id, owner)
    SELECT DISTINCT ON (trajectory_id) trajectory_id, owner FROM input
    WHERE owner <> '' AND trajectory_id <> ''
    ON CONFLICT (trajectory_id) DO NOTHING
    RETURNING trajectory_id, owner
), owners AS (
    SELECT trajectory_id, owner FROM claimed
    UNION ALL
    SELECT o.trajectory_id, o.owner FROM trajectory_owners o
    WHERE o.trajectory_id IN (SELECT trajectory_id FROM input WHERE owner <> '')
), checked AS (
    SELECT i.*, (i.owner = '' OR i.trajectory_id = '' OR EXISTS (
        SELECT 1 FROM owners o WHERE o.trajectory_id = i.trajectory_id AND o.owner = i.owner
    )) AS allowed FROM input i
), ins AS (
    INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec, submitted_at,
                         owner)
    SELECT action_id, job_id, trajectory_id, kind, 'queued', spec, submitted_at, owner
    FROM checked WHERE allowed
    ON CONFLICT (action_id) DO NOTHING
    RETURNING action_id, owner
)
SELECT action_id, owner, true AS allowed, NULL::bigint AS n FROM ins
UNION ALL
SELECT action_id, owner, false, n FROM checked WHERE NOT allowed
"""

# A batch with no owner at all (a mesh without auth, the operator's door) claims nothing and
# checks nothing: the intake statement as it was before owners, at its cost.
_INSERT_ANON = """
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
SELECT action_id, '' AS owner, true AS allowed, NULL::bigint AS n FROM ins
"""

# A batch whose every owned action is in a trajectory this gateway saw claimed by that same
# owner (``Claims``): nothing to claim or check, since a claim is never moved or dropped
# (trajectory_owners only grows). The plain insert, owners stored: 0.45 ms a one-row batch
# against 0.73 ms with the claim (p50 of 300 in a one-off probe on the embedded Postgres).
_INSERT_CLAIMED = """
WITH input AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[],
                         $6::float8[], $7::text[])
        AS t(action_id, job_id, trajectory_id, kind, spec, submitted_at, owner)
), ins AS (
    INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec, submitted_at,
                         owner)
    SELECT action_id, job_id, trajectory_id, kind, 'queued', spec, submitted_at, owner
    FROM input
    ON CONFLICT (action_id) DO NOTHING
    RETURNING action_id, owner
)
SELECT action_id, owner, true AS allowed, NULL::bigint AS n FROM ins
"""

# One action alone (the batch of a quiet gateway) needing no claim: the plain insert of one
# row, run on a connection that plans it once (``db.BY_KEY``): 0.36-0.43 against 0.43-0.53 ms
# through ``insert_actions`` planned afresh (p50, fsync on, two runs of bench.write_cost).
_INSERT_ONE = """
INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec, submitted_at, owner)
VALUES ($1, $2, $3, $4, 'queued', $5, $6, $7)
ON CONFLICT (action_id) DO NOTHING
RETURNING action_id, owner, true AS allowed, NULL::bigint AS n
"""

_EXISTING = "SELECT action_id, status, result, owner FROM actions WHERE action_id = ANY($1::text[])"


@dataclass(frozen=True, slots=True)
class Intake:
    """Outcome of one submit: new, or a duplicate with the stored status (and result) and
    owner, or refused (``foreign``: its trajectory is another client's)."""

    action_id: str
    duplicate: bool
    status: str = "queued"
    result: ActionResult | None = None
    owner: str = ""
    foreign: bool = False

    @property
    def new(self) -> bool:
        """Made durable now: to hand to the scheduler."""
        return not self.duplicate and not self.foreign


@dataclass(frozen=True, slots=True)
class Owned:
    """An action to make durable, and the client credential that submitted it ("": none)."""

    action: UnifiedAction
    owner: str


class Claims:
    """Trajectory claims this gateway saw committed (trajectory -> owner), the newest
    ``limit`` of them: a batch they cover needs no claim statement (``_INSERT_CLAIMED``)."""

    def __init__(self, limit: int = 100_000) -> None:
        self.limit = limit
        self._owners: dict[str, str] = {}
        self.hits = 0  # batches written without the claim statement

    def covers(self, items: Sequence[Owned]) -> bool:
        """Whether every owned action with a trajectory is in one claimed by its owner."""
        return all(
            not i.owner
            or not i.action.spec.trajectory_id
            or self._owners.get(i.action.spec.trajectory_id) == i.owner
            for i in items
        )

    def learn(
        self, items: Sequence[Owned], inserted: dict[str, str], refused: Set[int] = frozenset()
    ) -> None:
        """An owned action allowed and inserted in a trajectory proves its owner holds that
        trajectory. Not a refused one (``refused``: places in ``items``), even when a copy of
        its action id, the same owner's, was inserted in another trajectory."""
        for place, i in enumerate(items):
            tid = i.action.spec.trajectory_id
            mine = inserted.get(i.action.spec.action_id) == i.owner
            if i.owner and tid and mine and place not in refused:
                self._owners.pop(tid, None)  # to the newest end
                self._owners[tid] = i.owner
        while len(self._owners) > self.limit:
            del self._owners[next(iter(self._owners))]


def _columns(items: Sequence[Owned]) -> list[list[object]]:
    actions = [i.action for i in items]
    return [
        [a.spec.action_id for a in actions],
        [a.spec.job_id for a in actions],
        [a.spec.trajectory_id for a in actions],
        [kind_of(a.spec.action) for a in actions],
        [encode(a) for a in actions],
        [a.submitted_at for a in actions],
        [i.owner for i in items],
    ]


def decode_result(raw: bytes | None) -> ActionResult | None:
    return None if raw is None else codec.decode(raw, ActionResult)


@dataclass(frozen=True, slots=True)
class _Outcome:
    """What one intake statement did: the owner stored for each action id inserted, and the
    places in the batch of the actions refused (their trajectory is another client's)."""

    inserted: dict[str, str]
    refused: set[int]


def one_row(items: Sequence[Owned], claims: Claims) -> bool:
    """Whether ``items`` is one action that claims nothing (``insert_one`` writes it)."""
    return len(items) == 1 and claims.covers(items)


async def _statement(conn: asyncpg.Connection, items: Sequence[Owned], claims: Claims) -> _Outcome:
    columns = _columns(items)
    if not any(i.owner for i in items):
        rows = await conn.fetch(_INSERT_ANON, *columns[:-1])
    elif claims.covers(items):
        claims.hits += 1
        rows = await conn.fetch(_INSERT_CLAIMED, *columns)
    else:
        rows = await conn.fetch(_INSERT, *columns)
    inserted = {r["action_id"]: r["owner"] for r in rows if r["allowed"]}
    refused = {r["n"] - 1 for r in rows if not r["allowed"]}
    claims.learn(items, inserted, refused)
    return _Outcome(inserted, refused)


async def _intake(conn: asyncpg.Connection, items: Sequence[Owned], claims: Claims) -> _Outcome:
    """The intake statement, and once more for the actions it refused, if any: a statement
    reads the claims committed before it began, so a first action of the same client in the
    same trajectory, committed by another batch (another gateway) while it waited on that
    claim, is refused by it and found by the next. One round trip unless some are refused."""
    first = await _statement(conn, items, claims)
    if not first.refused:
        return first
    places = sorted(first.refused)
    again = await _statement(conn, [items[p] for p in places], claims)
    inserted = first.inserted | again.inserted
    return _Outcome(inserted, {places[p] for p in again.refused})


def _first_copies(items: Sequence[Owned], done: _Outcome) -> list[bool]:
    """For each item: True when it is the copy inserted now (the first not refused of those
    with the id and owner that were stored; which copy the database kept is its answer)."""
    seen: set[str] = set()
    new = []
    for place, item in enumerate(items):
        aid = item.action.spec.action_id
        first = place not in done.refused and done.inserted.get(aid) == item.owner
        new.append(first and aid not in seen)
        if first:
            seen.add(aid)
    return new


async def insert_actions(
    conn: asyncpg.Connection, items: Sequence[Owned], claims: Claims | None = None
) -> list[Intake]:
    """Make a batch durable in one statement; duplicates (by action_id) are not re-inserted,
    actions in another client's trajectory are refused. ``claims``: the caller's (a gateway
    keeps one for its life), else none known."""
    done = await _intake(conn, items, Claims() if claims is None else claims)
    return await _answers(conn, items, done)


async def _answers(
    conn: asyncpg.Connection, items: Sequence[Owned], done: _Outcome
) -> list[Intake]:
    """Each item's intake, given what the statement inserted and refused: duplicates read
    back with their stored status and result."""
    new = _first_copies(items, done)
    dup_ids = [
        i.action.spec.action_id
        for place, (i, n) in enumerate(zip(items, new, strict=True))
        if not n and place not in done.refused and i.action.spec.action_id not in done.inserted
    ]
    existing = {r["action_id"]: r for r in await conn.fetch(_EXISTING, dup_ids)} if dup_ids else {}
    out = []
    for place, (item, is_new) in enumerate(zip(items, new, strict=True)):
        aid = item.action.spec.action_id
        row = existing.get(aid)
        if place in done.refused:
            out.append(Intake(aid, duplicate=False, foreign=True))
        elif is_new or row is None:  # new, or a copy of one inserted now: whose it is
            out.append(Intake(aid, duplicate=not is_new, owner=done.inserted.get(aid, "")))
        else:
            result = decode_result(row["result"])
            out.append(Intake(aid, True, row["status"], result, row["owner"]))
    return out


async def insert_one(conn: asyncpg.Connection, item: Owned, claims: Claims) -> list[Intake]:
    """``insert_actions`` of one action that claims nothing (``one_row``), on a connection set
    up with ``db.BY_KEY``: new, or a duplicate with what is stored."""
    claims.hits += bool(item.owner)
    row = await conn.fetchrow(_INSERT_ONE, *(c[0] for c in _columns([item])))
    done = _Outcome({} if row is None else {row["action_id"]: row["owner"]}, set())
    claims.learn([item], done.inserted)  # its trajectory's claim moves to the newest end
    return await _answers(conn, [item], done)


async def fetch_result(pool: asyncpg.Pool, action_id: str) -> Existing | None:
    """An action's status, result and owner, or None when it does not exist."""
    row = await pool.fetchrow(
        "SELECT status, result, owner FROM actions WHERE action_id = $1", action_id
    )
    if row is None:
        return None
    return Existing(row["status"], decode_result(row["result"]), row["owner"])


async def trajectory_owner(pool: asyncpg.Pool, trajectory_id: str) -> str | None:
    """The client that claimed ``trajectory_id`` (None: no client has)."""
    found: str | None = await pool.fetchval(
        "SELECT owner FROM trajectory_owners WHERE trajectory_id = $1", trajectory_id
    )
    return found


@dataclass(frozen=True, slots=True)
class Existing:
    """A stored action's status, and its result once it has one."""

    status: str
    result: ActionResult | None
    owner: str = ""


async def fetch_existing(pool: asyncpg.Pool, action_ids: Sequence[str]) -> dict[str, Existing]:
    """Those of ``action_ids`` that are stored, in one statement (admission's duplicates)."""
    rows = await pool.fetch(_EXISTING, list(action_ids))
    return {
        r["action_id"]: Existing(r["status"], decode_result(r["result"]), r["owner"]) for r in rows
    }
