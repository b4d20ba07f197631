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
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.gateway import config, ownership, quotas_api, services_api, store
from services.gateway.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.formulation import Limits, formulate
from tangram import beats, db, ops_http, subjects, telemetry
from tangram.bus import BaseBus, Server, open_bus
from tangram.config import MeshConfig
from tangram.contract import (
    BATCH_BYTES,
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
    batches,
    encode,
)
from tangram.errors import Busy, InvalidRequest, TangramError, Unavailable
from tangram.runtime import Probe, Service, State

log = logging.getLogger(__name__)

SCHEDULER_TIMEOUT_S = 5.0
# Connections: two held by the intake (a batch one and a one-action one), and room for the
# duplicate lookups, result queries and registrations.
POOL_SIZE = 5
Reply = Accepted | ActionResult | Pending | Done | Services | Quotas | Submitted


class Gateway(Service):
    name = "gateway"

    def __init__(
        self, cfg: GatewayConfig, bus: BaseBus, pool: asyncpg.Pool, heartbeat_s: float = 1.0
    ) -> None:
        super().__init__()
        self.who = beats.identity("gateway")  # its heartbeats (tangram.beats)
        self.heartbeat_s = heartbeat_s
        self.accepted = 0  # actions made durable and handed on (a heartbeat counter)
        self._requests: Server | None = None  # counts the requests taken (served)
        self._owned: Server | None = None  # those of the clients' own subjects
        self._admins: Server | None = None  # those of the admin clients' own subjects
        self.cfg = cfg
        self.bus = bus
        self.pool = pool
        self.limits = Limits(max_cpus=cfg.max_cpus_per_action, max_memory_mb=cfg.max_memory_mb)
        self.quotas = quotas_api.QuotaBook(pool)
        self.intake: db.GroupCommit[store.Owned, store.Intake] = db.GroupCommit(
            self._insert, max_batch=cfg.max_batch
        )
        self._intake_conn = db.Held(pool, db.CUSTOM_PLANS)  # no pool reset per batch
        self._intake_one = db.Held(pool, *db.BY_KEY)  # one action alone (store.insert_one)
        self.claims = store.Claims()  # trajectory claims seen committed: no re-check
        self.admission = Admission(cfg.bounds())
        # Over the bound, is a refused submit's action already durable? One query per batch
        # of refusals, so shedding load does not cost a round trip each.
        self.lookups: db.GroupCommit[str, store.Existing | None] = db.GroupCommit(
            self._lookup, max_batch=cfg.max_batch, name="duplicate-lookup"
        )

    async def _insert(self, batch: Sequence[store.Owned]) -> list[store.Intake]:
        """Make a batch durable, then hand its new actions to the scheduler at once, ahead
        of the replies (one message a batch: a lost one is found by the scheduler's sweep of
        durable queued actions)."""
        if store.one_row(batch, self.claims):
            intakes = await self._intake_one.run(
                lambda conn: store.insert_one(conn, batch[0], self.claims)
            )
        else:
            intakes = await self._intake_conn.run(
                lambda conn: store.insert_actions(conn, batch, self.claims)
            )
        new = [o.action for o, i in zip(batch, intakes, strict=True) if i.new]
        self.accepted += len(new)
        for run in batches(new):
            one = len(run) == 1
            await self._publish(Enqueue(action=run[0]) if one else EnqueueMany(actions=tuple(run)))
        return intakes

    async def _lookup(self, action_ids: Sequence[str]) -> list[store.Existing | None]:
        found = await store.fetch_existing(self.pool, action_ids)
        return [found.get(aid) for aid in action_ids]

    async def on_start(self) -> None:
        db.check_pool(self.pool, POOL_SIZE, "the gateway")
        await self.quotas.load()
        self.intake.start()
        self.lookups.start()
        self.bus.serve(subjects.SCHED_PRESSURE, self.on_pressure, max_in_flight=1)
        self._requests = self.bus.serve(
            subjects.GATEWAY, self.handle_shared, max_in_flight=self.cfg.max_in_flight
        )
        # each client credential on its own subject (the owner of what it asks)
        self._owned = self.bus.serve(
            subjects.GATEWAY_CLIENTS, self.handle, max_in_flight=self.cfg.max_in_flight
        )
        self._admins = self.bus.serve(  # the broker lets admin credentials alone publish here
            subjects.GATEWAY_ADMINS, self.handle_admin, max_in_flight=self.cfg.max_in_flight
        )
        await self.bus.start()
        self.spawn(beats.beating(self.bus, self.who, self.heartbeat_s, self.phase), "beats")

    async def on_stop(self, grace_s: float) -> None:
        """Stop intake and flush it; ``build``'s stack then closes the bus and pool."""
        await self.bus.stop_serving(grace_s)
        await self.intake.close()
        await self.lookups.close()
        await asyncio.gather(self._intake_conn.release(), self._intake_one.release())

    def phase(self) -> beats.Phase:
        """Its heartbeat: serving or draining, and its counters. An idle member (never busy):
        a request may rightly wait long (a registration), its beat says it lives."""
        servers = (self._requests, self._owned, self._admins)
        served = sum(s.served for s in servers if s is not None)
        phase = {State.RUNNING: "serving", State.STOPPING: "draining"}.get(self.state, "starting")
        return beats.Phase(phase, counters={"requests": served, "accepted": self.accepted})

    def dependencies(self) -> dict[str, Probe]:
        return {"bus": ops_http.bus_probe(self.bus), "postgres": ops_http.pool_probe(self.pool)}

    async def handle_shared(self, req: GatewayRequest, msg: Msg) -> Reply:
        """A request on the shared subject: the operator's door, and every client's on a mesh
        without auth (no owner: it sees everything and may change the whole mesh)."""
        with postgres_away():
            return await self._answer(req, "", admin=True)

    # Plain functions handing back _handle's coroutine: no extra coroutine per request.
    def handle(self, req: GatewayRequest, msg: Msg) -> Coroutine[Any, Any, Reply | None]:
        """A request on a client's own subject (see ``ownership``)."""
        return self._handle(req, msg, admin=False)

    def handle_admin(self, req: GatewayRequest, msg: Msg) -> Coroutine[Any, Any, Reply | None]:
        """A request on an admin client's subject (see ``ownership``)."""
        return self._handle(req, msg, admin=True)

    async def _handle(self, req: GatewayRequest, msg: Msg, admin: bool) -> Reply | None:
        owner = ownership.owner_of(msg.subject)  # whose subject it came on (never the message)
        if not ownership.replies_home(msg.reply, owner):
            server = self._admins if admin else self._owned
            if server is not None:  # logged, a few lines a window; nothing is answered
                server.refuse(ownership.stray_reply(msg.reply, owner))
            return None
        with postgres_away():
            return await self._answer(req, owner, admin)

    async def _answer(self, req: GatewayRequest, owner: str, admin: bool = False) -> Reply:
        match req:
            case Submit():
                return await self.submit(req, owner)
            case SubmitMany(items=items):
                answers = await asyncio.gather(*(self._submit_one(one, owner) for one in items))
                return Submitted(items=fitted(answers))
            case GetResult(action_id=action_id):
                return await self.get_result(action_id, owner)
            case CloseEnv(trajectory_id=tid):
                await ownership.check_trajectory(self.pool, owner, tid)
                return await self.forward(CloseEnvCmd(trajectory_id=tid))
            case Cancel(action_id=action_id):
                await ownership.check_action(self.pool, owner, action_id)
                return await self.forward(CancelCmd(action_id=action_id))
            case RegisterService(spec=spec):
                ownership.check_admin(owner, admin, "register a model service")
                timeout_s = self.cfg.register_timeout_s
                return await services_api.register(self.pool, self.bus, spec, timeout_s)
            case ListServices():
                return await services_api.list_services(self.bus)
            case SetQuota(spec=spec):
                ownership.check_admin(owner, admin, "set a quota")
                return await self.quotas.set(self.bus, spec)
            case ListQuotas():
                return await quotas_api.list_quotas(self.bus)
            case ReleaseLease(lease_id=lease_id):
                if not await ownership.owns_lease(self.pool, owner, lease_id):
                    return Done()  # another's lease: as an unknown one, nothing to do
                return await quotas_api.release_lease(self.bus, req)
            case _:
                raise InvalidRequest(f"{type(req).__name__} is not served by this mesh yet")

    async def on_pressure(self, pressure: Pressure, msg: Msg) -> None:
        """The scheduler's report (decoded and bounds-checked by the bus: a garbled one never
        gets here)."""
        self.admission.observe(pressure)

    async def _submit_one(self, req: Submit, owner: str) -> Accepted | ActionResult | ErrorReply:
        """One item of a batch: its answer, or why it alone was refused."""
        try:
            with postgres_away():
                return await self.submit(req, owner)
        except TangramError as exc:
            return exc.to_reply()

    async def submit(self, req: Submit, owner: str = "") -> Accepted | ActionResult:
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
                owner=owner,
            ),
        )
        admitted = self.admission.take(action.submitted_at)  # validated first: a wrong
        # request is told so at once
        if isinstance(admitted, Busy):
            return await self._refuse(req.spec.action_id, admitted, owner)
        new = False
        try:
            intake = await self.intake.submit(store.Owned(action, owner))
            new = intake.new
        finally:  # handed nothing to the scheduler (a duplicate, another's trajectory, a
            if not new:  # failed commit): no report will ever forget it (Admission.void)
                self.admission.void(admitted)
        ownership.check_intake(intake, req.spec.trajectory_id, owner)
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

    async def _refuse(self, action_id: str, busy: Busy, owner: str) -> Accepted | ActionResult:
        """Over the bound: answer an action that is already durable (a retry whose reply was
        lost must learn it was accepted), refuse anything else (another client's too)."""
        found = await self.lookups.submit(action_id)
        if found is None or not ownership.may_see(owner, found.owner):
            raise busy
        return found.result or Accepted(
            action_id=action_id,
            duplicate=True,
            status=found.status,  # type: ignore[arg-type]
        )

    async def get_result(self, action_id: str, owner: str = "") -> ActionResult | Pending:
        found = await store.fetch_result(self.pool, action_id)
        if found is None or not ownership.may_see(owner, found.owner):
            raise ownership.no_action(action_id, owner)  # another's: as if it did not exist
        if found.result is not None:
            return found.result
        return Pending(action_id=action_id, status=found.status)  # type: ignore[arg-type]

    async def forward(self, cmd: CloseEnvCmd | CancelCmd) -> Done:
        await self.bus.request(subjects.SCHED_ACTIONS, cmd, timeout=SCHEDULER_TIMEOUT_S)
        return Done()


def fitted(
    answers: Sequence[Accepted | ActionResult | ErrorReply],
) -> tuple[Accepted | ActionResult | ErrorReply, ...]:
    """A batch's answers in one reply the broker carries: the stored results of finished
    duplicates (up to ~512 KiB each) inline while they fit ``BATCH_BYTES`` together, the rest
    as duplicates with their status, which the client then asks for one at a time. Inline,
    a replayed batch of finished actions went over the broker's max payload, and no answer at
    all came back. New actions (``Accepted``) cost an ``isinstance`` each."""
    room = BATCH_BYTES
    out: list[Accepted | ActionResult | ErrorReply] = []
    for answer in answers:
        if isinstance(answer, ActionResult):
            size = len(encode(answer))
            if size > room:
                status = answer.status
                answer = Accepted(action_id=answer.action_id, duplicate=True, status=status)
            else:
                room -= size
        out.append(answer)
    return tuple(out)


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
    pool = await db.open_pool(stack, mesh.postgres_dsn, max_size=POOL_SIZE)
    bus = await open_bus(stack, mesh.nats_url, "gateway")
    return mesh, Gateway(cfg, bus, pool, heartbeat_s=mesh.heartbeat_s)
