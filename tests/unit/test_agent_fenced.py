"""The agent shell told by the scheduler that its incarnation is fenced: it starts nothing it
holds, kills what runs and stops with the error (its supervisor starts a new incarnation)."""

from __future__ import annotations

from typing import Any

from tangram import subjects
from tangram.agent import Agent, AgentConfig
from tangram.contract import Ack, NodeMessage, NodeReport
from tangram.errors import Fenced
from tangram.membus import MemoryBroker

from ..support import eventually
from .test_agent_core import dispatch
from .test_agent_shell import FakeExecutor


async def test_a_fenced_agent_starts_nothing_more_and_stops() -> None:
    broker = MemoryBroker()
    fenced = False

    async def on_node(msg: NodeMessage, _raw: Any) -> Ack:
        if isinstance(msg, NodeReport) and fenced:
            raise Fenced("declared failed")
        return Ack(epoch=1, lease_s=0.2)

    sbus = broker.connect("scheduler")
    sbus.serve(subjects.SCHED_NODES, on_node, max_in_flight=1)
    await sbus.start()
    bus = broker.connect("agent")
    cfg = AgentConfig(node_id="n0", incarnation="inc", heartbeat_s=0.05, lease_s=0.2)
    executor = FakeExecutor()
    agent = Agent(bus, executor, cfg)
    try:
        await agent.start()
        await sbus.publish(subjects.node("n0"), dispatch("a", cores=(0,)))
        await eventually(lambda: "a" in executor.release, what="a to start")
        fenced = True  # from now on the scheduler refuses its reports: the lease runs out
        await eventually(lambda: not agent.core.leased(agent.mono()), what="the lease to lapse")
        await sbus.publish(subjects.node("n0"), dispatch("b", cores=(1,)))
        await eventually(lambda: agent.stopped.is_set(), what="the agent to stop")
        assert isinstance(agent.fatal, Fenced)
        assert "b" not in executor.release  # held, never started
        assert executor.killed == ["a"]
    finally:
        await agent.stop(0.1)
        await bus.close()
        await sbus.close()
