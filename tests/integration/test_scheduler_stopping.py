"""A scheduler that is stopping (told to, or deposed by a new leader) judges no agent: it no
longer takes their reports, so their silence says nothing. Judging on, it would suspect, probe
and fail live agents, push ``node_died`` results for actions that run on under the new leader,
and record them fenced in ``health_events``, which the next leader fences again at its start.
Seen in a chaos run (bench/chaos.py): after a Postgres restart the deposed leader drained for
8 s and declared every agent suspect twice meanwhile."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.service import Scheduler
from tangram import subjects
from tangram.contract import Ack, Inventory, NodeReport
from tangram.health import Health, HealthConfig
from tangram.membus import MemoryBroker

from ..support import eventually, postgres_pool

pytestmark = pytest.mark.slow

FAST = HealthConfig(silent_s=0.3, suspect_s=0.3, probe_timeout_s=0.2, lease_s=0.3, check_s=0.05)


@pytest.fixture(scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[asyncpg.Pool]:
    async with postgres_pool(tmp_path_factory.mktemp("pg")) as p:
        yield p


async def test_a_stopping_scheduler_judges_no_agent(pool: asyncpg.Pool, uid: str):
    broker = MemoryBroker()
    scheduler = Scheduler(SchedulerConfig(health=FAST), broker.connect("scheduler"), pool)
    agent = broker.connect("agent")  # reports, and answers no ping (it serves nothing)
    report = NodeReport(node_id=uid, incarnation="i1", inventory=Inventory(kind="cpu"))
    draining, drained = asyncio.Event(), asyncio.Event()
    stop_serving = scheduler.bus.stop_serving

    async def slow_drain(grace_s: float) -> None:  # in-flight work outlasting every bound
        await stop_serving(grace_s)
        draining.set()
        await drained.wait()

    scheduler.bus.stop_serving = slow_drain  # type: ignore[method-assign]
    await scheduler.start()
    stopping: asyncio.Future[None] | None = None
    try:
        assert isinstance(await agent.request(subjects.sched_node(uid), report), Ack)
        assert scheduler.health.detector.members[uid].health is Health.HEALTHY
        stopping = asyncio.ensure_future(scheduler.stop())
        await eventually(draining.is_set, what="the scheduler to stop taking reports")
        # the drain's length is the scenario: silent, probed, fenced and failed fit in it
        await asyncio.sleep(3 * (FAST.silent_s + FAST.probe_timeout_s + FAST.lease_s))
        member = scheduler.health.detector.members.get(uid)
        assert member is not None, "the agent was declared failed while the scheduler drained"
        assert member.health is Health.HEALTHY
    finally:
        drained.set()
        await (stopping or scheduler.stop())
