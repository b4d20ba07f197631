"""Server-side counters of a running mesh, read before and after each load point: Postgres
commits, rows and WAL (pg_stat_database, pg_stat_wal) and NATS messages (nats-server /varz).

Postgres backends publish their statistics when idle, but a backend that published less than a
second before holds what it did since for up to ``PGSTAT_IDLE_INTERVAL`` (10 s, PG 15+) or
until its next statement: the "after" reading is taken once the mesh has been idle for
``SETTLE_S`` (longer than that), or a point would lose its last second of commits to the next
point. What the idle mesh does meanwhile (heartbeats, sweeps: ``idle_per_s`` in the
throughput JSON, ~3 commits and ~8 NATS messages a second) counts with the point. The bench's
own reading is one read-only transaction: each "before" reading adds one commit, subtracted
here.
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from decimal import Decimal
from typing import Any

import asyncpg
import psutil

SETTLE_S = 11.0
OWN_COMMITS_PER_WINDOW = 1  # the "before" reading's own transaction, seen by the "after" one

_DB = (
    "SELECT xact_commit, xact_rollback, tup_inserted, tup_updated, tup_deleted"
    " FROM pg_stat_database WHERE datname = current_database()"
)
_WAL = "SELECT * FROM pg_stat_wal"
# PG 18 moved WAL writes and fsyncs out of pg_stat_wal into pg_stat_io (NULL before 18)
_WAL_IO = (
    "SELECT sum(writes) AS io_writes, sum(fsyncs) AS io_fsyncs FROM pg_stat_io WHERE object = 'wal'"
)
_BACKENDS = (
    "SELECT pid, client_port FROM pg_stat_activity"
    " WHERE backend_type = 'client backend' AND client_port IS NOT NULL"
)


class PgStats:
    """One connection to the mesh's Postgres for statistics (not part of the mesh's load)."""

    def __init__(self, conn: asyncpg.Connection, has_wal: bool, has_io: bool) -> None:
        self.conn = conn
        self.has_wal = has_wal
        self.has_io = has_io

    @classmethod
    async def connect(cls, dsn: str) -> PgStats:
        conn = await asyncpg.connect(dsn)
        has_wal = await conn.fetchval("SELECT to_regclass('pg_catalog.pg_stat_wal') IS NOT NULL")
        has_io = await conn.fetchval("SELECT to_regclass('pg_catalog.pg_stat_io') IS NOT NULL")
        return cls(conn, bool(has_wal), bool(has_io))

    async def version(self) -> str:
        return str(await self.conn.fetchval("SHOW server_version"))

    def queries(self) -> list[tuple[str, str]]:
        """(key prefix, one-row statement) of every counter this server has."""
        return (
            [("", _DB)]
            + ([("wal.", _WAL)] if self.has_wal else [])
            + ([("wal.", _WAL_IO)] if self.has_io else [])
        )

    async def read(self) -> tuple[dict[str, float], dict[int, int]]:
        """Counters so far, and the client backends (pid -> client TCP port), in one
        transaction so each reading adds exactly one commit of ours."""
        row: dict[str, Any] = {}
        async with self.conn.transaction(readonly=True):
            for prefix, sql in self.queries():
                row |= {prefix + k: v for k, v in (await self.conn.fetchrow(sql) or {}).items()}
            backends = await self.conn.fetch(_BACKENDS)
        stats = {k: float(v) for k, v in row.items() if isinstance(v, int | float | Decimal)}
        return stats, {r["pid"]: r["client_port"] for r in backends}

    async def close(self) -> None:
        await self.conn.close()


def port_owners(pids: dict[str, int]) -> dict[int, str]:
    """Local TCP port -> the name of the process (of ``pids``) that holds it."""
    owners: dict[int, str] = {}
    for name, pid in pids.items():
        try:
            conns = psutil.Process(pid).net_connections(kind="tcp")
        except psutil.Error:
            continue
        owners.update({c.laddr.port: name for c in conns if c.laddr})
    return owners


def pg_deltas(before: dict[str, float], after: dict[str, float], actions: int) -> dict[str, Any]:
    """Commits, rows and WAL per action between two readings."""

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    def per(x: float) -> float | None:
        return round(x / actions, 3) if actions else None

    wal = {
        k.removeprefix("wal."): per(d(k)) for k in after if k.startswith("wal.") and "time" not in k
    }
    return {
        "commits_per_action": per(d("xact_commit") - OWN_COMMITS_PER_WINDOW),
        "rollbacks_per_action": per(d("xact_rollback")),
        "rows_per_action": {
            "inserted": per(d("tup_inserted")),
            "updated": per(d("tup_updated")),
            "deleted": per(d("tup_deleted")),
        },
        "wal_per_action": wal or None,
    }


def _get_varz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
        data: dict[str, Any] = json.load(r)
    return data


async def nats_read(port: int) -> dict[str, float]:
    """The server's message and byte counters (published in, delivered out)."""
    v = await asyncio.to_thread(_get_varz, port)
    return {k: float(v[k]) for k in ("in_msgs", "out_msgs", "in_bytes", "out_bytes")}


def nats_deltas(before: dict[str, float], after: dict[str, float], actions: int) -> dict[str, Any]:
    def per(k: str) -> float | None:
        return round((after[k] - before[k]) / actions, 3) if actions else None

    return {
        "nats_msgs_per_action": per("in_msgs"),
        "nats_per_action": {k: per(k) for k in after},
    }
