"""The CPU node agent: the agent runtime (``tangram.agent``) with a CPU executor.

The runtime owns the protocol (registration, heartbeats, fencing, the outbox, drain and
goodbye); this module owns what is CPU-specific: the command line of an action (``sh -c`` for
a string, ``{dop}`` filled with the granted core count), the execution backend (Docker or
processes) and the node's inventory (cores by NUMA node, memory).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Mapping
from typing import Any

from services.cpu_manager import config, inventory
from services.cpu_manager.backend_api import Backend, Canaried, ExecRequest, Tiered
from services.cpu_manager.choice import make_backend
from services.cpu_manager.config import CpuManagerConfig
from services.cpu_manager.dop import substitute_dop
from services.cpu_manager.outcome import to_outcome
from tangram.agent import Agent, AgentConfig, Launches, Starts
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig
from tangram.contract import Dispatch, ErrorKind, ExecAction, Inventory, Outcome, kind_of

log = logging.getLogger(__name__)


def exec_request(d: Dispatch, action: ExecAction) -> ExecRequest:
    """What the backend runs for a dispatch: argv with ``{dop}`` = the granted core count."""
    spec = d.action.spec
    cmd = action.command
    argv = ("sh", "-c", cmd) if isinstance(cmd, str) else tuple(cmd)
    return ExecRequest(
        action_id=spec.action_id,
        trajectory_id=spec.trajectory_id,
        argv=substitute_dop(argv, len(d.cores)),
        cores=d.cores,
        timeout_s=spec.timeout_s,
        output_cap_bytes=action.output_cap_bytes,
        env=dict(action.env),
        memory_mb=spec.memory_mb,
        image=spec.image,
        network=spec.network,
    )


class CpuExecutor:
    """The agent runtime's :class:`~tangram.agent.Executor` for shell commands on cores."""

    def __init__(self, cfg: CpuManagerConfig, backend: Backend) -> None:
        self.cfg = cfg
        self.backend = backend
        # the backend's launches, reported for the health detector (``tangram.agent.starts``)
        self.starts = backend.starts if isinstance(backend, Launches) else Starts()

    async def start(self) -> Inventory:
        await self.backend.start()
        if not self.backend.isolates:
            log.warning(
                "node %s: the %s backend does NOT isolate trajectories further than file "
                "ownership (same filesystem, same network, same processes)",
                self.cfg.node_id,
                self.backend.name,
            )
        b = self.backend
        return inventory.read(b.name, b.isolates, self.cfg.cores, self.cfg.memory_mb)

    async def close(self) -> None:
        await self.backend.close()

    async def run(self, dispatch: Dispatch) -> Outcome:
        action = dispatch.action.spec.action
        if not isinstance(action, ExecAction):
            why = f"a CPU node runs exec actions, not {kind_of(action)}"
            return Outcome(failure=ErrorKind.INVALID_REQUEST, detail=why)
        return to_outcome(await self.backend.run(exec_request(dispatch, action)))

    async def kill(self, action_id: str) -> None:
        await self.backend.kill(action_id)

    async def canary(self) -> None:
        """The health detector's canary, through the backend actions run on."""
        if isinstance(self.backend, Canaried):
            await self.backend.canary()

    async def drop_env(self, trajectory_id: str) -> None:
        await self.backend.drop_env(trajectory_id)

    def envs_on_disk(self) -> tuple[str, ...]:
        """Environments saved to disk (a backend that tiers them), holding no memory."""
        return self.backend.envs_on_disk() if isinstance(self.backend, Tiered) else ()

    def envs(self) -> dict[str, float]:
        """Last use on the agent's wall clock (a backend keeps monotonic times)."""
        offset = time.time() - time.monotonic()
        return {tid: last + offset for tid, last in self.backend.envs().items()}


def node_agent(
    bus: BaseBus, cfg: CpuManagerConfig, backend: Backend, incarnation: str | None = None
) -> Agent:
    """A CPU node agent on ``bus`` running actions on ``backend``."""
    agent_cfg = AgentConfig(
        node_id=cfg.node_id,
        incarnation=incarnation or uuid.uuid4().hex,
        heartbeat_s=cfg.heartbeat_s,
        env_ttl_s=cfg.env_ttl_s,
    )
    return Agent(bus, CpuExecutor(cfg, backend), agent_cfg, name="cpu_manager")


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Agent]:
    """The cpu_manager as configured by the environment and ``overrides`` (see runtime.Build)."""
    mesh, cfg = config.load(overrides)
    incarnation = uuid.uuid4().hex
    backend, line = await make_backend(cfg, incarnation)
    log.warning("node %s: %s", cfg.node_id, line)
    bus = await open_bus(stack, mesh.nats_url, f"cpu_manager.{cfg.node_id}")
    return mesh, node_agent(bus, cfg, backend, incarnation)
