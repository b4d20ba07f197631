"""The agent shell on the in-memory bus with a fake executor and a fake scheduler: what it
says, in which order, and that nothing follows its goodbye."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import msgspec
import pytest

from tangram import subjects
from tangram.agent import Agent, AgentConfig
from tangram.contract import (
    Ack,
    Commands,
    Completion,
    Completions,
    Dispatch,
    ErrorKind,
    Inventory,
    NodeLeaving,
    NodeMessage,
    NodeReport,
    NumaCores,
    Outcome,
    Ping,
)
from tangram.errors import InvalidRequest, Unavailable
from tangram.membus import MemoryBroker

from ..support import eventually, unbatched
from .test_agent_core import dispatch


class FakeExecutor:
    """Runs each dispatch until released; remembers what it was asked."""

    def __init__(self) -> None:
        self.release: dict[str, asyncio.Event] = {}
        self.killed: list[str] = []
        self.closed = False

    async def start(self) -> Inventory:
        cores = NumaCores(numa_node=0, cores=(0, 1))
        return Inventory(numa=(cores,), memory_mb=64, backend="fake", isolates=False)

    async def close(self) -> None:
        self.closed = True

    async def run(self, dispatch: Dispatch) -> Outcome:
        aid = dispatch.action.spec.action_id
        await self.release.setdefault(aid, asyncio.Event()).wait()
        return Outcome(exit_code=0, stdout=aid, started_at=1.0, finished_at=2.0)

    async def kill(self, action_id: str) -> None:
        self.killed.append(action_id)
        self.release.setdefault(action_id, asyncio.Event()).set()

    async def drop_env(self, trajectory_id: str) -> None:
        pass

    def envs(self) -> Mapping[str, float]:
        return {}


class FakeScheduler:
    """Hears what agents say, in order; acks completions only once ``acking`` is set."""

    def __init__(self) -> None:
        self.heard: list[NodeMessage] = []
        self.raw: list[NodeMessage] = []  # as sent: completions may travel together
        self.refuse: set[str] = set()  # completions of these actions are refused
        self.acking = asyncio.Event()

    async def on_node(self, msg: NodeMessage, _raw: Any) -> Ack:
        self.raw.append(msg)
        self.heard += unbatched(msg)
        if any(getattr(m, "action_id", "") in self.refuse for m in unbatched(msg)):
            raise InvalidRequest("refused for the test")
        if isinstance(msg, Completion | Completions) and not self.acking.is_set():
            raise Unavailable("not now")
        return Ack()

    def of(self, typ: type[Any]) -> list[Any]:
        return [m for m in self.heard if isinstance(m, typ)]


@pytest.fixture
async def mesh() -> AsyncIterator[tuple[Agent, FakeExecutor, FakeScheduler, Any]]:
    broker = MemoryBroker()
    scheduler, sbus = FakeScheduler(), broker.connect("scheduler")
    sbus.serve(subjects.SCHED_NODES, scheduler.on_node, max_in_flight=1)
    await sbus.start()
    bus = broker.connect("agent")
    cfg = AgentConfig(node_id="n0", incarnation="inc", heartbeat_s=0.02, resend_s=0.02)
    executor = FakeExecutor()
    agent = Agent(bus, executor, cfg)
    try:
        yield agent, executor, scheduler, sbus
    finally:
        await agent.stop(0.1)
        await bus.close()
        await sbus.close()


async def test_a_completion_is_resent_until_acked_and_goodbye_is_last(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any],
):
    agent, executor, scheduler, sbus = mesh
    await agent.start()
    await eventually(lambda: scheduler.of(NodeReport), what="registration")
    await sbus.publish(subjects.node("n0"), dispatch("a", incarnation="inc"))
    await eventually(lambda: "a" in executor.release, what="the run to start")
    executor.release["a"].set()
    await eventually(lambda: len(scheduler.of(Completion)) >= 3, what="re-sends")
    scheduler.acking.set()
    await eventually(lambda: not agent.core.unacked, what="the ack")
    await eventually(
        lambda: [r for r in scheduler.of(NodeReport) if r.progress and r.progress.finished == 1],
        what="progress in a heartbeat",
    )
    await eventually(lambda: scheduler.of(NodeReport)[-1].running == (), what="acked: not held")
    await sbus.publish(subjects.node("n0"), dispatch("b", cores=(1,), incarnation="inc"))
    await eventually(lambda: "b" in executor.release, what="the second run")
    await agent.stop(0.05)
    leaving = scheduler.of(NodeLeaving)
    assert [m.draining for m in leaving] == [True, False]
    assert leaving[1].started == ()  # b was killed after the drain bound, its report acked
    assert scheduler.heard[-1] is leaving[1], "the agent spoke after its goodbye"
    assert executor.killed == ["b"]
    assert executor.closed
    (b,) = [c for c in scheduler.of(Completion) if c.action_id == "b"]
    assert b.outcome.failure is ErrorKind.NODE_DIED


async def test_commands_of_one_pass_are_taken_one_by_one_and_completions_travel_together(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any],
):
    agent, executor, scheduler, sbus = mesh
    scheduler.acking.set()
    await agent.start()
    await eventually(lambda: scheduler.of(NodeReport), what="registration")
    batch = Commands(
        items=(
            dispatch("a", cores=(0,), incarnation="inc"),
            dispatch("x", cores=(0,), incarnation="inc"),  # overlaps a: refused, alone
            dispatch("b", cores=(1,), incarnation="inc"),
        ),
        epoch=1,
    )
    await sbus.publish(subjects.node("n0"), batch)
    await eventually(lambda: {"a", "b"} <= set(executor.release), what="a and b to start")
    assert "x" not in executor.release
    assert agent.core.refused_overlaps == 1
    for aid in ("a", "b"):  # both end in one turn of the event loop
        executor.release[aid].set()
    await eventually(lambda: not agent.core.unacked and not agent.core.active, what="the acks")
    together = [m for m in scheduler.raw if isinstance(m, Completions)]
    assert [[c.action_id for c in m.items] for m in together] == [["a", "b"]]


async def test_a_refused_completion_does_not_hold_back_the_others_of_its_batch(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any],
):
    agent, executor, scheduler, sbus = mesh
    scheduler.acking.set()
    scheduler.refuse.add("bad")
    await agent.start()
    await eventually(lambda: scheduler.of(NodeReport), what="registration")
    batch = Commands(
        items=(
            dispatch("bad", cores=(0,), incarnation="inc"),
            dispatch("a", cores=(1,), incarnation="inc"),
        ),
        epoch=1,
    )
    await sbus.publish(subjects.node("n0"), batch)
    await eventually(lambda: {"a", "bad"} <= set(executor.release), what="both to start")
    for aid in ("bad", "a"):
        executor.release[aid].set()
    await eventually(lambda: set(agent.core.unacked) == {"bad"}, what="a acked alone")


async def b_behind_a(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any],
) -> tuple[Agent, FakeExecutor, FakeScheduler]:
    """A started agent running ``a`` on core 0, with ``b`` pipelined behind it."""
    agent, executor, scheduler, sbus = mesh
    scheduler.acking.set()
    await agent.start()
    await eventually(lambda: scheduler.of(NodeReport), what="registration")
    behind = msgspec.structs.replace(dispatch("b", cores=(0,)), after=("a",))
    await sbus.publish(subjects.node("n0"), Commands(items=(dispatch("a"), behind), epoch=1))
    await eventually(lambda: "a" in executor.release and "b" in agent.core.waiting, what="b held")
    return agent, executor, scheduler


async def test_a_waiting_action_starts_on_the_turn_its_cores_were_freed(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any],
):
    """The dispatch pipelined behind an action starts within the turn of the event loop in
    which that action ended: a task of its own would start one turn later, its core idle
    meanwhile (see the process backend's ``_drain``)."""
    agent, executor, scheduler = await b_behind_a(mesh)
    assert "b" not in executor.release
    started_by_the_next_turn: list[bool] = []
    executor.release["a"].set()  # a's end is due on the next turn, then this
    asyncio.get_running_loop().call_soon(
        lambda: started_by_the_next_turn.append("b" in executor.release)
    )
    await eventually(lambda: started_by_the_next_turn, what="the next turn")
    assert started_by_the_next_turn == [True]
    executor.release["b"].set()
    await eventually(lambda: not agent.core.unacked and not agent.core.active, what="the acks")
    assert sorted(c.action_id for c in scheduler.of(Completion)) == ["a", "b"]


async def test_a_failure_applying_an_end_does_not_lose_the_action_behind_it(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any], monkeypatch: pytest.MonkeyPatch
):
    agent, executor, _ = await b_behind_a(mesh)
    coalesce = agent._coalesce

    def once(c: Completion) -> None:
        monkeypatch.setattr(agent, "_coalesce", coalesce)
        raise RuntimeError("a bug applying a's end")

    monkeypatch.setattr(agent, "_coalesce", once)
    executor.release["a"].set()
    await eventually(lambda: "b" in executor.release, what="b to start all the same")


class CanaryExecutor(FakeExecutor):
    """A fake executor with the canary hook, wedged until ``unwedge`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.unwedge = asyncio.Event()
        self.canaries = 0

    async def canary(self) -> None:
        self.canaries += 1
        await self.unwedge.wait()


async def test_a_canary_is_answered_once_it_completed_and_probes_share_one() -> None:
    broker = MemoryBroker()
    sched = broker.connect("scheduler")
    sched.serve(subjects.SCHED_NODES, FakeScheduler().on_node, max_in_flight=1)
    await sched.start()
    bus = broker.connect("agent")
    executor = CanaryExecutor()
    agent = Agent(bus, executor, AgentConfig(node_id="n0", incarnation="inc", heartbeat_s=0.02))
    await agent.start()
    try:
        node = subjects.node("n0")
        assert isinstance(await sched.request(node, Ping(incarnation="inc"), timeout=1), Ack)
        canary = Ping(incarnation="inc", canary=True)
        with pytest.raises(Unavailable):  # wedged: no answer
            await sched.request(node, canary, timeout=0.1)
        with pytest.raises(InvalidRequest, match="incarnation"):  # another incarnation's
            await sched.request(node, Ping(incarnation="old", canary=True), timeout=1)
        pings = next(s for s in bus._servers if s.subject == node.subject)
        heard = pings.served
        second = asyncio.create_task(sched.request(node, canary, timeout=2))
        await eventually(lambda: pings.served > heard, what="the second probe heard")
        executor.unwedge.set()
        assert isinstance(await second, Ack)
        assert executor.canaries == 1  # the second probe waited on the first's canary
    finally:
        await agent.stop(0.1)
        await bus.close()
        await sched.close()


async def test_an_executor_without_the_hook_answers_a_canary_as_a_ping(
    mesh: tuple[Agent, FakeExecutor, FakeScheduler, Any],
):
    agent, _executor, _scheduler, sbus = mesh
    await agent.start()
    ping = Ping(incarnation="inc", canary=True)
    assert isinstance(await sbus.request(subjects.node("n0"), ping, timeout=1), Ack)
