"""Admission control end to end: the gateway refuses submits beyond its backlog bound with
``busy`` and a retry-after, still answers what is already durable, shrugs off garbled pressure
reports; the client backs off and its submit is accepted once the backlog drains; nothing
accepted is lost."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from tangram import subjects
from tangram.bus import Bus
from tangram.client import Client, SyncClient
from tangram.contract import (
    Accepted,
    ActionResult,
    ErrorReply,
    GatewayRequest,
    GetResult,
    Pending,
    Pressure,
    Submit,
    SubmitMany,
    Submitted,
    codec,
)
from tangram.errors import Busy
from tangram.launcher import Mesh

from ..support import FakeGateway, eventually, exec_spec, running_mesh

FLOOR = 4  # the gateway's bound here: 4 accepted-but-unfinished actions (no rate can raise it)
ADMISSION_ENV = {
    "TANGRAM_GATEWAY_MIN_BACKLOG": str(FLOOR),
    "TANGRAM_GATEWAY_MAX_BACKLOG_S": "0.001",
}


# ----------------------------------------------------------------------------- client only


class BusyGateway(FakeGateway):
    """Answers submits on the gateway subject with ``busy`` ``refusals`` times, then accepts;
    ``times``: when each request came."""

    def __init__(self, bus: Bus, refusals: int, retry_after_s: float) -> None:
        super().__init__(bus)
        self.refusals, self.retry_after_s = refusals, retry_after_s
        self.times: list[float] = []

    async def reply(self, req: GatewayRequest) -> Accepted | ErrorReply:
        self.times.append(time.monotonic())
        assert isinstance(req, Submit), req
        if len(self.seen) <= self.refusals:
            return Busy("the mesh is busy", retry_after_s=self.retry_after_s).to_reply()
        return Accepted(action_id=req.spec.action_id)


async def test_the_client_retries_busy_after_the_retry_after(raw_bus: Bus, nats_url: str):
    gateway = BusyGateway(raw_bus, refusals=2, retry_after_s=0.3)
    await gateway.start()
    async with Client.connect(nats_url) as client:
        ack = await client.submit(exec_spec("c", "a", "true"))
    assert ack.action_id == "c-a"
    gaps = [b - a for a, b in zip(gateway.times, gateway.times[1:], strict=False)]
    assert len(gaps) == 2
    assert all(g >= 0.3 for g in gaps)  # as asked, never sooner (jitter adds up to 50%)


async def test_a_client_out_of_budget_raises_busy(raw_bus: Bus, nats_url: str):
    gateway = BusyGateway(raw_bus, refusals=10**9, retry_after_s=0.2)
    await gateway.start()
    spec = msgspec.structs.replace(exec_spec("c", "b", "true"), queue_timeout_s=1.0)
    async with Client.connect(nats_url, request_timeout=0.5) as client:
        with pytest.raises(Busy, match=r"the mesh is busy \(gave up after") as exc:
            await client.submit(spec)
    assert exc.value.retry_after_s == 0.2
    # kept coming back for the action's queue timeout (1 s, longer than the 0.5 s budget)
    assert 3 <= len(gateway.seen) <= 5


async def test_a_refused_submit_waits_as_long_as_it_would_have_queued(raw_bus: Bus, nats_url: str):
    gateway = BusyGateway(raw_bus, refusals=6, retry_after_s=0.2)
    await gateway.start()
    spec = msgspec.structs.replace(exec_spec("c", "q", "true"), queue_timeout_s=30.0)
    async with Client.connect(nats_url, request_timeout=0.5) as client:
        ack = await client.submit(spec)  # ~1.2-1.8 s of refusals, past the 0.5 s budget
    assert ack.action_id == "c-q"
    assert len(gateway.seen) == 7


async def test_the_sync_client_backs_off_likewise(raw_bus: Bus, nats_url: str):
    gateway = BusyGateway(raw_bus, refusals=1, retry_after_s=0.2)
    await gateway.start()

    def submit() -> Accepted:
        with SyncClient(nats_url) as client:
            return client.submit(exec_spec("c", "s", "true"))

    ack = await asyncio.to_thread(submit)
    assert ack.action_id == "c-s"
    assert len(gateway.seen) == 2


# ----------------------------------------------------------------------------- a real mesh


@pytest.fixture(scope="module")
async def small_mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with running_mesh(tmp_path_factory.mktemp("admission"), env=ADMISSION_ENV) as m:
        yield m


class Spy:
    """The scheduler's pressure reports as every gateway sees them, and the busy errors one
    client met (its bus's ``request`` wrapped)."""

    def __init__(self) -> None:
        self.reports: list[Pressure] = []
        self.busy: list[Busy] = []

    async def on_pressure(self, msg: Msg) -> None:
        self.reports.append(codec.decode(msg.data, Pressure))

    def wrap(self, request: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def counted(*args: Any, **kw: Any) -> Any:
            try:
                return await request(*args, **kw)
            except Busy as exc:
                self.busy.append(exc)
                raise

        return counted

    def seen_twice(self, backlog: int) -> bool:
        """Two reports in a row with this backlog: every gateway has had at least one."""
        last = self.reports[-2:]
        return len(last) == 2 and all(p.backlog == backlog for p in last)


async def test_overload_is_refused_then_admitted_once_drained(
    small_mesh: Mesh, uid: str, tmp_path: Path
):
    gate = tmp_path / "gate"
    blocked = [
        exec_spec(uid, f"held{i}", f"while [ ! -e {gate} ]; do sleep 0.02; done; echo {i}")
        for i in range(FLOOR)
    ]
    spy = Spy()
    raw = await Bus.connect(small_mesh.nats_url, "admission-test")
    try:
        await raw.nc.subscribe(subjects.SCHED_PRESSURE.subject, cb=spy.on_pressure)
        async with Client.connect(small_mesh.nats_url) as client:
            for spec in blocked:
                assert not (await client.submit(spec)).duplicate
            await eventually(lambda: spy.seen_twice(FLOOR), what="the backlog reported")
            assert spy.reports[-1].received_up_to > 0  # the admissions gateways may forget

            # beyond the bound: busy, naming the backlog and the limit, with a retry-after
            extra = exec_spec(uid, "extra", "echo late")
            with pytest.raises(Busy) as refused:
                await raw.request(subjects.GATEWAY, Submit(spec=extra))
            assert f"{FLOOR} accepted actions are not finished" in refused.value.message
            assert f"the limit is {FLOOR}" in refused.value.message
            assert refused.value.retry_after_s is not None
            assert refused.value.retry_after_s > 0

            # what is already durable is still answered, and other requests are not refused
            again = await raw.request(subjects.GATEWAY, Submit(spec=blocked[0]))
            assert isinstance(again, Accepted)
            assert again.duplicate
            assert (await client.submit(blocked[1])).duplicate
            pending = await raw.request(subjects.GATEWAY, GetResult(action_id=blocked[2].action_id))
            assert isinstance(pending, Pending)

            # garbled and out-of-bounds reports are dropped; the gateway keeps its view
            await raw.nc.publish(subjects.SCHED_PRESSURE.subject, b"\xc1garbage")
            hostile = {"type": "pressure", "queued": -5, "finished_per_s": float("nan")}
            await raw.nc.publish(subjects.SCHED_PRESSURE.subject, msgspec.msgpack.encode(hostile))
            with pytest.raises(Busy):
                await raw.request(subjects.GATEWAY, Submit(spec=extra))

            # the client backs off; once the backlog drains its submit is accepted
            client.bus.request = spy.wrap(client.bus.request)  # type: ignore[method-assign]
            late = asyncio.create_task(client.run(extra, wait_s=60))
            await eventually(lambda: spy.busy, what="the client's first try refused")
            assert not late.done()
            gate.touch()
            result = await asyncio.wait_for(late, 60)
            assert result.status == "succeeded"
            assert result.stdout.strip() == "late"
            assert spy.busy
            assert all(b.retry_after_s for b in spy.busy)

            # nothing accepted is lost
            for i, spec in enumerate(blocked):
                res = await client.result(spec.action_id, timeout=30)
                assert res.status == "succeeded"
                assert res.stdout.strip() == str(i)
    finally:
        await raw.close()


async def test_new_actions_are_reported_between_ticks(tmp_path: Path, uid: str) -> None:
    """Pressure follows new actions at once, not only every tick (a tick of a minute here): a
    gateway forgets its admissions the scheduler says it received, so a fast stream of short
    actions is never counted as a backlog for a whole tick."""
    spy = Spy()
    env = {"TANGRAM_SCHEDULER_TICK_S": "60"}
    async with running_mesh(tmp_path / "m", env=env) as mesh:
        raw = await Bus.connect(mesh.nats_url, "pressure-test")
        try:
            await raw.nc.subscribe(subjects.SCHED_PRESSURE.subject, cb=spy.on_pressure)
            await raw.nc.flush()
            async with Client.connect(mesh.nats_url) as client:
                done = await client.run(exec_spec(uid, "one", "true"))
            assert done.timings is not None
            submitted = done.timings.submitted_at
            await eventually(
                lambda: any(p.received_up_to >= submitted for p in spy.reports),
                what="a pressure report naming the action received, long before the tick",
            )
        finally:
            await raw.close()


async def test_resubmitted_finished_actions_do_not_fill_the_bound(small_mesh: Mesh, uid: str):
    """An admitted submit that turns out a duplicate of a durable action never reaches the
    scheduler, so no report ever says it was received. It was counted until a later action
    was: once such phantoms filled the bound no later action got in, and the gateway answered
    ``busy`` to every new submit for good (a client replaying finished ids on a quiet mesh:
    2 batches of 256 at the default floor of 512)."""
    spy = Spy()
    raw = await Bus.connect(small_mesh.nats_url, "phantom-test")
    try:
        await raw.nc.subscribe(subjects.SCHED_PRESSURE.subject, cb=spy.on_pressure)
        async with Client.connect(small_mesh.nats_url) as client:
            done = exec_spec(uid, "done", "true")
            assert (await client.run(done, wait_s=30)).ok
            await eventually(lambda: spy.seen_twice(0), what="an idle mesh reported")
            replay = SubmitMany(items=(Submit(spec=done),) * (2 * FLOOR))
            answer = await raw.request(subjects.GATEWAY, replay)
            assert isinstance(answer, Submitted)
            assert all(isinstance(a, Accepted | ActionResult) for a in answer.items)
            fresh = exec_spec(uid, "fresh", "echo in")
            ack = await raw.request(subjects.GATEWAY, Submit(spec=fresh))  # busy before the fix
            assert isinstance(ack, Accepted)
            assert (await client.result(fresh.action_id, timeout=30)).stdout == "in\n"
    finally:
        await raw.close()


class SlowGateway(FakeGateway):
    """Holds its first request ``hold_s`` then accepts it, leaves its second unanswered (an
    overloaded gateway), accepts every later one; answers a result query ``busy`` (a gateway
    at capacity: no retry-after) ``refusals`` times, then with the result."""

    def __init__(self, bus: Bus, hold_s: float = 0.0, refusals: int = 0) -> None:
        super().__init__(bus)
        self.hold_s, self.refusals = hold_s, refusals

    async def reply(self, req: GatewayRequest) -> msgspec.Struct | None:
        if isinstance(req, GetResult):
            if sum(isinstance(r, GetResult) for r in self.seen) <= self.refusals:
                return Busy("tangram.v1.gateway is at capacity").to_reply()
            return ActionResult(action_id=req.action_id, status="succeeded")
        if len(self.seen) == 2:
            return None  # no answer: the try times out
        if len(self.seen) == 1:
            await asyncio.sleep(self.hold_s)  # the slow gateway's own delay, not a test's wait
        items = req.items if isinstance(req, SubmitMany) else (req,)
        answers = tuple(Accepted(action_id=s.spec.action_id) for s in items)
        return Submitted(items=answers) if len(items) > 1 else answers[0]


async def test_a_submit_queued_behind_a_slow_batch_is_still_tried_alone(
    raw_bus: Bus, nats_url: str
):
    """A submit's budget was spent waiting in the client's own batch queue (behind a batch an
    overloaded gateway was slow to answer): when its own batched try then timed out it was
    given up unretried, ``Unavailable`` (256 submits so, a whole batch, offering 1,500/s for
    20 s to a mesh finishing ~400/s). The gateway had never been asked again."""
    gateway = SlowGateway(raw_bus, hold_s=0.4)
    await gateway.start()
    async with Client.connect(nats_url, request_timeout=0.8) as client:
        client._intake.attempt_s = 0.5  # a batched try's wait for its answer (2 s by default)
        first = asyncio.create_task(client.submit(exec_spec("c", "first", "true")))
        await eventually(lambda: gateway.seen, what="the first batch sent")
        second = await client.submit(exec_spec("c", "second", "true"))  # queued, then timed out
        assert second.action_id == "c-second"  # tried alone: before the fix, Unavailable
        assert (await first).action_id == "c-first"
    assert len(gateway.seen) == 3


async def test_a_result_wait_outlasts_a_gateway_at_capacity(raw_bus: Bus, nats_url: str):
    """Waiting for a result with time left, a gateway too loaded to answer the result query
    within the client's request budget ended the wait ``busy``/``unavailable`` (99 of 30,000
    accepted actions so, waited for with ``result(timeout=300)`` under 3x overload): the
    action was fine and finished later. The wait now goes on and asks again."""
    gateway = SlowGateway(raw_bus, refusals=6)
    await gateway.start()
    async with Client.connect(nats_url, request_timeout=0.3) as client:
        res = await client.result("c-late", timeout=20)
    assert res.status == "succeeded"
    assert sum(isinstance(r, GetResult) for r in gateway.seen) == 7
