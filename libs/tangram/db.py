"""Postgres access: the asyncpg pool, idempotent SQL migrations, and group commit.

Postgres is the system of record. Migrations live in ``tangram/migrations/NNNN_name.sql``
and are applied in order, once, under an advisory lock, so every service may call
:func:`migrate` at start. :class:`GroupCommit` turns many concurrent writes into one
transaction without adding latency when the system is idle.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from importlib import resources
from typing import Generic, TypeVar

import asyncpg

from tangram.errors import ServiceDead, Unavailable

log = logging.getLogger(__name__)

_MIGRATION_LOCK = 0x7A4E_6752  # advisory lock id shared by every service

T = TypeVar("T")
R = TypeVar("R")


async def connect(dsn: str, *, min_size: int = 1, max_size: int = 8) -> asyncpg.Pool:
    """Open a pool; raises :class:`Unavailable` when Postgres does not answer."""
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, command_timeout=30
        )
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise Unavailable(f"cannot connect to Postgres: {exc}") from exc
    assert pool is not None
    return pool


def migrations() -> list[tuple[int, str, str]]:
    """(version, name, sql) of every bundled migration, in order."""
    found = []
    for entry in resources.files("tangram.migrations").iterdir():
        if entry.name.endswith(".sql"):
            version = int(entry.name.split("_", 1)[0])
            found.append((version, entry.name, entry.read_text()))
    return sorted(found)


async def migrate(pool: asyncpg.Pool) -> list[int]:
    """Apply the migrations that are not applied yet; return the versions applied now."""
    applied: list[int] = []
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations ("
            " version int PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
        for version, name, sql in migrations():
            if version in done:
                continue
            await conn.execute(sql)
            await conn.execute(
                "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
            )
            applied.append(version)
    if applied:
        log.info("applied migrations %s", applied)
    return applied


class GroupCommit(Generic[T, R]):
    """Batch concurrent writes into one call of ``flush(batch) -> results``.

    The first item flushes at once; items that arrive while a flush runs form the next
    batch (up to ``max_batch``). Each caller awaits its own result. A failing flush fails
    every caller of that batch with the error, and later batches are tried afresh.
    """

    def __init__(
        self, flush: Callable[[Sequence[T]], Awaitable[Sequence[R]]], *, max_batch: int = 512
    ) -> None:
        self._flush = flush
        self._max = max_batch
        self._items: list[tuple[T, asyncio.Future[R]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="group-commit")

    def enqueue(self, item: T) -> asyncio.Future[R]:
        """Queue ``item``; the future resolves when its batch is committed."""
        if self._closed or self._task is None or self._task.done():
            raise ServiceDead("the database writer is not running")
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._items.append((item, fut))
        self._wake.set()
        return fut

    async def submit(self, item: T) -> R:
        """Queue ``item`` and wait until its batch is committed."""
        return await asyncio.shield(self.enqueue(item))

    async def close(self) -> None:
        """Flush what is queued, then stop."""
        self._closed = True
        self._wake.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._items:
                batch, self._items = self._items[: self._max], self._items[self._max :]
                await self._flush_batch(batch)
            if self._closed:
                return

    async def _flush_batch(self, batch: list[tuple[T, asyncio.Future[R]]]) -> None:
        try:
            results = await self._flush([item for item, _ in batch])
        except asyncio.CancelledError:
            for _, fut in batch:
                if not fut.done():
                    fut.set_exception(ServiceDead("the database writer was stopped"))
            raise
        except Exception as exc:
            log.warning("group commit of %d items failed: %s", len(batch), exc)
            error = Unavailable(f"database write failed: {exc}")
            for _, fut in batch:
                if not fut.done() and not fut.cancelled():
                    fut.set_exception(error)
                    fut.exception()  # retrieved here: callers that stopped waiting don't warn
            return
        self.batches += 1
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)


async def retrying(op: Callable[[], Awaitable[R]], *, what: str, max_delay_s: float = 2.0) -> R:
    """Run ``op`` until it succeeds, backing off while Postgres is unreachable."""
    delay = 0.05
    while True:
        try:
            return await op()
        except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                asyncpg.exceptions.CannotConnectNowError) as exc:  # fmt: skip
            log.warning("%s: Postgres unavailable (%s); retrying in %.2fs", what, exc, delay)
            await asyncio.sleep(delay)
            delay = min(max_delay_s, delay * 2)
