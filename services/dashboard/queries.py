"""What the pages show, read from Postgres (actions, their events and spans) and asked of the
scheduler over NATS (queues, nodes, services, quotas)."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any, Literal

import asyncpg
import msgspec

from services.dashboard import act
from services.dashboard.waterfall import ActionTimes, Span, Waterfall, waterfall
from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import (
    ActionResult,
    Resources,
    ResourcesQuery,
    SchedulerStatus,
    StatusQuery,
    codec,
)
from tangram.errors import TangramError

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]
Text = Annotated[str, msgspec.Meta(max_length=128)]
MAX_SPANS_SHOWN = 500
MAX_ACT_ROWS = 5000


class ActionQuery(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The search of the actions page (its query parameters; a typo fails loudly)."""

    id: Text = ""
    job: Text = ""
    trajectory: Text = ""
    status: Status | Literal[""] = ""
    limit: Annotated[int, msgspec.Meta(ge=1, le=500)] = 50


class ActQuery(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    minutes: Annotated[float, msgspec.Meta(gt=0, le=7 * 24 * 60)] = 15.0
    buckets: Annotated[int, msgspec.Meta(ge=1, le=200)] = 30


class ActionRow(msgspec.Struct, kw_only=True):
    action_id: str
    job_id: str
    trajectory_id: str
    kind: str
    status: str
    attempt: int
    node_id: str | None
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    error_kind: str | None
    exit_code: int | None


class Event(msgspec.Struct, kw_only=True):
    attempt: int
    status: str
    node_id: str | None
    detail: str
    at: float


class ActionDetail(msgspec.Struct, kw_only=True):
    row: ActionRow
    events: list[Event]
    result: ActionResult | None
    trace_id: str
    waterfall: Waterfall


class _Traced(msgspec.Struct):
    """The one field of a stored UnifiedAction the dashboard needs."""

    traceparent: str = ""


_ROW = (
    "action_id, job_id, trajectory_id, kind, status, attempt, node_id, submitted_at,"
    " started_at, finished_at, error_kind, exit_code"
)


async def search(pool: asyncpg.Pool, q: ActionQuery) -> list[ActionRow]:
    """Newest first; ``id`` matches exactly, else as a prefix."""
    where, args = _filters(q)
    sql = f"SELECT {_ROW} FROM actions{where} ORDER BY submitted_at DESC LIMIT ${len(args) + 1}"
    rows = await pool.fetch(sql, *args, q.limit)
    if not rows and q.id:
        like = msgspec.structs.replace(q, id="")
        where, args = _filters(like)
        cond = " AND" if where else " WHERE"
        sql = (
            f"SELECT {_ROW} FROM actions{where}{cond} action_id LIKE ${len(args) + 1}"
            f" ORDER BY submitted_at DESC LIMIT ${len(args) + 2}"
        )
        prefix = q.id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        rows = await pool.fetch(sql, *args, prefix, q.limit)
    return [ActionRow(**dict(r)) for r in rows]


def _filters(q: ActionQuery) -> tuple[str, list[Any]]:
    conds: list[str] = []
    args: list[Any] = []
    for column, value in (
        ("action_id", q.id),
        ("job_id", q.job),
        ("trajectory_id", q.trajectory),
        ("status", q.status),
    ):
        if value:
            args.append(value)
            conds.append(f"{column} = ${len(args)}")
    return (" WHERE " + " AND ".join(conds) if conds else ""), args


async def detail(pool: asyncpg.Pool, action_id: str) -> ActionDetail | None:
    """An action with its transitions, result and waterfall (None: no such action)."""
    rec = await pool.fetchrow(
        f"SELECT {_ROW}, spec, result FROM actions WHERE action_id = $1", action_id
    )
    if rec is None:
        return None
    events = await pool.fetch(
        "SELECT attempt, status, node_id, detail, at FROM action_events"
        " WHERE action_id = $1 ORDER BY at",
        action_id,
    )
    row = ActionRow(**{k: rec[k] for k in ActionRow.__struct_fields__})
    result = codec.decode(rec["result"], ActionResult) if rec["result"] else None
    trace_id = trace_of(rec["spec"])
    spans = await spans_of(pool, trace_id, action_id)
    evs = [Event(**dict(e)) for e in events]
    times = action_times(row, evs, result)
    return ActionDetail(
        row=row,
        events=evs,
        result=result,
        trace_id=trace_id,
        waterfall=waterfall(times, spans, action_id),
    )


def trace_of(spec: bytes) -> str:
    """The trace id in a stored action's ``traceparent`` ('' when it has none)."""
    try:
        parent = msgspec.msgpack.decode(spec, type=_Traced).traceparent
    except msgspec.DecodeError:
        return ""
    parts = parent.split("-")
    return parts[1] if len(parts) == 4 else ""


async def spans_of(pool: asyncpg.Pool, trace_id: str, action_id: str) -> list[Span]:
    rows = await pool.fetch(
        "SELECT trace_id, span_id, parent_id, action_id, name, service, start_at AS start,"
        " end_at AS end, error FROM spans WHERE trace_id = $1 OR action_id = $2"
        " ORDER BY start_at LIMIT $3",
        trace_id or "-",
        action_id,
        MAX_SPANS_SHOWN,
    )
    return [Span(**dict(r)) for r in rows]


def action_times(row: ActionRow, events: list[Event], result: ActionResult | None) -> ActionTimes:
    """The waterfall's marks: the row's times, the last grant, the result's timings."""
    granted = [e.at for e in events if e.status == "running" and e.attempt == row.attempt]
    t = result.timings if result is not None else None
    result_at = None
    if t is not None:
        result_at = t.submitted_at + t.exec_s + t.overhead_s
    return ActionTimes(
        submitted_at=row.submitted_at,
        granted_at=granted[-1] if granted else None,
        started_at=t.started_at if t is not None else row.started_at,
        finished_at=t.finished_at if t is not None else row.finished_at,
        restore_s=t.restore_s if t is not None else 0.0,
        result_at=result_at,
    )


SUBMITTED_BEFORE_S = 6 * 3600.0


class _Timed(msgspec.Struct):
    timings: Any = None


async def act_series(
    pool: asyncpg.Pool, minutes: float, n: int, now: float | None = None
) -> list[act.Bucket]:
    """Mean ACT parts per bucket over the last ``minutes`` (the newest MAX_ACT_ROWS actions)."""
    until = time.time() if now is None else now
    since = until - minutes * 60
    # through the submit-time index: an action finishing in the window was submitted at most
    # SUBMITTED_BEFORE_S before it (longer ones are left out of the plot)
    rows = await pool.fetch(
        "SELECT finished_at, result FROM actions WHERE submitted_at >= $1 AND finished_at >= $2"
        " AND result IS NOT NULL ORDER BY submitted_at DESC LIMIT $3",
        since - SUBMITTED_BEFORE_S,
        since,
        MAX_ACT_ROWS,
    )
    finished = await asyncio.to_thread(_finished, [(r["finished_at"], r["result"]) for r in rows])
    return act.buckets(finished, since, until, n)


def _finished(rows: list[tuple[float, bytes]]) -> list[act.Finished]:
    out = []
    for at, blob in rows:
        t = codec.decode(blob, ActionResult).timings
        if t is not None:
            out.append(act.Finished(at, *act.split(t.queue_s, t.exec_s, t.overhead_s)))
    return out


class Live(msgspec.Struct, kw_only=True):
    """The mesh now; ``errors`` names what could not be asked."""

    status: SchedulerStatus | None = None
    resources: Resources | None = None
    running_infer: dict[str, int] = {}
    errors: list[str] = []


async def live(pool: asyncpg.Pool, bus: BaseBus) -> Live:
    out = Live()
    try:
        st = await bus.request(subjects.SCHED_STATUS, StatusQuery(), timeout=2.0)
        out.status = st if isinstance(st, SchedulerStatus) else None
        res = await bus.request(subjects.SCHED_STATUS, ResourcesQuery(), timeout=2.0)
        out.resources = res if isinstance(res, Resources) else None
    except TangramError as exc:
        out.errors.append(f"scheduler: {exc}")
    for r in await pool.fetch(
        "SELECT node_id, count(*) AS n FROM actions WHERE status = 'running' AND kind = 'infer'"
        " GROUP BY node_id"
    ):
        out.running_infer[str(r["node_id"])] = int(r["n"])
    return out
