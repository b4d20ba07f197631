"""The node agent on the Docker backend: idle TTL, and kills that arrive before the action runs."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from exec_requests import ok, request_for

from services.cpu_manager.config import CpuManagerConfig
from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.config import DockerConfig
from services.cpu_manager.service import node_agent
from tangram import subjects
from tangram.bus import Bus
from tangram.contract import Ack, EnvExpired, NodeMessage

pytestmark = pytest.mark.docker


@pytest.fixture
async def scheduler_inbox(nats_url: str) -> AsyncIterator[asyncio.Queue[Any]]:
    """What node agents send the scheduler, acknowledged like the scheduler would."""
    inbox: asyncio.Queue[Any] = asyncio.Queue()

    async def on_message(msg: Any, _raw: Any) -> Ack:
        inbox.put_nowait(msg)
        return Ack()

    bus = await Bus.connect(nats_url, "fake-scheduler")
    bus.serve(subjects.SCHED_NODES, NodeMessage, on_message, max_in_flight=1)
    await bus.start()
    try:
        yield inbox
    finally:
        await bus.close()


@pytest.fixture
async def agent_bus(nats_url: str) -> AsyncIterator[Bus]:
    bus = await Bus.connect(nats_url, "cpu-agent")
    try:
        yield bus
    finally:
        await bus.close()


async def _expired(inbox: asyncio.Queue[Any]) -> EnvExpired:
    async with asyncio.timeout(15):
        while not isinstance(msg := await inbox.get(), EnvExpired):
            pass
    return msg


async def test_idle_ttl_removes_the_container(
    nats_url: str,
    scheduler_inbox: asyncio.Queue[Any],
    agent_bus: Bus,
    docker_config: Callable[..., DockerConfig],
    tmp_path: Path,
) -> None:
    dcfg = docker_config()
    backend = DockerBackend(dcfg)
    cfg = CpuManagerConfig(node_id=dcfg.node_id, state_dir=str(tmp_path), env_ttl_s=0.5)
    async with node_agent(agent_bus, cfg, backend):
        ok(await backend.run(request_for("traj-idle", "echo x > /work/f")))
        env = backend.env("traj-idle")
        assert env is not None
        expired = await _expired(scheduler_inbox)
        assert expired.trajectory_id == "traj-idle"
        assert "traj-idle" not in backend.envs()
        assert await backend.call(backend.engine.state, env.container_id) is None
        assert not env.spec.host_dir.exists()
