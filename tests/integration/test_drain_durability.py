"""SIGTERM of a node agent: an action longer than the drain bound ends as ``node_died`` (an
infrastructure failure, recorded once), the agent exits by itself within its bound, and the
launcher never SIGKILLs an agent still inside its worst-case stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import msgspec
import nats.errors
import pytest
from nats.aio.msg import Msg

from services.gateway.formulation import Limits, formulate
from tangram import ActionSpec, ErrorKind, ExecAction, subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import (
    Ack,
    Completion,
    Dispatch,
    NodeLeaving,
    NodeMessage,
    NodeReport,
    codec,
)
from tangram.launcher import Mesh

from ..support import eventually, exec_spec, running_mesh, unbatched

pytestmark = pytest.mark.slow

DRAIN_S = 1.0


@pytest.fixture
async def short_drain_mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(tmp_path / "mesh", env={"TANGRAM_DRAIN_S": str(DRAIN_S)}) as m:
        yield m


async def test_action_longer_than_the_drain_ends_as_node_died(
    short_drain_mesh: Mesh, uid: str, tmp_path: Path
):
    mesh = short_drain_mesh
    marker = tmp_path / "started"
    spec = ActionSpec(
        action_id=f"{uid}-long",
        job_id=uid,
        trajectory_id=uid,
        action=ExecAction(command=f"touch {marker}; sleep 60"),
    )
    async with Client.connect(mesh.nats_url) as client:
        await client.submit(spec)
        await eventually(marker.exists, what="the action to run")
        t0 = time.monotonic()
        rc = await mesh.stop_service("cpu_manager.0")
        took = time.monotonic() - t0
        res = await client.result(spec.action_id, timeout=30)
    assert rc == 0, "the agent was killed instead of draining"
    assert took < DRAIN_S + 3.0, took  # the scheduler answers: only the drain bound is waited
    assert res.status == "failed"
    assert res.error is not None
    assert res.error.kind is ErrorKind.NODE_DIED
    assert res.infrastructure_failure
    conn = await asyncpg.connect(mesh.postgres_dsn)
    try:

        async def ended() -> asyncpg.Record | None:
            row = await conn.fetchrow(
                "SELECT status, error_kind FROM actions WHERE action_id = $1", spec.action_id
            )
            return row if row["status"] != "running" else None

        row = await eventually(ended, what="the action's terminal record")
        terminal = await conn.fetchval(
            "SELECT count(*) FROM action_events WHERE action_id = $1"
            " AND status IN ('succeeded', 'failed', 'cancelled')",
            spec.action_id,
        )
    finally:
        await conn.close()
    assert (row["status"], row["error_kind"], terminal) == ("failed", "node_died", 1)


class FakeScheduler:
    """Listens where the scheduler listens; silent, every request of the node agent runs into
    its timeout (the agent's worst-case stop), or answering, it acks every message."""

    def __init__(self, bus: Bus, answer: bool = False) -> None:
        self.bus = bus
        self.answer = answer
        self.reports: asyncio.Queue[NodeReport] = asyncio.Queue()
        self.completions: list[Completion] = []
        self.heard: list[NodeMessage] = []  # in arrival order
        self.draining = asyncio.Event()

    async def start(self) -> None:
        await self.bus.nc.subscribe(subjects.SCHED_NODES.subject, cb=self._on_msg)
        await self.bus.nc.flush()

    async def _on_msg(self, msg: Msg) -> None:
        try:
            m = codec.decode(msg.data, NodeMessage)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        for one in unbatched(m):
            self.heard.append(one)
            if isinstance(one, NodeReport):
                self.reports.put_nowait(one)
            elif isinstance(one, Completion):
                self.completions.append(one)
            elif isinstance(one, NodeLeaving) and one.draining:
                self.draining.set()
        if self.answer and msg.reply:
            await self.bus.reply(msg, Ack())

    async def dispatch(self, report: NodeReport, spec: ActionSpec, core: int = 0) -> None:
        action = formulate(spec, now=time.time(), limits=Limits())
        action = msgspec.structs.replace(action, attempt=1)
        cmd = Dispatch(
            action=action,
            cores=(report.inventory.numa[0].cores[core],),
            epoch=1,
            incarnation=report.incarnation,
        )
        await self.bus.publish(subjects.node(report.node_id), cmd)
        await self.bus.nc.flush()


async def no_responder(bus: Bus, subject: str) -> bool:
    """True once nobody serves ``subject`` (an empty request is otherwise refused)."""
    try:
        await bus.nc.request(subject, b"", timeout=1)
    except nats.errors.NoRespondersError:
        return True
    except nats.errors.TimeoutError:
        pass
    return False


async def test_a_leaving_agent_names_what_it_started_and_goes_quiet(tmp_path: Path, uid: str):
    """The goodbye lets the scheduler requeue a dispatch that arrived after intake stopped,
    and no heartbeat follows it (a late one would bring a ghost of the node back)."""
    marker = tmp_path / "started"
    long = exec_spec(uid, "long", f"touch {marker}; sleep 1.5")
    late = exec_spec(uid, "late", "echo never")
    env = {"TANGRAM_DRAIN_S": "10"}
    async with running_mesh(tmp_path / "mesh", servers_only=True, env=env) as mesh:
        bus = await Bus.connect(mesh.nats_url, "answering-scheduler")
        scheduler = FakeScheduler(bus, answer=True)
        await scheduler.start()
        await mesh.start_service("cpu_manager", 0)
        report = await asyncio.wait_for(scheduler.reports.get(), 30)
        await scheduler.dispatch(report, long)
        await eventually(marker.exists, what="the action to run")
        stopping = asyncio.ensure_future(mesh.stop_service("cpu_manager.0"))
        await asyncio.wait_for(scheduler.draining.wait(), 10)
        await eventually(
            lambda: no_responder(bus, subjects.node(report.node_id).subject),
            what="the agent to stop taking work",
        )
        await scheduler.dispatch(report, late, core=1)
        assert await stopping == 0
        # The scenario: the agent is gone, and no heartbeat (every 0.5 s) may follow its goodbye.
        await asyncio.sleep(1.0)
        await bus.close()
    gone = [m for m in scheduler.heard if isinstance(m, NodeLeaving) and not m.draining]
    assert len(gone) == 1
    assert gone[0].started == ()  # the long action's completion was acknowledged
    assert gone[0].envs == (long.trajectory_id,)
    assert scheduler.heard[-1] is gone[0], "the agent spoke after saying goodbye"
    done = [(c.action_id, c.outcome.failure, c.outcome.exit_code) for c in scheduler.completions]
    assert done == [(long.action_id, None, 0)]


async def test_the_launcher_outwaits_the_agents_worst_case_stop(tmp_path: Path, uid: str):
    drain_s = 8.0  # the agent's fixed waits (~8 s here) on top exceed the old 15 s SIGKILL limit
    env = {"TANGRAM_DRAIN_S": str(drain_s)}
    marker = tmp_path / "started"
    spec = ActionSpec(
        action_id=f"{uid}-long",
        job_id=uid,
        trajectory_id=uid,
        action=ExecAction(command=f"touch {marker}; sleep 60"),
    )
    async with running_mesh(tmp_path / "mesh", servers_only=True, env=env) as mesh:
        bus = await Bus.connect(mesh.nats_url, "silent-scheduler")
        scheduler = FakeScheduler(bus)
        await scheduler.start()
        await mesh.start_service("cpu_manager", 0)
        report = await asyncio.wait_for(scheduler.reports.get(), 30)
        await scheduler.dispatch(report, spec)
        await eventually(marker.exists, what="the action to run")
        t0 = time.monotonic()
        rc = await mesh.stop_service("cpu_manager.0")
        took = time.monotonic() - t0
        await bus.close()
    assert rc == 0, f"SIGKILLed after {took:.1f}s; limit {mesh.stop_limit_s('cpu_manager.0')}s"
    assert drain_s <= took < mesh.stop_limit_s("cpu_manager.0")
    kinds = {c.outcome.failure for c in scheduler.completions}
    assert kinds == {ErrorKind.NODE_DIED}  # it kept trying to report the death
