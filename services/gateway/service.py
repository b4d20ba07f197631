"""The gateway shell: the only door for clients.

Decodes every request, formulates actions, makes them durable (group commit) before it
acknowledges, hands them to the scheduler, and answers result queries from Postgres. While the
mesh's backlog is over its bound (admission.py, fed by the scheduler's pressure reports) a new
submit is refused with ``busy``; an action already durable is still answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.gateway import config, quotas_api, services_api, store
from services.gateway.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.formulation import Limits, formulate
from tangram import db, ops_http, subjects, telemetry
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
    EnqueueMany,
    ErrorReply,
    GatewayRequest,
    GetResult,
    ListQuotas,
    ListServices,
    Pending,
    Pressure,
    Quotas,
    RegisterService,
    ReleaseLease,
    Services,
    SetQuota,
    Submit,
    SubmitMany,
    Submitted,
    UnifiedAction,
    batches,
)
from tangram.errors import Busy, InvalidRequest, NotFound, TangramError, Unavailable
from tangram.runtime import Probe, Service

log = logging.getLogger(__name__)

SCHEDULER_TIMEOUT_S = 5.0
Reply = Accepted | ActionResult | Pending | Done | Services | Quotas | Submitted


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
        self._intake_conn = db.Held(pool, db.CUSTOM_PLANS)  # no pool reset per batch
        self.admission = Admission(cfg.bounds())
        # Over the bound, is a refused submit's action already durable? One query per batch
        # of refusals, so shedding load does not cost a round trip each.
        self.lookups: db.GroupCommit[str, store.Existing | None] = db.GroupCommit(
            self._lookup, max_batch=cfg.max_batch, name="duplicate-lookup"
        )

    async def _insert(self, batch: Sequence[UnifiedAction]) -> list[store.Intake]:
        """Make a batch durable, then hand its new actions to the scheduler at once, ahead
        of the replies (one message a batch: a lost one is found by the scheduler's sweep of
        durable queued actions)."""
        intakes = await self._intake_conn.run(lambda conn: store.insert_actions(conn, batch))
        new = [a for a, i in zip(batch, intakes, strict=True) if not i.duplicate]
        for run in batches(new):
            one = len(run) == 1
            await self._publish(Enqueue(action=run[0]) if one else EnqueueMany(actions=tuple(run)))
        return intakes

    async def _lookup(self, action_ids: Sequence[str]) -> list[store.Existing | None]:
        found = await store.fetch_existing(self.pool, action_ids)
        return [found.get(aid) for aid in action_ids]

    async def on_start(self) -> None:
        await self.quotas.load()
        self.intake.start()
        self.lookups.start()
        self.bus.serve(subjects.SCHED_PRESSURE, self.on_pressure, max_in_flight=1)
        self.bus.serve(subjects.GATEWAY, self.handle, max_in_flight=self.cfg.max_in_flight)
        await self.bus.start()

    async def on_stop(self, grace_s: float) -> None:
        """Stop intake and flush it; ``build``'s stack then closes the bus and pool."""
        await self.bus.stop_serving(grace_s)
        await self.intake.close()
        await self.lookups.close()
        await self._intake_conn.release()

    def dependencies(self) -> dict[str, Probe]:
        return {"bus": ops_http.bus_probe(self.bus), "postgres": ops_http.pool_probe(self.pool)}

    async def handle(self, req: GatewayRequest, msg: Msg) -> Reply:
        with postgres_away():
            return await self._answer(req)

    async def _answer(self, req: GatewayRequest) -> Reply:
        match req:
            case Submit():
                return await self.submit(req)
            case SubmitMany(items=items):
                answers = await asyncio.gather(*(self._submit_one(one) for one in items))
                return Submitted(items=tuple(answers))
            case GetResult(action_id=action_id):
                return await self.get_result(action_id)
            case CloseEnv(trajectory_id=tid):
                return await self.forward(CloseEnvCmd(trajectory_id=tid))
            case Cancel(action_id=action_id):
                return await self.forward(CancelCmd(action_id=action_id))
            case RegisterService(spec=spec):
                timeout_s = self.cfg.register_timeout_s
                return await services_api.register(self.pool, self.bus, spec, timeout_s)
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

    async def on_pressure(self, pressure: Pressure, msg: Msg) -> None:
        """The scheduler's report (decoded and bounds-checked by the bus: a garbled one never
        gets here)."""
        self.admission.observe(pressure)

    async def _submit_one(self, req: Submit) -> Accepted | ActionResult | ErrorReply:
        """One item of a batch: its answer, or why it alone was refused."""
        try:
            with postgres_away():
                return await self.submit(req)
        except TangramError as exc:
            return exc.to_reply()

    async def submit(self, req: Submit) -> Accepted | ActionResult:
        now, traceparent = time.time(), telemetry.current_traceparent()
        action = await self.quotas.formulated(
            req.spec,
            lambda quotas: formulate(
                req.spec,
                now=now,
                limits=self.limits,
                reply_subject=req.reply_subject or "",
                traceparent=traceparent,
                quotas=quotas,
            ),
        )
        busy = self.admission.admit()  # validated first: a wrong request is told so at once
        if busy is not None:
            return await self._refuse(req.spec.action_id, busy)
        intake = await self.intake.submit(action)
        if intake.duplicate:
            return intake.result or Accepted(
                action_id=intake.action_id,
                duplicate=True,
                status=intake.status,  # type: ignore[arg-type]
            )
        return Accepted(action_id=intake.action_id)

    async def _publish(self, msg: Enqueue | EnqueueMany) -> None:
        try:
            await self.bus.publish(subjects.SCHED_ACTIONS, msg)
        except TangramError as exc:
            log.warning("hand-off to the scheduler failed (its sweep will find them): %s", exc)
        except Exception:  # a bug: the sweep still finds them; say so loudly
            log.exception("hand-off to the scheduler failed (its sweep will find them)")

    async def _refuse(self, action_id: str, busy: Busy) -> Accepted | ActionResult:
        """Over the bound: answer an action that is already durable (a retry whose reply was
        lost must learn it was accepted), refuse anything else."""
        found = await self.lookups.submit(action_id)
        if found is None:
            raise busy
        return found.result or Accepted(
            action_id=action_id,
            duplicate=True,
            status=found.status,  # type: ignore[arg-type]
        )

    async def get_result(self, action_id: str) -> ActionResult | Pending:
        found = await store.fetch_result(self.pool, action_id)
        if found is None:
            raise NotFound(f"no action {action_id!r}")
        status, result = found
        return result if result is not None else Pending(action_id=action_id, status=status)  # type: ignore[arg-type]

    async def forward(self, cmd: CloseEnvCmd | CancelCmd) -> Done:
        await self.bus.request(subjects.SCHED_ACTIONS, cmd, timeout=SCHEDULER_TIMEOUT_S)
        return Done()


@contextlib.contextmanager
def postgres_away() -> Iterator[None]:
    """Postgres unreachable or restarting (a read that met the outage, not a write of the
    group commit, which says so itself) is ``unavailable``, which clients retry; not an
    internal error, which they would take as final."""
    try:
        yield
    except TangramError:
        raise
    except Exception as exc:
        if not db.transient(exc):
            raise
        raise Unavailable(f"the mesh's database is unavailable ({exc!r}); retry") from exc


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Gateway]:
    """The gateway as configured by the environment and ``overrides`` (see runtime.Build),
    given its pool and bus; ``stack`` closes the bus first, then the pool."""
    mesh, cfg = config.load(overrides)
    pool = await db.open_pool(stack, mesh.postgres_dsn)
    bus = await open_bus(stack, mesh.nats_url, "gateway")
    return mesh, Gateway(cfg, bus, pool)
