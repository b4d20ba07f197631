"""The scheduler shell: feeds NATS events and time into the pure core and carries out its effects.

Ordering: every handler changes the core synchronously before its first ``await``, so the core
sees events in arrival order, and queues its node commands before that ``await`` too, so they
leave in the order the core decided them. Durability: two durable group-commit writers retry a
failed batch until it commits. A dispatch is sent only once its ``started`` record is committed
(a restarted scheduler never rebuilds as queued an action a node may run). Results are pushed to
clients at once; a node's completion (and a client's cancel of a queued action) is acked only
after the terminal record is committed, so a crash in between makes the sender re-send it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import asyncpg
import msgspec
from nats.aio.msg import Msg
from prometheus_client.metrics_core import Metric

from services.scheduler import config, gauges, gpu_shell, pressure, quota_store, store
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.effects import (
    DropEnvOnNode,
    Effect,
    EnvChanged,
    Finish,
    KillOnNode,
    PrepareOnNode,
    ServiceSettled,
    StartOnNode,
    verdict,
)
from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.quota_books import ask_of
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.core.status import status_reply
from services.scheduler.core.validate import problem
from services.scheduler.health import Monitor
from services.scheduler.leadership import Lead
from services.scheduler.outbox import Outbox
from services.scheduler.policies.spec import make_policy
from tangram import auth, beats, db, metrics, ops_http, subjects
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig
from tangram.contract import (
    Ack,
    CancelCmd,
    CloseEnvCmd,
    Completion,
    Completions,
    Enqueue,
    EnqueueMany,
    EnvExpired,
    ErrorKind,
    LeaseEnd,
    NodeLeaving,
    NodeMessage,
    NodeReport,
    QuotaCmd,
    Reconcile,
    Resources,
    ResourcesQuery,
    SchedulerRequest,
    SchedulerStatus,
    ServiceCmd,
    Services,
    ServiceSpec,
    StatusQuery,
    UnifiedAction,
    batches,
)
from tangram.errors import InvalidRequest, TangramError
from tangram.runtime import Probe, Service, State

log = logging.getLogger(__name__)

# Connections: four held by the writers (a batch one and a one-record one each), and room for
# the sweeps, the health detector's writes, registrations and the readiness probe.
POOL_SIZE = 6

WRITE_RETRY = db.Backoff(first_s=0.02, max_s=2.0)


class Scheduler(Service):
    name = "scheduler"

    def __init__(
        self,
        cfg: SchedulerConfig,
        bus: BaseBus,
        pool: asyncpg.Pool,
        clock: Callable[[], float] = time.time,
        session: str = "",
        lead: Lead | None = None,
        heartbeat_s: float = 1.0,
        who: beats.Identity | None = None,
    ) -> None:
        super().__init__()
        self.who = who or beats.identity("scheduler")  # its heartbeats (tangram.beats)
        self.heartbeat_s = heartbeat_s
        self.passes = 0  # scheduling passes so far (a heartbeat counter)
        self.received_up_to = 0.0  # newest submitted_at received (the gateways' admission)
        self._gauge: pressure.Gauge | None = None  # made by the tick loop
        self._pressure_at = 0.0  # when it was last published
        self.session = session  # this scheduler's Postgres session name (see store.fence)
        self.lead = lead  # held (see leadership); watched while this scheduler serves
        self.cfg = cfg
        self.bus = bus
        self.pool = pool
        self.clock = clock
        self.core = SchedulerCore(make_policy(cfg.policy_spec()), cfg.core)
        self.quotas = QuotaCore(cfg.quota_config())  # http and lease actions
        self.epoch = 0
        self.health = Monitor(cfg.health, self.core, self.quotas, bus, pool, clock, self.apply)
        # Node reports, not the started row, say whether an action started, so its commit need
        # not wait for the WAL flush; the terminal one always does.
        # Each writer holds two connections: batches planned afresh each time, one record
        # alone by its key (store.write_one).
        async_commit = "SET synchronous_commit = off"
        self._conns = (
            db.Held(pool, db.CUSTOM_PLANS, async_commit),
            db.Held(pool, *db.BY_KEY, async_commit),
            db.Held(pool, db.CUSTOM_PLANS),
            db.Held(pool, *db.BY_KEY),
        )
        self.starts = self._writer("started-writer", *self._conns[:2])
        self.records = self._writer("record-writer", *self._conns[2:])  # terminal and envs
        self.pending: dict[str, asyncio.Future[None]] = {}  # finish records not yet committed
        self.outbox = Outbox(bus, self._still_assigned)  # node commands, in the core's order
        self._dirty = asyncio.Event()
        self.registrations = gpu_shell.Registrations()
        self.prefetch = gpu_shell.PrefetchHints()
        self._waits_logged: dict[str, str] = {}  # the placement waits already logged
        self._quota_wake: asyncio.TimerHandle | None = None  # see _arm_quota_wake
        self._refused: list[tuple[UnifiedAction, str]] = []  # to end invalid_request
        self._judging: asyncio.Task[None] | None = None  # the health monitor's loop
        # the gateways' and schedulers' heartbeats, for the status answer
        self.beats = beats.Listener(beats.Book(cfg.health.silent_s, cfg.health.suspect_s), clock)

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        db.check_pool(self.pool, POOL_SIZE, "the scheduler")
        if self.session:
            ended = await store.fence(self.pool, self.session)
            if ended:
                log.warning("ended %d Postgres sessions of a previous scheduler", ended)
        self.epoch = self.core.epoch = self.quotas.epoch = await store.take_lead(self.pool)
        if self.lead is not None:  # lost, it stops this scheduler (Deposed)
            self.spawn(self.lead.watch(self.epoch), "lead")
        self.core.restore_services(await gpu_shell.load_services(self.pool))
        await self._rebuild()
        await self.health.restore()  # incarnations fenced before: refused from the start
        for writer, name in ((self.starts, "started-writer"), (self.records, "record-writer")):
            writer.start()
            self.spawn(writer.join(), name)  # a writer that stops on an error stops the service
        await self._end_refused()  # rows rebuilt that the core could not read
        self.bus.serve(subjects.SCHED_ACTIONS, self.on_action, max_in_flight=100_000)
        self.bus.serve(subjects.SCHED_NODES, self.on_node, max_in_flight=100_000)
        self.bus.serve(subjects.SCHED_STATUS, self.on_status, max_in_flight=1024)
        self.beats.serve(self.bus)
        serving_from = self.clock()  # hand-offs from now on reach this scheduler
        await self.bus.start()
        self.core.hold_until(self.clock() + self.cfg.reconcile_grace_s)
        await self.bus.publish(subjects.NODES_BROADCAST, Reconcile(epoch=self.epoch))
        self.outbox.epoch = self.epoch
        self.spawn(self.outbox.run(), "commands")
        self.spawn(self._decide_loop(), "decide")
        self.spawn(self._tick_loop(), "tick")
        self.spawn(self._sweep_loop(serving_from), "sweep")
        self._judging = self.spawn(self.health.run(), "health")
        self.spawn(beats.beating(self.bus, self.who, self.heartbeat_s, self.phase), "beats")
        log.info("scheduler epoch %d up, policy %s", self.epoch, self.core.policy.name)

    async def on_stop(self, grace_s: float) -> None:
        """Stop judging agents and intake, flush the writers; ``build``'s stack then closes the
        bus and pool. Judging stops first: the agents' reports stop coming with intake, and
        their silence would have live agents failed (health_events: fenced for the next leader)."""
        if self._judging is not None:
            self._judging.cancel()
            await asyncio.wait([self._judging])
        await self.bus.stop_serving(grace_s)
        await asyncio.gather(*(w.close(grace_s) for w in (self.starts, self.records)))
        await asyncio.gather(*(conn.release() for conn in self._conns))

    def dependencies(self) -> dict[str, Probe]:
        return {"bus": ops_http.bus_probe(self.bus), "postgres": ops_http.pool_probe(self.pool)}

    def phase(self) -> beats.Phase:
        """Its heartbeat: leading (with its epoch) or stopping, busy while it holds actions;
        passes move every tick, so a busy leader whose counters stand still is stuck."""
        counters = {
            "passes": self.passes,
            "dispatches": self.core.issued + self.quotas.issued,
            "completions": self.core.finished + self.quotas.finished,
        }
        phase = "leading" if self.state is not State.STOPPING else "stopping"
        busy = bool(self.core.queue or self.core.running)
        return beats.Phase(phase, epoch=self.epoch, busy=busy, counters=counters)

    def collect(self) -> list[Metric]:
        return gauges.families(self.core, self.quotas, self.clock())

    async def _rebuild(self) -> None:
        """Rebuild the books from Postgres; node reports confirm them (see core)."""
        envs, gone = await store.load_envs(self.pool)
        for env in envs:
            self.core.restore_env(env)
        self.core.gone_envs.update(gone)
        now = self.clock()
        await quota_store.rebuild(self.pool, self.quotas, now)
        for row in await store.load_open(self.pool):
            if (why := problem(row.action)) is not None:  # ended once the writers run
                self._refused.append((row.action, why))
            elif ask_of(row.action) is not None:
                self._restore_quota(row, now)
            elif row.status == "running" and row.node_id and row.incarnation:
                self.core.restore_running(row.action, row.node_id, row.incarnation, row.cores, now)
            else:
                self.core.enqueue(row.action, now)
        log.info("rebuilt: %s", self.core.snapshot())

    def _restore_quota(self, row: store.OpenAction, now: float) -> None:
        if row.status == "running" and row.node_id and row.incarnation:
            self.quotas.restore_call(row.action, row.node_id, row.incarnation, now)
        else:
            self.quotas.enqueue(row.action, now)

    def _enqueue(self, action: UnifiedAction, now: float) -> str | None:
        """An http or lease action goes to the quota core, any other to the node core; one
        the core could not read is refused (see core.validate): why, or None. A refused one
        is durable already (the gateway committed it): it is ended ``invalid_request`` at the
        next :meth:`_end_refused`, so it reaches a terminal state like any other."""
        why = problem(action)
        if why is not None:
            log.warning("refused an enqueued action: %s", why)
            self._refused.append((action, why))
            return why
        core = self.quotas if ask_of(action) is not None else self.core
        core.enqueue(action, now)
        self.received_up_to = max(self.received_up_to, action.submitted_at)
        return None

    async def _end_refused(self) -> None:
        """End the actions refused since the last call ``invalid_request`` (recorded, and
        pushed to their clients, like any finished action)."""
        refused, self._refused = self._refused, []
        now = self.clock()
        for action, why in refused:
            result = verdict(action, ErrorKind.INVALID_REQUEST, why, now=now)
            await self.apply(self.core.finish(action, result))

    def _writer(self, name: str, conn: db.Held, one: db.Held) -> db.GroupCommit[store.Record, None]:
        """A durable writer on its own held connections (started with the service)."""
        return db.GroupCommit(
            partial(self._write, conn, one), max_batch=1024, retry=WRITE_RETRY, name=name
        )

    async def _write(
        self, conn: db.Held, one: db.Held, batch: Sequence[store.Record]
    ) -> list[None]:
        now = self.clock()
        record = store.alone(batch)
        if record is not None:
            return await one.run(lambda c: store.write_one(c, record, now, self.epoch))
        return await conn.run(lambda c: store.write(c, batch, now, self.epoch))

    # ------------------------------------------------------------------ handlers

    async def on_action(self, req: SchedulerRequest, msg: Msg) -> Ack | Services | None:
        """What changes the books (the gateway's); questions are asked on SCHED_STATUS, and
        refused here by type (not in SchedulerRequest: an ``invalid_request`` reply)."""
        now = self.clock()
        match req:
            case Enqueue() | EnqueueMany():
                actions = (req.action,) if isinstance(req, Enqueue) else req.actions
                refused = [why for a in actions if (why := self._enqueue(a, now)) is not None]
                self._dirty.set()
                await self._report_intake(now)
                if refused:
                    await self._end_refused()
                    raise InvalidRequest("; ".join(refused[:3]))
                return None
            case CloseEnvCmd(trajectory_id=tid):
                effects = self.core.close_env(tid, now)
                await self.apply(effects)
                await self._recorded([e.result.action_id for e in effects if isinstance(e, Finish)])
            case CancelCmd(action_id=aid):
                owner = self.quotas if self.quotas.owns(aid) else self.core
                await self.apply(owner.cancel(aid, now))
                await self._recorded([aid])
            case ServiceCmd(spec=spec):
                return await self._register(spec, now)
            case QuotaCmd(spec=spec):
                self.quotas.set_quota(spec, now)
            case LeaseEnd():
                self.quotas.lease_end(req, now)
        self._dirty.set()
        return Ack()

    async def on_status(
        self, req: StatusQuery | ResourcesQuery, msg: Msg
    ) -> SchedulerStatus | Resources:
        """The read-only questions (the dashboard's, ``tangram status``, readiness)."""
        now = self.clock()
        if isinstance(req, StatusQuery):
            st = self.health.annotate(status_reply(self.core, self.epoch, now, self.quotas), now)
            return msgspec.structs.replace(st, service_rows=self.beats.rows())
        return Resources(services=self.core.service_states(), quotas=self.quotas.states(now))

    async def _register(self, spec: ServiceSpec, now: float) -> Services:
        """Have every GPU node prepare ``spec``; answer when each has reported it (bounded)."""
        answer = self.registrations.wait(spec.name)
        await self.apply(self.core.register_service(spec, now))
        self._dirty.set()  # queued calls to it may run now
        return await answer

    async def on_node(self, req: NodeMessage, msg: Msg) -> Ack:
        auth.check_sender(req, msg.subject)  # one node not for another
        now = self.clock()
        match req:
            case Completion():
                return await self._completions((req,), now)
            case Completions(items=items):
                return await self._completions(items, now)
            case NodeReport():
                ack = self.health.report(req, self.epoch)  # raises Fenced for a failed one
                core = self.quotas if req.inventory.kind == "quota" else self.core
                await self.apply(core.node_report(req, now))
                self._dirty.set()
                return ack
            case EnvExpired(node_id=node_id, trajectory_id=tid):
                await self.apply(self.core.env_expired(node_id, tid))
            case NodeLeaving(node_id=node_id, incarnation=inc, draining=draining):
                log.info("node %s (%s) is %s", node_id, inc, "draining" if draining else "gone")
                if not draining:
                    self.health.left(node_id, inc)
                await self.apply(
                    self.core.node_leaving(req, now) + self.quotas.node_leaving(req, now)
                )
        self._dirty.set()
        return Ack()

    async def _completions(self, items: tuple[Completion, ...], now: float) -> Ack:
        """Completions (one, or several that ended together): applied in order, acked once
        every terminal record is committed (a duplicate waits too: ack only what is
        committed)."""
        effects: list[Effect] = []
        for c in items:
            owner = self.quotas if self.quotas.owns(c.action_id) else self.core
            effects += owner.complete(c, now)
        self._dirty.set()
        await self.apply(effects)
        await self._recorded([c.action_id for c in items])
        return Ack()

    async def _recorded(self, action_ids: list[str]) -> None:
        """Wait until these actions' terminal records are committed (raises if they cannot be)."""
        for aid in action_ids:
            pending = self.pending.get(aid)
            if pending is not None:
                await asyncio.shield(pending)

    # ------------------------------------------------------------------ effects

    async def apply(self, effects: list[Effect]) -> None:
        """Record the effects and queue node commands (before any ``await``), then push results:
        one message per client for the results of one pass."""
        for e in effects:
            self._queue(e)
        by_client: dict[str, list[Finish]] = {}
        for e in effects:
            if isinstance(e, Finish) and e.action.reply_subject:
                by_client.setdefault(e.action.reply_subject, []).append(e)
        for subject, done in by_client.items():
            await self._push(subject, done)

    async def _push(self, subject: str, done: list[Finish]) -> None:
        """Push results to their client (a lone one with its trace context, several as a
        list); if the broker is away the client asks the gateway."""
        try:
            traces = {f.result.action_id: f.action.traceparent for f in done}
            for run in batches([f.result for f in done]):
                if len(run) > 1:
                    await self.bus.publish(subjects.result_push(subject), run)
                else:
                    trace = traces[run[0].action_id]
                    await self.bus.publish(subjects.result_push(subject), run[0], traceparent=trace)
        except TangramError as exc:
            log.info("results of %s not pushed: %s", [f.result.action_id for f in done], exc)

    def _queue(self, e: Effect) -> None:
        match e:
            case StartOnNode():
                started = self.starts.enqueue(store.Started(e, self.clock()))
                self.outbox.put(e, started)
            case KillOnNode() | DropEnvOnNode() | PrepareOnNode():
                self.outbox.put(e)
            case ServiceSettled():
                self.registrations.settle(e)
            case Finish():
                self._finish(e)
            case EnvChanged():
                self.records.enqueue(e)

    def _finish(self, e: Finish) -> None:
        aid = e.result.action_id
        metrics.action_ended(e.action, e.result)
        fut = self.records.enqueue(e)
        self.pending[aid] = fut
        fut.add_done_callback(partial(self._forget, aid))

    def _forget(self, aid: str, fut: asyncio.Future[None]) -> None:
        """A committed record needs no more waiting; a failed one keeps failing every resend."""
        if not fut.cancelled() and fut.exception() is None and self.pending.get(aid) is fut:
            del self.pending[aid]

    def _still_assigned(self, e: StartOnNode) -> bool:
        """While its record committed, the attempt may have been redone or its node lost."""
        if self.quotas.owns(e.action.spec.action_id):
            return self.quotas.still_assigned(e.action.spec.action_id, e.node_id, e.action.attempt)
        run = self.core.running.get(e.action.spec.action_id)
        return (
            run is not None and run.node_id == e.node_id and run.action.attempt == e.action.attempt
        )

    # ------------------------------------------------------------------ loops

    async def _decide_loop(self) -> None:
        """Coalesce events into scheduling passes."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            self.passes += 1
            now = self.clock()
            await self.apply(self.core.schedule(now) + self.quotas.schedule(now))
            await self.prefetch.after_pass(self.bus, self.core, self.epoch)
            self._arm_quota_wake(self.clock())
            self._log_waits()
            await asyncio.sleep(0)  # let a burst of arrivals join the next pass

    def _log_waits(self) -> None:
        """Say once per action why it cannot be placed (memory, cores): never a silent wait."""
        for aid, why in self.core.waits.items():
            if self._waits_logged.get(aid) != why:
                log.warning("action %s cannot be placed: %s", aid, why)
        self._waits_logged = dict(self.core.waits)

    async def _tick_loop(self) -> None:
        self._gauge = pressure.Gauge(self.bus, self.epoch)  # the gateways' admission control
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            now = self.clock()
            await self.apply(self.core.tick(now) + self.quotas.tick(now))
            await self._publish_pressure(now)
            self._dirty.set()

    async def _report_intake(self, now: float) -> None:
        """Between ticks too, after new actions arrive (at most every ``PRESSURE_MIN_S``): a
        gateway counts its admissions the scheduler has not received yet against its bound,
        and at ~1,800 short actions a second a tick's worth of them (0.25 s) came near the
        512 floor while 64 were open."""
        if self._gauge is not None and now - self._pressure_at >= pressure.PRESSURE_MIN_S:
            await self._publish_pressure(now)

    async def _publish_pressure(self, now: float) -> None:
        assert self._gauge is not None
        self._pressure_at = now
        await self._gauge.publish(self.core, self.quotas, now, self.received_up_to)

    def _arm_quota_wake(self, now: float) -> None:
        """Wake the decide loop when a rate window next lets a waiting quota call go (between
        ticks: a per-second quota is not held to the tick's pace). Re-armed after every pass:
        a call's report moves that time (its window entry is re-timed to its send)."""
        if self._quota_wake is not None:
            self._quota_wake.cancel()
        at = self.quotas.next_at(now)
        self._quota_wake = (
            None
            if at is None
            else asyncio.get_running_loop().call_later(max(0.0, at - now), self._dirty.set)
        )

    def _known(self, action_id: str) -> bool:
        return self.core.known(action_id) or self.quotas.known(action_id)

    def _in_hand(self, action_id: str) -> bool:
        """Known to a core, or ended with its terminal record not yet committed."""
        return self._known(action_id) or action_id in self.pending

    async def _sweep_loop(self, serving_from: float) -> None:
        """Pick up durable actions whose hand-off from the gateway was lost: at once those
        submitted before this scheduler served (accepted while no one led, or handed to the
        scheduler it replaced, after the rebuild read the queue), then every ``sweep_s`` those
        queued for longer than that (a hand-off may still be on its way)."""
        await self._sweep(serving_from)
        while True:
            await asyncio.sleep(self.cfg.sweep_s)
            await self._sweep(self.clock() - self.cfg.sweep_s)

    async def _sweep(self, older_than: float) -> None:
        load = partial(store.load_open, self.pool, older_than=older_than)
        rows = await db.retrying(load, what="sweep")
        fresh = [r for r in rows if not self._in_hand(r.action.spec.action_id)]
        for row in fresh:
            self._enqueue(row.action, self.clock())
        await self._end_refused()
        if fresh:
            log.info("sweep picked up %d queued actions", len(fresh))
            self._dirty.set()


def _warm(mesh: MeshConfig, cfg: SchedulerConfig) -> None:
    """Do before waiting as a standby what costs time and needs no lead: compile the policy's
    kernels (0.86 s the first time here, nothing after: numba keeps them per process) and import
    what the runtime imports once the service is built. Done after the lock, they took most of a
    takeover's 1.5-1.8 s on this 2-core machine under load."""
    make_policy(cfg.policy_spec())
    importlib.import_module("tangram.ops_http")
    if mesh.otel_endpoint:
        importlib.import_module("opentelemetry.exporter.otlp.proto.http.trace_exporter")


class _Standby(Service):
    """What the ops endpoint shows of a scheduler waiting for the lead: alive, not ready."""

    name = "scheduler"


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Scheduler]:
    """The scheduler as configured by the environment and ``overrides`` (see runtime.Build),
    given its pool and bus; ``stack`` closes the bus first, then the pool."""
    mesh, cfg = config.load(overrides)
    _warm(mesh, cfg)
    # A standby waits here, before it opens its pool and bus; the lock is let go last. Meanwhile
    # its ops endpoint answers (/healthz 200, /readyz 503 "new"), so a liveness probe leaves it
    # be; the leader's endpoint replaces it on the same port.
    # It beats "standby" meanwhile, on a connection of its own (tangram.beats).
    who = beats.identity("scheduler")
    async with (
        ops_http.serving(_Standby(), mesh.ops_host, mesh.ops_port),
        beats.standby(mesh.nats_url, who, mesh.heartbeat_s),
    ):
        lead = await stack.enter_async_context(Lead(mesh.postgres_dsn, cfg.lead_config()))
    session = f"{store.SESSIONS} {uuid.uuid4().hex[:12]}"
    pool = await db.open_pool(stack, mesh.postgres_dsn, max_size=POOL_SIZE, name=session)
    bus = await open_bus(stack, mesh.nats_url, "scheduler")
    beat_s = mesh.heartbeat_s
    return mesh, Scheduler(cfg, bus, pool, session=session, lead=lead, heartbeat_s=beat_s, who=who)
