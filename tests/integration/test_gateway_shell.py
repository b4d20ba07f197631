"""The gateway's shell on the in-memory bus against a real Postgres: no nats-server, no
scheduler process (a fake one answers on the scheduler's endpoint), seconds instead of a mesh."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest
from nats.aio.msg import Msg

from services.gateway.config import GatewayConfig
from services.gateway.service import Gateway
from tangram import db, subjects
from tangram.bus import decode_reply
from tangram.contract import (
    Accepted,
    Ack,
    ActionSpec,
    Cancel,
    CancelCmd,
    Done,
    Enqueue,
    ExecAction,
    GetResult,
    Pending,
    SchedulerRequest,
    StatusQuery,
    Submit,
)
from tangram.embedded import EmbeddedPostgres
from tangram.errors import InvalidRequest, NotFound, RemoteError
from tangram.membus import MemoryBroker, MemoryBus
from tangram.subjects import SchedulerAnswer

from ..support import eventually, postgres_pool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[asyncpg.Pool]:
    async with postgres_pool(tmp_path_factory.mktemp("pg")) as p:
        yield p


class FakeScheduler:
    """Serves the scheduler's action endpoint: records what it is told, acks it."""

    def __init__(self, bus: MemoryBus) -> None:
        self.heard: asyncio.Queue[SchedulerRequest] = asyncio.Queue()
        bus.serve(subjects.SCHED_ACTIONS, self.on_action)

    async def on_action(self, req: SchedulerRequest, msg: Msg) -> SchedulerAnswer:
        assert not isinstance(req, StatusQuery)
        self.heard.put_nowait(req)
        return Ack()


@pytest.fixture
async def mesh(pool: asyncpg.Pool) -> AsyncIterator[tuple[MemoryBus, FakeScheduler]]:
    """A gateway and a fake scheduler on one memory broker; yields a client's bus."""
    broker = MemoryBroker()
    scheduler_bus = broker.connect("scheduler")
    scheduler = FakeScheduler(scheduler_bus)
    await scheduler_bus.start()
    gateway = Gateway(GatewayConfig(), broker.connect("gateway"), pool)
    async with gateway:
        yield broker.connect("client"), scheduler


def spec(action_id: str) -> ActionSpec:
    return ActionSpec(
        action_id=action_id, job_id="j", trajectory_id="t", action=ExecAction(command="true")
    )


async def test_a_submit_is_durable_then_enqueued_once(mesh, uid: str):
    client, scheduler = mesh
    first = await client.request(subjects.GATEWAY, Submit(spec=spec(f"{uid}-a")))
    assert first == Accepted(action_id=f"{uid}-a")
    enqueued = await asyncio.wait_for(scheduler.heard.get(), 5)
    assert isinstance(enqueued, Enqueue)
    assert enqueued.action.spec.action_id == f"{uid}-a"
    again = await client.request(subjects.GATEWAY, Submit(spec=spec(f"{uid}-a")))
    assert isinstance(again, Accepted)
    assert again.duplicate
    assert scheduler.heard.empty()  # a duplicate is not enqueued again
    pending = await client.request(subjects.GATEWAY, GetResult(action_id=f"{uid}-a"))
    assert pending == Pending(action_id=f"{uid}-a", status="queued")


async def test_queries_and_commands(mesh, uid: str):
    client, scheduler = mesh
    with pytest.raises(NotFound, match=f"{uid}-nope"):
        await client.request(subjects.GATEWAY, GetResult(action_id=f"{uid}-nope"))
    assert await client.request(subjects.GATEWAY, Cancel(action_id=f"{uid}-x")) == Done()
    assert await asyncio.wait_for(scheduler.heard.get(), 5) == CancelCmd(action_id=f"{uid}-x")
    bad = ActionSpec(
        action_id=f"{uid}-b", job_id="j", trajectory_id="t", action=ExecAction(command=" ")
    )
    with pytest.raises(InvalidRequest, match="empty command"):
        await client.request(subjects.GATEWAY, Submit(spec=bad))


async def test_deep_nesting_is_refused_and_the_gateway_keeps_serving(mesh, uid: str):
    client, _ = mesh
    deep = b"\x83\xa4type\xaaget_result\xa9action_id\xa1x\xa2zz" + b"\x91" * 1000 + b"\x01"
    ep = subjects.GATEWAY
    with pytest.raises(InvalidRequest, match="nested deeper"):
        decode_reply(ep.subject, await client._ask(ep.subject, deep, None, 5), ep.reply)
    with pytest.raises(NotFound):
        await client.request(subjects.GATEWAY, GetResult(action_id=f"{uid}-after"))


async def test_a_missing_scheduler_is_a_retryable_error(pool: asyncpg.Pool, uid: str):
    broker = MemoryBroker()
    async with Gateway(GatewayConfig(), broker.connect("gateway"), pool):
        with pytest.raises(RemoteError) as err:
            await broker.connect("client").request(
                subjects.GATEWAY, Cancel(action_id=f"{uid}-x"), timeout=10
            )
    assert (err.value.code, err.value.retryable) == ("unavailable", True)


async def test_a_query_while_postgres_is_down_is_a_retryable_error(tmp_path, uid: str):
    """Not ``internal`` (final to a client): ``unavailable``, which the client retries until
    Postgres is back (a chaos run lost results this way while Postgres restarted)."""
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False).start)
    try:
        pool = await db.connect(pg.dsn, max_size=5)
        await db.migrate(pool)
        broker = MemoryBroker()
        client = broker.connect("client")

        async def refused() -> RemoteError | None:
            try:
                await client.request(subjects.GATEWAY, GetResult(action_id=f"{uid}-x"), timeout=10)
            except NotFound:  # a backend may answer once more before it sees its postmaster gone
                return None
            except RemoteError as exc:
                return exc
            return None

        try:
            async with Gateway(GatewayConfig(), broker.connect("gateway"), pool):
                await asyncio.to_thread(pg.kill)
                err = await eventually(refused, what="the gateway to meet the outage")
        finally:
            pool.terminate()
    finally:
        await asyncio.to_thread(pg.stop)
    assert (err.code, err.retryable) == ("unavailable", True)
    assert "database is unavailable" in err.message
