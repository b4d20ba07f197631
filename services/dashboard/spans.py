"""Writes shipped spans to Postgres with COPY, and keeps the table within its retention.

Spans arrive fire-and-forget and are written in bulk every ``write_every_s``; while Postgres
is away they wait (up to ``max_pending``, then new ones are dropped and counted): they are
trace detail, never the system of record.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

import asyncpg

from services.dashboard.config import DashboardConfig
from tangram import db
from tangram.contract.spans import SpanRecord

log = logging.getLogger(__name__)

COLUMNS = (
    "trace_id",
    "span_id",
    "parent_id",
    "action_id",
    "name",
    "service",
    "start_at",
    "end_at",
    "error",
)
Row = tuple[str, str, str, str, str, str, float, float, bool]


def row(s: SpanRecord) -> Row:
    return (
        s.trace_id,
        s.span_id,
        s.parent_id,
        s.action_id,
        s.name,
        s.service,
        s.start,
        s.end,
        s.error,
    )


class SpanWriter:
    """Buffers spans and writes them; prunes by age and row count."""

    def __init__(
        self, cfg: DashboardConfig, pool: asyncpg.Pool, clock: Callable[[], float]
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.clock = clock
        self._pending: list[Row] = []
        self.written = 0
        self.dropped = 0
        self._last_prune = clock()

    def add(self, spans: Sequence[SpanRecord]) -> None:
        room = self.cfg.max_pending - len(self._pending)
        if room < len(spans):
            self.dropped += len(spans) - max(room, 0)
            spans = spans[: max(room, 0)]
        self._pending.extend(row(s) for s in spans)

    async def run(self) -> None:
        """Write every ``write_every_s`` and prune every ``prune_every_s``, forever."""
        while True:
            await asyncio.sleep(self.cfg.write_every_s)
            await self.flush()
            if self.clock() - self._last_prune >= self.cfg.prune_every_s:
                await self.prune()

    async def flush(self) -> None:
        """COPY what is pending; on a transient error it stays pending for the next try."""
        if not self._pending:
            return
        rows, self._pending = self._pending, []
        try:
            async with self.pool.acquire() as conn:
                await conn.copy_records_to_table("spans", records=rows, columns=COLUMNS)
        except Exception as exc:
            if not db.transient(exc):
                log.error("dropped %d spans that Postgres refused: %s", len(rows), exc)
                self.dropped += len(rows)
                return
            log.info("spans wait for Postgres: %s", exc)
            self._pending[:0] = rows[: self.cfg.max_pending]
            return
        self.written += len(rows)

    async def prune(self) -> int:
        """Delete spans past the retention age, then the oldest beyond ``max_spans`` rows."""
        self._last_prune = self.clock()
        try:
            async with self.pool.acquire() as conn:
                old = await conn.execute(
                    "DELETE FROM spans WHERE start_at < $1", self.clock() - self.cfg.retention_s
                )
                over = await conn.execute(
                    "DELETE FROM spans WHERE start_at < (SELECT start_at FROM spans"
                    " ORDER BY start_at DESC OFFSET $1 LIMIT 1)",
                    self.cfg.max_spans - 1,  # the newest max_spans stay
                )
        except Exception as exc:
            if not db.transient(exc):
                raise
            log.info("span pruning waits for Postgres: %s", exc)
            return 0
        return _count(old) + _count(over)


def _count(status: str) -> int:
    """Rows named by a command status such as ``DELETE 12``."""
    return int(status.rsplit(" ", 1)[-1]) if status else 0
