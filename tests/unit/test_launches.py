"""The agents' launches (``tangram.agent.starts``), the start phase the health detector
watches: counted once each, from any thread; carried by every report; the process backend's
a wedged launcher holds under way; the GPU executor's calls waiting for their chunk are none
while a granted batch is one until its runner takes it up; the quota agent's one per call."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process.backend import ProcessBackend
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.executor import GpuExecutor
from services.quota_manager.service import HttpExecutor
from tangram import subjects
from tangram.agent import Agent, AgentConfig, Launches, Starts
from tangram.contract import Dispatch, NodeReport, Outcome, ServiceSpec
from tangram.membus import MemoryBroker

from .. import gpu_models
from ..support import eventually, process_backend
from .test_agent_core import dispatch
from .test_agent_shell import FakeExecutor, FakeScheduler
from .test_gpu_agent import M, started
from .test_quota_agent import dispatch as http_dispatch
from .test_quota_agent import executor, host_of, upstream  # noqa: F401 (fixtures)


def test_a_launch_ends_once_from_any_thread() -> None:
    starts = Starts()
    launches = [starts.begin(2) for _ in range(50)]
    assert starts.snapshot() == (0, 100)
    threads = [threading.Thread(target=lambda: [x.done() for x in launches]) for _ in range(4)]
    for t in threads:
        t.start()
    for launch in launches:
        launch.done()
    for t in threads:
        t.join()
    assert starts.snapshot() == (100, 0)
    with starts.begin():
        assert starts.snapshot() == (100, 1)
    starts.launched()
    assert starts.snapshot() == (102, 0)


class LaunchingExecutor(FakeExecutor):
    """Each run is a launch that ends when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.starts = Starts()
        self.spawn = asyncio.Event()

    async def run(self, dispatch: Dispatch) -> Outcome:
        with self.starts.begin():
            await self.spawn.wait()
        return await super().run(dispatch)


async def test_every_report_carries_the_executors_launches() -> None:
    broker = MemoryBroker()
    scheduler, sbus = FakeScheduler(), broker.connect("scheduler")
    sbus.serve(subjects.SCHED_NODES, scheduler.on_node, max_in_flight=1)
    await sbus.start()
    bus = broker.connect("agent")
    fake = LaunchingExecutor()
    assert isinstance(fake, Launches)
    agent = Agent(bus, fake, AgentConfig(node_id="n0", incarnation="inc", heartbeat_s=0.02))
    await agent.start()

    def last() -> tuple[int, int]:
        (*_, report) = scheduler.of(NodeReport)
        assert report.progress is not None
        return report.progress.spawned, report.progress.spawning

    try:
        await sbus.request(subjects.node("n0"), dispatch("a1", (0,)), timeout=1)
        await eventually(lambda: last() == (0, 1), what="a launch under way reported")
        fake.spawn.set()
        await eventually(lambda: last() == (1, 0), what="the launch ended, reported")
        fake.release["a1"].set()
    finally:
        await agent.stop(0.1)
        await bus.close()
        await sbus.close()


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    async with process_backend(tmp_path, "n-launch") as b:
        yield b


def request(aid: str) -> ExecRequest:
    cores = tuple(sorted(os.sched_getaffinity(0)))[:1]
    return ExecRequest(aid, "t", ("true",), cores, timeout_s=5.0, output_cap_bytes=1024)


async def test_a_wedged_launcher_holds_its_launch_under_way(backend: ProcessBackend) -> None:
    assert (await backend.run(request("a"))).exit_code == 0
    assert backend.starts.snapshot() == (1, 0)
    wedge = threading.Event()
    backend._launcher.submit(wedge.wait)
    try:
        run = asyncio.ensure_future(backend.run(request("b")))
        await eventually(lambda: backend.starts.snapshot() == (1, 1), what="under way")
        await asyncio.sleep(0.2)
        assert backend.starts.snapshot() == (1, 1)  # nothing ends while it is wedged
    finally:
        wedge.set()
    assert (await asyncio.wait_for(run, 5)).exit_code == 0
    assert backend.starts.snapshot() == (2, 0)
    bad = ExecRequest("c", "t", ("/no/such/program",), request("c").cores, 5.0, 1024)
    assert (await backend.run(bad)).exit_code == 127  # failed at the spawn: out of the phase
    assert backend.starts.snapshot() == (3, 0)


async def test_gpu_calls_waiting_for_their_chunk_are_no_launch() -> None:
    async with started() as node:
        ex: GpuExecutor = node.executor
        await node.prepare(ServiceSpec("slow", f"{M}:slow_service", max_batch=3))
        gpu_models.GATE.clear()
        await node.call("s0", "slow", [0.0] * 8)
        await eventually(lambda: ex.starts.snapshot() == (1, 0), what="the batch in its runner")
        for i in range(1, 4):
            await node.call(f"s{i}", "slow", [float(i)] * 8)
        await eventually(lambda: len(ex.former) == 3, what="the calls to queue")
        assert ex.starts.snapshot() == (1, 0)  # queued for the chunk its batch holds
        gpu_models.GATE.set()
        for i in range(4):
            assert (await node.outcome(f"s{i}")).exit_code == 0
        assert ex.starts.snapshot() == (4, 0)


async def test_gpu_a_granted_batch_is_a_launch_until_its_runner_takes_it() -> None:
    assert isinstance(GpuExecutor(GpuManagerConfig(node_id="g0")), Launches)
    async with started() as node:
        ex = node.executor
        await node.prepare(ServiceSpec("slow", f"{M}:slow_service"))
        assert ex._runner is not None
        wedge = threading.Event()
        held = [ex._runner.submit(wedge.wait) for _ in range(4)]  # every runner thread
        try:
            await node.call("w0", "slow", [0.0] * 8)
            await eventually(lambda: ex.starts.snapshot() == (0, 1), what="a launch under way")
        finally:
            wedge.set()
        assert (await node.outcome("w0")).exit_code == 0
        assert ex.starts.snapshot() == (1, 0)
        for h in held:
            h.result(timeout=5)


async def test_the_quota_agent_counts_one_launch_per_call(
    executor: HttpExecutor,  # noqa: F811
    upstream,  # noqa: F811
) -> None:
    assert isinstance(executor, Launches)
    out = await executor.run(http_dispatch(f"{upstream.url}/echo", (host_of(upstream),)))
    assert out.failure is None
    assert executor.starts.snapshot() == (1, 0)
