"""The gateway shell: the only door for clients.

Decodes every request, formulates actions, makes them durable (group commit) before it
acknowledges, hands them to the scheduler, and answers result queries from Postgres.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.gateway import store
from services.gateway.config import GatewayConfig
from services.gateway.formulation import Limits, formulate
from tangram import db, subjects, telemetry
from tangram.bus import Bus
from tangram.config import MeshConfig
from tangram.contract import (
    Accepted,
    Ack,
    Cancel,
    CancelCmd,
    CloseEnv,
    CloseEnvCmd,
    Done,
    Enqueue,
    GatewayRequest,
    GetResult,
    Pending,
    Submit,
    UnifiedAction,
)
from tangram.errors import NotFound
from tangram.runtime import Service

log = logging.getLogger(__name__)

SCHEDULER_TIMEOUT_S = 5.0


class Gateway(Service):
    name = "gateway"

    def __init__(self, mesh: MeshConfig, cfg: GatewayConfig) -> None:
        super().__init__()
        self.mesh = mesh
        self.cfg = cfg
        self.limits = Limits(max_cpus=cfg.max_cpus_per_action, max_memory_mb=cfg.max_memory_mb)
        self.bus: Bus | None = None
        self.pool: asyncpg.Pool | None = None
        self.intake: db.GroupCommit[UnifiedAction, store.Intake] | None = None

    async def on_start(self) -> None:
        self.pool = await db.connect(self.mesh.postgres_dsn, max_size=4)
        await db.migrate(self.pool)
        pool = self.pool
        self.intake = db.GroupCommit(
            lambda batch: store.insert_actions(pool, batch), max_batch=self.cfg.max_batch
        )
        self.intake.start()
        self.bus = await Bus.connect(self.mesh.nats_url, "gateway")
        self.bus.serve(
            subjects.GATEWAY,
            GatewayRequest,
            self.handle,
            queue=subjects.GATEWAY_QUEUE,
            max_in_flight=self.cfg.max_in_flight,
        )
        await self.bus.start()

    async def on_stop(self, grace_s: float) -> None:
        if self.bus is not None:
            await self.bus.stop_serving(grace_s)
        if self.intake is not None:
            await self.intake.close()
        if self.bus is not None:
            await self.bus.close()
        if self.pool is not None:
            await self.pool.close()

    async def handle(self, req: Any, msg: Msg) -> Any:
        match req:
            case Submit():
                return await self.submit(req)
            case GetResult(action_id=action_id):
                return await self.get_result(action_id)
            case CloseEnv(trajectory_id=tid):
                return await self.forward(CloseEnvCmd(trajectory_id=tid))
            case Cancel(action_id=action_id):
                return await self.forward(CancelCmd(action_id=action_id))

    async def submit(self, req: Submit) -> Any:
        assert self.intake is not None
        assert self.bus is not None
        action = formulate(
            req.spec,
            now=time.time(),
            limits=self.limits,
            reply_subject=req.reply_subject or "",
            traceparent=telemetry.current_traceparent(),
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

    async def get_result(self, action_id: str) -> Any:
        assert self.pool is not None
        found = await store.fetch_result(self.pool, action_id)
        if found is None:
            raise NotFound(f"no action {action_id!r}")
        status, result = found
        return result if result is not None else Pending(action_id=action_id, status=status)  # type: ignore[arg-type]

    async def forward(self, cmd: Any) -> Done:
        assert self.bus is not None
        await self.bus.request(subjects.SCHED_ACTIONS, cmd, Ack, timeout=SCHEDULER_TIMEOUT_S)
        return Done()
