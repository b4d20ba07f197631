"""One action's writes alone, as a quiet mesh makes them: the batch statements (``write``,
``insert_actions``) on a session that plans each execution afresh (``db.CUSTOM_PLANS``, as the
writers' batch connections) against the one-record statements (``write_one``, ``insert_one``)
on a ``db.BY_KEY`` session, through the same store functions the services call.

An embedded PostgreSQL (fsync on) with 20,000 open actions besides, one write at a time with
``--gap-ms`` of idle between (the caller waits, as between a quiet mesh's actions); p50 / p99
of the client-measured time per write, per kind: the started record (synchronous_commit off,
as the scheduler writes it), the terminal record, the intake of one action.

    python -m bench.write_cost [--writes 300] [--gap-ms 2]

Writes bench/results/write_cost.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import uvloop

from services.gateway import store as gateway_store
from services.gateway.formulation import Limits, formulate
from services.scheduler import store
from services.scheduler.core.effects import Finish, StartOnNode, verdict
from tangram import ActionSpec, ExecAction, db
from tangram.contract import ErrorKind, UnifiedAction
from tangram.embedded import EmbeddedPostgres

OUT = Path(__file__).parent / "results" / "write_cost.json"
OPEN_ACTIONS = 20_000
ASYNC_COMMIT = "SET synchronous_commit = off"


def action(aid: str) -> UnifiedAction:
    spec = ActionSpec(action_id=aid, job_id="bench", trajectory_id="t", action=ExecAction("true"))
    return formulate(spec, now=time.time(), limits=Limits())


def started(act: UnifiedAction) -> store.Started:
    """Its first attempt, numbered as the core numbers it (a record of attempt 0 is guarded
    out: it would change no row)."""
    return store.Started(StartOnNode("n0", first(act), (0,), "inc0"), at=time.time())


def finished(act: UnifiedAction) -> Finish:
    act = first(act)
    return Finish(act, verdict(act, ErrorKind.CANCELLED, "", now=time.time()))


def first(act: UnifiedAction) -> UnifiedAction:
    return msgspec.structs.replace(act, attempt=act.attempt + 1)


def pcts(took: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(took, n=100, method="inclusive")
    return {"p50_ms": round(1000 * cuts[49], 3), "p99_ms": round(1000 * cuts[98], 3)}


async def session(pool: asyncpg.Pool, *settings: str) -> Any:
    conn = await pool.acquire()
    for setting in settings:
        await conn.execute(setting)
    return conn


Write = Callable[[Any, Any], Awaitable[object]]


async def measure(pool: asyncpg.Pool, n: int, gap_s: float) -> dict[str, Any]:
    """Each kind of write, the two paths taking turns write by write (the machine's drift
    falls on both alike)."""
    epoch = await store.take_lead(pool)
    paths: dict[str, tuple[tuple[str, ...], Write, Write]] = {  # settings, record, intake
        "batch_statement": (
            (db.CUSTOM_PLANS,),
            lambda c, r: store.write(c, [r], time.time(), epoch),
            lambda c, item: gateway_store.insert_actions(c, [item], gateway_store.Claims()),
        ),
        "one_record_by_key": (
            db.BY_KEY,
            lambda c, r: store.write_one(c, r, time.time(), epoch),
            lambda c, item: gateway_store.insert_one(c, item, gateway_store.Claims()),
        ),
    }
    conns = {name: await session(pool, *p[0]) for name, p in paths.items()}
    starts = {name: await session(pool, *p[0], ASYNC_COMMIT) for name, p in paths.items()}
    acts = {name: [action(f"{name}-{i}") for i in range(n)] for name in paths}
    took: dict[str, dict[str, list[float]]] = {name: {} for name in paths}
    kinds: dict[str, Callable[[str, int], Awaitable[object]]] = {
        "intake": lambda p, i: paths[p][2](conns[p], gateway_store.Owned(acts[p][i], "")),
        "started": lambda p, i: paths[p][1](starts[p], started(acts[p][i])),
        "finished": lambda p, i: paths[p][1](conns[p], finished(acts[p][i])),
    }
    try:
        for kind, write in kinds.items():
            for i in range(n):
                for name in paths:
                    await asyncio.sleep(gap_s)
                    t0 = time.perf_counter()
                    await write(name, i)
                    took[name].setdefault(kind, []).append(time.perf_counter() - t0)
    finally:
        for conn in [*conns.values(), *starts.values()]:
            await pool.release(conn)
    await wrote_rows(pool, [a.spec.action_id for name in paths for a in acts[name]])
    return {name: {kind: pcts(xs) for kind, xs in kinds_.items()} for name, kinds_ in took.items()}


async def wrote_rows(pool: asyncpg.Pool, action_ids: list[str]) -> None:
    """Every write measured changed its row: each action was started, then ended."""
    changed = await pool.fetchval(
        "SELECT count(*) FROM actions WHERE action_id = ANY($1::text[])"
        " AND started_at IS NOT NULL AND status = 'cancelled'",
        action_ids,
    )
    if changed != len(action_ids):
        raise RuntimeError(f"{len(action_ids) - changed} writes changed no row")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tangram-bench-writes-") as tmp:
        pg = await asyncio.to_thread(EmbeddedPostgres(Path(tmp), fsync=True).start)
        try:
            pool = await db.connect(pg.dsn, max_size=4)
            try:
                await db.migrate(pool)
                await pool.execute(
                    "INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec,"
                    " submitted_at) SELECT 'open-' || i, 'j', 't', 'exec', 'queued', '\\x00', i"
                    f" FROM generate_series(1, {OPEN_ACTIONS}) i"
                )
                await pool.execute("ANALYZE actions")
                points = await measure(pool, args.writes, args.gap_ms / 1000)
            finally:
                await pool.close()
        finally:
            await asyncio.to_thread(pg.stop)
    return {
        "what": "one action's writes alone through the store functions, p50/p99 ms per write: "
        "the batch statements on a custom-plan session against the one-record statements on "
        "a by-key session (db.BY_KEY)",
        "open_actions": OPEN_ACTIONS,
        "writes": args.writes,
        "gap_ms": args.gap_ms,
        "postgres_fsync": True,
        **points,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writes", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    result = uvloop.run(run(parser.parse_args()))
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
