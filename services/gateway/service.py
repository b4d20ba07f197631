"""The gateway shell: the only door for clients.

Decodes every request, formulates actions, makes them durable (group commit) before it
acknowledges, hands them to the scheduler, and answers result queries from Postgres.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.gateway import config, quotas_api, services_api, store
from services.gateway.config import GatewayConfig
from services.gateway.formulation import Limits, formulate
from tangram import db, subjects, telemetry
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig
from tangram.contract import (
    Accepted,
    ActionResult,
    Cancel,
    CancelCmd,
    CloseEnv,
    CloseEnvCmd,
    Done,
    Enqueue,
    GatewayRequest,
    GetResult,
    ListQuotas,
    ListServices,
    Pending,
    Quotas,
    RegisterService,
    ReleaseLease,
    Services,
    SetQuota,
    Submit,
    UnifiedAction,
)
from tangram.errors import InvalidRequest, NotFound
from tangram.runtime import Service

log = logging.getLogger(__name__)

SCHEDULER_TIMEOUT_S = 5.0
Reply = Accepted | ActionResult | Pending | Done | Services | Quotas


class Gateway(Service):
    name = "gateway"

    def __init__(self, cfg: GatewayConfig, bus: BaseBus, pool: asyncpg.Pool) -> None:
        super().__init__()
        self.cfg = cfg
        self.bus = bus
        self.pool = pool
        self.limits = Limits(max_cpus=cfg.max_cpus_per_action, max_memory_mb=cfg.max_memory_mb)
        self.quotas = quotas_api.QuotaBook(pool)
        self.intake: db.GroupCommit[UnifiedAction, store.Intake] = db.GroupCommit(
            self._insert, max_batch=cfg.max_batch
        )

    async def _insert(self, batch: Sequence[UnifiedAction]) -> list[store.Intake]:
        return await store.insert_actions(self.pool, batch)

    async def on_start(self) -> None:
        await self.quotas.load()
        self.intake.start()
        self.bus.serve(subjects.GATEWAY, self.handle, max_in_flight=self.cfg.max_in_flight)
        await self.bus.start()

    async def on_stop(self, grace_s: float) -> None:
        """Stop intake and flush it; ``build``'s stack then closes the bus and pool."""
        await self.bus.stop_serving(grace_s)
        await self.intake.close()

    async def handle(self, req: GatewayRequest, msg: Msg) -> Reply:
        match req:
            case Submit():
                return await self.submit(req)
            case GetResult(action_id=action_id):
                return await self.get_result(action_id)
            case CloseEnv(trajectory_id=tid):
                return await self.forward(CloseEnvCmd(trajectory_id=tid))
            case Cancel(action_id=action_id):
                return await self.forward(CancelCmd(action_id=action_id))
            case RegisterService(spec=spec):
                return await services_api.register(self.pool, self.bus, spec)
            case ListServices():
                return await services_api.list_services(self.bus)
            case SetQuota(spec=spec):
                return await self.quotas.set(self.bus, spec)
            case ListQuotas():
                return await quotas_api.list_quotas(self.bus)
            case ReleaseLease():
                return await quotas_api.release_lease(self.bus, req)
            case _:
                raise InvalidRequest(f"{type(req).__name__} is not served by this mesh yet")

    async def submit(self, req: Submit) -> Accepted | ActionResult:
        action = formulate(
            req.spec,
            now=time.time(),
            limits=self.limits,
            reply_subject=req.reply_subject or "",
            traceparent=telemetry.current_traceparent(),
            quotas=await self.quotas.fresh_for(req.spec),
        )
        intake = await self.intake.submit(action)
        if intake.duplicate:
            return intake.result or Accepted(
                action_id=intake.action_id,
                duplicate=True,
                status=intake.status,  # type: ignore[arg-type]
            )
        await self.bus.publish(subjects.SCHED_ACTIONS, Enqueue(action=action))
        return Accepted(action_id=intake.action_id)

    async def get_result(self, action_id: str) -> ActionResult | Pending:
        found = await store.fetch_result(self.pool, action_id)
        if found is None:
            raise NotFound(f"no action {action_id!r}")
        status, result = found
        return result if result is not None else Pending(action_id=action_id, status=status)  # type: ignore[arg-type]

    async def forward(self, cmd: CloseEnvCmd | CancelCmd) -> Done:
        await self.bus.request(subjects.SCHED_ACTIONS, cmd, timeout=SCHEDULER_TIMEOUT_S)
        return Done()


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Gateway]:
    """The gateway as configured by the environment and ``overrides`` (see runtime.Build),
    given its pool and bus; ``stack`` closes the bus first, then the pool."""
    mesh, cfg = config.load(overrides)
    pool = await db.open_pool(stack, mesh.postgres_dsn)
    bus = await open_bus(stack, mesh.nats_url, "gateway")
    return mesh, Gateway(cfg, bus, pool)
