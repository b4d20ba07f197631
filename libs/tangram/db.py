"""Postgres access: the asyncpg pool, idempotent SQL migrations, and group commit.

Postgres is the system of record. Migrations live in ``tangram/migrations/NNNN_name.sql``
and are applied in order, once, under an advisory lock, so every service may call
:func:`migrate` at start (with nothing pending it only reads, so a role without DDL rights
may call it too: see :mod:`tangram.pg_roles`). :class:`GroupCommit` turns many concurrent
writes into one transaction without adding latency when the system is idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import resources
from typing import Any, Generic, TypeVar

import asyncpg
from asyncpg.exceptions import InternalClientError

from tangram.errors import ServiceDead, Unavailable

log = logging.getLogger(__name__)

_MIGRATION_LOCK = 0x7A4E_6752  # advisory lock id shared by every service

T = TypeVar("T")
R = TypeVar("R")


async def connect(
    dsn: str, *, min_size: int = 1, max_size: int = 8, name: str = ""
) -> asyncpg.Pool:
    """Open a pool (its sessions named ``name`` in ``pg_stat_activity``); raises
    :class:`Unavailable` when Postgres does not answer."""
    settings = {"application_name": name} if name else None
    try:
        pool = await asyncpg.create_pool(
            dsn, min_size=min_size, max_size=max_size, command_timeout=30, server_settings=settings
        )
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        raise Unavailable(f"cannot connect to Postgres: {exc}") from exc
    assert pool is not None
    return pool


async def open_pool(
    stack: contextlib.AsyncExitStack, dsn: str, *, max_size: int = 4, name: str = ""
) -> asyncpg.Pool:
    """A migrated pool that ``stack`` closes when it unwinds."""
    pool = await connect(dsn, max_size=max_size, name=name)
    stack.push_async_callback(pool.close)
    await migrate(pool)
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
    async with pool.acquire() as conn:
        return await migrate_on(conn)


_SCHEMA_MIGRATIONS = (
    "CREATE TABLE IF NOT EXISTS schema_migrations ("
    " version int PRIMARY KEY, name text NOT NULL,"
    " applied_at timestamptz NOT NULL DEFAULT now())"
)


async def migrate_on(conn: Any) -> list[int]:
    """:func:`migrate` on one connection (as whatever role it has set). With nothing pending it
    only reads: a role without DDL rights (a service's on a secure mesh) passes through."""
    if not await _pending(conn):
        return []
    applied: list[int] = []
    try:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", _MIGRATION_LOCK)
            # IF NOT EXISTS, not to_regclass: under the advisory lock (no relation lock) the
            # catalog lookup may not yet see a table another service just created
            await conn.execute(_SCHEMA_MIGRATIONS)
            done = await _applied(conn)  # again, under the lock: another may have migrated
            for version, name, sql in migrations():
                if version in done:
                    continue
                await conn.execute(sql)
                await conn.execute(
                    "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
                )
                applied.append(version)
    except asyncpg.InsufficientPrivilegeError as exc:
        raise ServiceDead(
            f"migrations are pending and this Postgres role may not apply them ({exc}); "
            "the schema's owner applies them (`tangram up` does at start)"
        ) from exc
    if applied:
        log.info("applied migrations %s", applied)
    return applied


async def _has_table(conn: Any) -> bool:
    # Read-only, unlike CREATE TABLE IF NOT EXISTS (which checks the right to create first).
    return await conn.fetchval("SELECT to_regclass('schema_migrations')") is not None


async def _applied(conn: Any) -> set[int]:
    return {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}


async def _pending(conn: Any) -> bool:
    """Whether a bundled migration is not applied yet (read without any lock)."""
    if not await _has_table(conn):
        return True
    done = await _applied(conn)
    return any(version not in done for version, _, _ in migrations())


# SQLSTATE classes and codes after which the same write can succeed: connection loss (08),
# serialization failure and deadlock (40001, 40P01), resources (53), operator intervention
# such as a cancelled query or a shutting-down server (57, not 57P04 "database dropped"),
# system and I/O errors (58), a lock not available now (55P03).
_TRANSIENT_CLASSES = ("08", "53", "57", "58")
_TRANSIENT_CODES = ("40001", "40P01", "55P03")


def transient(exc: BaseException) -> bool:
    """Whether retrying the same statement later can succeed (Postgres down, restarting, busy)."""
    # InternalClientError: asyncpg's protocol state broken by a connection lost mid-operation
    # ("cannot switch to state ..."); the pool replaces the connection.
    if isinstance(exc, OSError | TimeoutError | asyncpg.InterfaceError | InternalClientError):
        return True
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", "") or "")
        if state == "57P04":
            return False
        return state.startswith(_TRANSIENT_CLASSES) or state in _TRANSIENT_CODES
    return False


@dataclass(frozen=True, slots=True)
class Backoff:
    """How a durable writer retries a failed batch: capped exponential delays, forever while the
    error is transient, ``permanent_tries`` times in all when it is not."""

    first_s: float = 0.05
    max_s: float = 2.0
    permanent_tries: int = 5


class WriterFailed(ServiceDead):
    """A durable writer met an error that retrying does not cure; it stopped."""


class GroupCommit(Generic[T, R]):
    """Batch concurrent writes into one call of ``flush(batch) -> results``.

    The first item flushes at once; items that arrive while a flush runs form the next
    batch (up to ``max_batch``). Each caller awaits its own result.

    Without ``retry`` a failing flush fails every caller of that batch with
    :class:`Unavailable`, and later batches are tried afresh (the callers have promised
    nothing yet and can retry). With ``retry`` the writer is *durable*: a failed batch is
    retried, in order, until it commits, and its callers are resolved only then; an error
    that retrying does not cure stops the writer (:class:`WriterFailed`), which its owner
    must treat as fatal (see :meth:`join`). Flushes must therefore be idempotent.
    """

    def __init__(
        self,
        flush: Callable[[Sequence[T]], Awaitable[Sequence[R]]],
        *,
        max_batch: int = 512,
        retry: Backoff | None = None,
        name: str = "group-commit",
    ) -> None:
        self._flush = flush
        self._max = max_batch
        self._retry = retry
        self._name = name
        self._items: list[tuple[T, asyncio.Future[R]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.batches = 0
        self.retries = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name)

    @property
    def running(self) -> bool:
        return not self._closed and self._task is not None and not self._task.done()

    def enqueue(self, item: T) -> asyncio.Future[R]:
        """Queue ``item``; the future resolves when its batch is committed."""
        if not self.running:
            raise ServiceDead(f"the database writer {self._name} is not running")
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._items.append((item, fut))
        self._wake.set()
        return fut

    async def submit(self, item: T) -> R:
        """Queue ``item`` and wait until its batch is committed."""
        return await asyncio.shield(self.enqueue(item))

    async def join(self) -> None:
        """Wait until the writer stops; re-raise what stopped it, if anything did."""
        if self._task is not None:
            await asyncio.wait([self._task])
            if not self._task.cancelled():
                self._task.result()

    async def close(self, timeout_s: float | None = None) -> None:
        """Flush what is queued, then stop; after ``timeout_s`` stop anyway (the callers left
        waiting get :class:`ServiceDead`)."""
        self._closed = True
        self._wake.set()
        if self._task is None:
            return
        _done, pending = await asyncio.wait([self._task], timeout=timeout_s)
        if pending:
            log.warning("%s: stopping with %d writes not committed", self._name, len(self._items))
            self._task.cancel()
            await asyncio.wait([self._task])
        _fail(self._items, ServiceDead("the database writer was stopped"))
        self._items = []

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
            results = await self._commit([item for item, _ in batch])
        except asyncio.CancelledError:
            _fail(batch, ServiceDead("the database writer was stopped"))
            raise
        except WriterFailed as exc:
            _fail(batch + self._items, exc)
            self._items = []
            raise
        except Exception as exc:
            log.warning("group commit of %d items failed: %s", len(batch), exc)
            _fail(batch, Unavailable(f"database write failed: {exc}"))
            return
        self.batches += 1
        for (_, fut), result in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(result)

    async def _commit(self, items: list[T]) -> Sequence[R]:
        """One flush; a durable writer retries it until it commits."""
        if self._retry is None:
            return await self._flush(items)
        try:
            return await retrying(
                partial(self._flush, items),
                backoff=self._retry,
                what=f"{self._name}: write of {len(items)} items",
                on_retry=self._count_retry,
            )
        except Exception as exc:  # not transient, and it kept failing
            raise WriterFailed(
                f"{self._name}: write failed {self._retry.permanent_tries} times: {exc}"
            ) from exc

    def _count_retry(self) -> None:
        self.retries += 1


def _fail(batch: Sequence[tuple[object, asyncio.Future[Any]]], error: Exception) -> None:
    for _, fut in batch:
        if not fut.done():
            fut.set_exception(error)
            fut.exception()  # retrieved here: callers that stopped waiting don't warn


# Retry only while Postgres is unreachable or restarting; any other error at once.
UNTIL_UP = Backoff(permanent_tries=1)


async def retrying(
    op: Callable[[], Awaitable[R]],
    *,
    what: str,
    backoff: Backoff = UNTIL_UP,
    on_retry: Callable[[], None] | None = None,
) -> R:
    """Run ``op`` until it succeeds, with capped exponential backoff: forever while the error
    is transient (Postgres unreachable, restarting, busy), ``backoff.permanent_tries`` times in
    all when it is not (then that error is raised)."""
    delay, failures = backoff.first_s, 0
    while True:
        try:
            return await op()
        except Exception as exc:
            if not transient(exc):  # only these count: an outage may last any time
                failures += 1
                if failures >= backoff.permanent_tries:
                    raise
            log.warning("%s failed (%s); retrying in %.2fs", what, exc, delay)
            if on_retry is not None:
                on_retry()
        await asyncio.sleep(delay)
        delay = min(backoff.max_s, delay * 2)


def check_pool(pool: asyncpg.Pool, need: int, who: str) -> None:
    """Refuse to start ``who`` on a pool smaller than ``need``: the connections its writers
    hold (``Held``) would leave the rest of it waiting for a connection for ever."""
    if pool.get_max_size() < need:
        raise ValueError(f"{who} needs a pool of {need} connections at least")


class Held:
    """One pooled connection kept by one writer for its whole life.

    A writer that acquires per batch pays a pool reset (a round trip and a Postgres statement)
    every time; a held connection pays nothing but the write. ``setup`` statements (session
    settings such as ``synchronous_commit``) run once on every connection taken. A connection
    that failed in any way is given back to the pool (which resets or replaces it) and the next
    use takes another one, so an outage or a restart of Postgres is survived like with the pool.
    """

    def __init__(self, pool: asyncpg.Pool, *setup: str) -> None:
        self._pool = pool
        self._setup = setup
        self._conn: Any = None  # asyncpg's pool proxy

    async def run(self, op: Callable[[Any], Awaitable[R]]) -> R:
        """``op(connection)``; on any failure the connection is given back, then re-raised."""
        conn = self._conn if self._conn is not None else await self._take()
        try:
            return await op(conn)
        except BaseException:
            await self.release()
            raise

    async def _take(self) -> Any:
        conn = await self._pool.acquire()
        try:
            for statement in self._setup:
                await conn.execute(statement)
        except BaseException:
            await self._pool.release(conn)
            raise
        self._conn = conn
        return conn

    async def release(self) -> None:
        """Give the connection back (at close, or after a failure)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await self._pool.release(conn, timeout=5)


# Writers know their batch is small; a generic plan (asyncpg prepares and reuses statements)
# does not. Alone, a statement's generic plan is the cheaper (no planning: 0.18 against 0.3 ms
# of Postgres CPU a write), but through the mesh at load the scheduler's Postgres CPU per
# action was 2.0-2.5 ms with generic plans against 1.15-1.36 ms with custom ones (six and five
# runs of bench.throughput at 1600/s): custom plans it is. The overload cliff (a write going
# through the index of open actions, 3.3-10 ms at 20k open rows) is avoided by the statements'
# own form, whatever the plan (see services/scheduler/store.py and
# tests/integration/test_write_plans.py).
CUSTOM_PLANS = "SET plan_cache_mode = force_custom_plan"
# A session for statements that find their rows by primary key alone: each planned once for
# the session (no planning per execution), and never as a scan, whatever the table's size
# when the plan was made (a scan planned on a small table would stay while the table grows).
# Plans the pooled connection cached before (under other settings) are dropped: Postgres does
# not plan again when a setting changes.
BY_KEY = (
    "SET plan_cache_mode = force_generic_plan",
    "SET enable_seqscan = off",
    "DISCARD PLANS",
)
