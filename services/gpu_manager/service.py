"""The GPU node agent: the agent runtime (``tangram.agent``) with the GPU executor.

The runtime owns the protocol (registration, heartbeats, fencing, the outbox, drain and
goodbye) and hands ``Prepare`` to the executor's ``prepare`` hook and its prepared services
to every heartbeat; ``executor.py`` owns what is GPU-specific (devices, services, residency,
batching).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Mapping
from typing import Any

from services.gpu_manager import config
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.executor import GpuExecutor
from tangram import subjects
from tangram.agent import Agent, AgentConfig
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig

log = logging.getLogger(__name__)


def node_agent(bus: BaseBus, cfg: GpuManagerConfig, incarnation: str | None = None) -> Agent:
    """A GPU node agent on ``bus``."""
    agent_cfg = AgentConfig(
        node_id=cfg.node_id,
        incarnation=incarnation or uuid.uuid4().hex,
        heartbeat_s=cfg.heartbeat_s,
    )
    executor = GpuExecutor(cfg)
    # prefetch hints bypass the agent's command path: advice, never fenced or reported
    bus.serve(subjects.prefetch(cfg.node_id), executor.on_prefetch, max_in_flight=8)
    return Agent(bus, executor, agent_cfg, name="gpu_manager")


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Agent]:
    """The gpu_manager as configured by the environment and ``overrides`` (see runtime.Build)."""
    mesh, cfg = config.load(overrides)
    bus = await open_bus(stack, mesh.nats_url, f"gpu_manager.{cfg.node_id}")
    return mesh, node_agent(bus, cfg)
