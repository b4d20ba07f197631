"""The durable group-commit writer: a failed batch is retried until it commits, its callers
resolve only then, and an error that retrying does not cure stops the writer loudly."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import asyncpg
import pytest

from tangram import db
from tangram.errors import ServiceDead, Unavailable

FAST = db.Backoff(first_s=0.001, max_s=0.01, permanent_tries=3)


class Flaky:
    """A flush that fails with the given errors first, then commits (and remembers what)."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0
        self.committed: list[int] = []

    async def __call__(self, batch: Sequence[int]) -> list[int]:
        self.calls += 1
        await asyncio.sleep(0)
        if self.errors:
            raise self.errors.pop(0)
        self.committed += batch
        return [x * 10 for x in batch]


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.exceptions.AdminShutdownError(
            "terminating connection due to administrator command"
        ),
        asyncpg.exceptions.QueryCanceledError("canceling statement due to user request"),
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed"),
        asyncpg.exceptions.SerializationError("could not serialize access"),
        ConnectionRefusedError(111, "Connection refused"),
    ],
)
async def test_a_failed_batch_is_retried_and_resolves_only_once_committed(error: Exception):
    flush = Flaky(error, error)
    writer: db.GroupCommit[int, int] = db.GroupCommit(flush, retry=FAST)
    writer.start()
    results = await asyncio.gather(*(writer.submit(i) for i in range(3)))
    assert results == [0, 10, 20]
    assert flush.committed == [0, 1, 2]
    assert writer.retries == 2
    await writer.close()
    await writer.join()


async def test_batches_stay_in_order_while_one_is_retried():
    flush = Flaky(asyncpg.exceptions.AdminShutdownError("shutting down"))
    writer: db.GroupCommit[int, int] = db.GroupCommit(flush, max_batch=2, retry=FAST)
    writer.start()
    await asyncio.gather(*(writer.submit(i) for i in range(6)))
    assert flush.committed == list(range(6))
    await writer.close()


async def test_an_incurable_error_stops_the_writer_and_fails_its_callers():
    bad = asyncpg.exceptions.UniqueViolationError("duplicate key")
    flush = Flaky(bad, bad, bad, bad)
    writer: db.GroupCommit[int, int] = db.GroupCommit(flush, retry=FAST)
    writer.start()
    with pytest.raises(db.WriterFailed):
        await writer.submit(1)
    assert flush.calls == FAST.permanent_tries
    with pytest.raises(db.WriterFailed):
        await writer.join()  # its owner learns why it stopped
    with pytest.raises(ServiceDead):
        writer.enqueue(2)


async def test_close_gives_up_after_its_bound_and_fails_what_is_left():
    flush = Flaky(*[OSError("down")] * 1000)
    writer: db.GroupCommit[int, int] = db.GroupCommit(flush, retry=FAST)
    writer.start()
    fut = writer.enqueue(1)
    await writer.close(timeout_s=0.05)
    with pytest.raises(ServiceDead):
        await fut
    assert flush.committed == []


async def test_without_retry_a_failed_batch_fails_fast_and_the_next_one_is_tried():
    flush = Flaky(asyncpg.exceptions.AdminShutdownError("shutting down"))
    writer: db.GroupCommit[int, int] = db.GroupCommit(flush)
    writer.start()
    with pytest.raises(Unavailable):
        await writer.submit(1)
    assert await writer.submit(2) == 20
    await writer.close()


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (asyncpg.exceptions.AdminShutdownError("x"), True),
        (asyncpg.exceptions.CannotConnectNowError("x"), True),
        (asyncpg.exceptions.DeadlockDetectedError("x"), True),
        (asyncpg.exceptions.TooManyConnectionsError("x"), True),
        (asyncpg.exceptions.InterfaceError("x"), True),
        # a connection lost mid-operation (seen in CI: it killed the scheduler's sweep loop)
        (asyncpg.exceptions.InternalClientError("cannot switch to state 11"), True),
        (TimeoutError(), True),
        (asyncpg.exceptions.DatabaseDroppedError("x"), False),
        (asyncpg.exceptions.UniqueViolationError("x"), False),
        (asyncpg.exceptions.DataError("x"), False),
        (ValueError("x"), False),
    ],
)
def test_transient_errors(error: Exception, transient: bool):
    assert db.transient(error) is transient


async def test_an_outage_does_not_use_up_the_tries_an_incurable_error_gets():
    """Transient failures (an outage) do not count: after many of them, a non-transient error
    is still tried ``permanent_tries`` times, and one that then clears commits."""
    down = ConnectionRefusedError(111, "Connection refused")
    odd = asyncpg.exceptions.UniqueViolationError("duplicate key")
    flush = Flaky(*[down] * 6, *[odd] * (FAST.permanent_tries - 1))
    writer: db.GroupCommit[int, int] = db.GroupCommit(flush, retry=FAST)
    writer.start()
    assert await writer.submit(1) == 10
    assert flush.committed == [1]
    await writer.close()
    await writer.join()


async def test_a_pool_too_small_for_the_held_connections_is_refused() -> None:
    """A service whose writers hold connections refuses to start on a pool they would drain
    (the rest of it would wait for a connection for ever)."""
    pool = asyncpg.create_pool("postgresql://x@127.0.0.1:1/x", min_size=1, max_size=4)  # unopened
    with pytest.raises(ValueError, match="the scheduler needs a pool of 6 connections"):
        db.check_pool(pool, 6, "the scheduler")
    db.check_pool(pool, 4, "the gateway")
