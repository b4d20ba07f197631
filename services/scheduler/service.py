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
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.scheduler import config, store
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.effects import (
    DropEnvOnNode,
    Effect,
    EnvChanged,
    Finish,
    KillOnNode,
    StartOnNode,
)
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.policies.spec import make_policy
from tangram import db, subjects
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig
from tangram.contract import (
    Ack,
    CancelCmd,
    CloseEnvCmd,
    Completion,
    Dispatch,
    DropEnv,
    Enqueue,
    EnvExpired,
    Kill,
    NodeLeaving,
    NodeMessage,
    NodeReport,
    Reconcile,
    SchedulerRequest,
    SchedulerStatus,
    StatusQuery,
)
from tangram.errors import TangramError
from tangram.runtime import Service

log = logging.getLogger(__name__)

WRITE_RETRY = db.Backoff(first_s=0.02, max_s=2.0)
NodeEffect = StartOnNode | KillOnNode | DropEnvOnNode


@dataclass(frozen=True, slots=True)
class _Command:
    """A message for a node agent; a dispatch leaves only once its ``started`` record is durable."""

    effect: NodeEffect
    recorded: asyncio.Future[None] | None = None


class Scheduler(Service):
    name = "scheduler"

    def __init__(
        self,
        cfg: SchedulerConfig,
        bus: BaseBus,
        pool: asyncpg.Pool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.bus = bus
        self.pool = pool
        self.clock = clock
        self.core = SchedulerCore(make_policy(cfg.policy_spec()), cfg.core)
        self.epoch = 0
        self.starts = self._writer("started-writer")  # synchronous_commit off
        self.records = self._writer("record-writer")  # terminal and env records
        self.pending: dict[str, asyncio.Future[None]] = {}  # finish records not yet committed
        self._commands: asyncio.Queue[_Command] = asyncio.Queue()
        self._dirty = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        self.epoch = await store.next_epoch(self.pool)
        await self._rebuild()
        for writer, name in ((self.starts, "started-writer"), (self.records, "record-writer")):
            writer.start()
            self.spawn(writer.join(), name)  # a writer that stops on an error stops the service
        self.bus.serve(subjects.SCHED_ACTIONS, self.on_action, max_in_flight=100_000)
        self.bus.serve(subjects.SCHED_NODES, self.on_node, max_in_flight=100_000)
        await self.bus.start()
        self.core.hold_until(self.clock() + self.cfg.reconcile_grace_s)
        await self.bus.publish(subjects.NODES_BROADCAST, Reconcile(epoch=self.epoch))
        self.spawn(self._command_loop(), "commands")
        self.spawn(self._decide_loop(), "decide")
        self.spawn(self._tick_loop(), "tick")
        self.spawn(self._sweep_loop(), "sweep")
        log.info("scheduler epoch %d up, policy %s", self.epoch, self.core.policy.name)

    async def on_stop(self, grace_s: float) -> None:
        """Stop intake and flush the writers; ``build``'s stack then closes the bus and pool."""
        await self.bus.stop_serving(grace_s)
        await asyncio.gather(*(w.close(grace_s) for w in (self.starts, self.records)))

    async def _rebuild(self) -> None:
        """Rebuild the books from Postgres; node reports confirm them (see core)."""
        envs, gone = await store.load_envs(self.pool)
        for env in envs:
            self.core.restore_env(env)
        self.core.gone_envs.update(gone)
        now = self.clock()
        for row in await store.load_open(self.pool):
            if row.status == "running" and row.node_id and row.incarnation:
                self.core.restore_running(row.action, row.node_id, row.incarnation, row.cores, now)
            else:
                self.core.enqueue(row.action, now)
        log.info("rebuilt: %s", self.core.snapshot())

    def _writer(self, name: str) -> db.GroupCommit[store.Record, None]:
        """A durable writer (started with the service)."""
        return db.GroupCommit(self._write, max_batch=1024, retry=WRITE_RETRY, name=name)

    async def _write(self, batch: Sequence[store.Record]) -> list[None]:
        return await store.write(self.pool, batch, self.clock())

    # ------------------------------------------------------------------ handlers

    async def on_action(self, req: SchedulerRequest, msg: Msg) -> Ack | SchedulerStatus | None:
        now = self.clock()
        match req:
            case Enqueue(action=action):
                self.core.enqueue(action, now)
                self._dirty.set()
                return None
            case CloseEnvCmd(trajectory_id=tid):
                effects = self.core.close_env(tid, now)
                await self.apply(effects)
                await self._recorded([e.result.action_id for e in effects if isinstance(e, Finish)])
            case CancelCmd(action_id=aid):
                await self.apply(self.core.cancel(aid, now))
                await self._recorded([aid])
            case StatusQuery():
                return SchedulerStatus(
                    epoch=self.epoch, policy=self.core.policy.name, **self.core.snapshot()
                )
        self._dirty.set()
        return Ack()

    async def on_node(self, req: NodeMessage, msg: Msg) -> Ack:
        now = self.clock()
        match req:
            case Completion():
                return await self._completion(req, now)
            case NodeReport():
                await self.apply(self.core.node_report(req, now))
            case EnvExpired(node_id=node_id, trajectory_id=tid):
                await self.apply(self.core.env_expired(node_id, tid))
            case NodeLeaving(node_id=node_id, incarnation=inc, draining=draining):
                log.info("node %s (%s) is %s", node_id, inc, "draining" if draining else "gone")
                await self.apply(self.core.node_leaving(req, now))
        self._dirty.set()
        return Ack()

    async def _completion(self, c: Completion, now: float) -> Ack:
        aid = c.action_id
        effects = self.core.complete(c, now)
        self._dirty.set()
        await self.apply(effects)
        await self._recorded([aid])  # a duplicate waits too: ack only what is committed
        return Ack()

    async def _recorded(self, action_ids: list[str]) -> None:
        """Wait until these actions' terminal records are committed (raises if they cannot be)."""
        for aid in action_ids:
            pending = self.pending.get(aid)
            if pending is not None:
                await asyncio.shield(pending)

    # ------------------------------------------------------------------ effects

    async def apply(self, effects: list[Effect]) -> None:
        """Record the effects and queue node commands (before any ``await``), then push results."""
        for e in effects:
            self._queue(e)
        for e in effects:
            if isinstance(e, Finish) and e.action.reply_subject:
                await self.bus.publish(
                    subjects.result_push(e.action.reply_subject),
                    e.result,
                    traceparent=e.action.traceparent,
                )

    def _queue(self, e: Effect) -> None:
        match e:
            case StartOnNode():
                started = self.starts.enqueue(store.Started(e, self.clock()))
                self._commands.put_nowait(_Command(e, started))
            case KillOnNode() | DropEnvOnNode():
                self._commands.put_nowait(_Command(e))
            case Finish():
                self._finish(e)
            case EnvChanged():
                self.records.enqueue(e)

    def _finish(self, e: Finish) -> None:
        aid = e.result.action_id
        fut = self.records.enqueue(e)
        self.pending[aid] = fut
        fut.add_done_callback(partial(self._forget, aid))

    def _forget(self, aid: str, fut: asyncio.Future[None]) -> None:
        """A committed record needs no more waiting; a failed one keeps failing every resend."""
        if not fut.cancelled() and fut.exception() is None and self.pending.get(aid) is fut:
            del self.pending[aid]

    async def _send(self, e: NodeEffect) -> None:
        match e:
            case StartOnNode():
                if self._still_assigned(e):
                    cmd = Dispatch(
                        action=e.action, cores=e.cores, epoch=self.epoch, incarnation=e.incarnation
                    )
                    await self.bus.publish(
                        subjects.node(e.node_id), cmd, traceparent=e.action.traceparent
                    )
            case KillOnNode():
                kill = Kill(action_id=e.action_id, epoch=self.epoch, reason=e.reason)
                await self.bus.publish(subjects.node(e.node_id), kill)
            case DropEnvOnNode():
                drop = DropEnv(trajectory_id=e.trajectory_id, epoch=self.epoch)
                await self.bus.publish(subjects.node(e.node_id), drop)

    def _still_assigned(self, e: StartOnNode) -> bool:
        """While its record committed, the attempt may have been redone or its node lost."""
        run = self.core.running.get(e.action.spec.action_id)
        return (
            run is not None and run.node_id == e.node_id and run.action.attempt == e.action.attempt
        )

    # ------------------------------------------------------------------ loops

    async def _command_loop(self) -> None:
        """Send node commands in the core's order; a dispatch once its start is committed."""
        while True:
            cmd = await self._commands.get()
            if cmd.recorded is not None and not await _committed(cmd.recorded):
                continue
            await self._send(cmd.effect)

    async def _decide_loop(self) -> None:
        """Coalesce events into scheduling passes."""
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            await self.apply(self.core.schedule(self.clock()))
            await asyncio.sleep(0)  # let a burst of arrivals join the next pass

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.tick_s)
            await self.apply(self.core.tick(self.clock()))
            self._dirty.set()

    async def _load_stale(self) -> list[store.OpenAction]:
        return await store.load_open(self.pool, older_than=self.clock() - self.cfg.sweep_s)

    async def _sweep_loop(self) -> None:
        """Pick up durable actions whose hand-off from the gateway was lost."""
        while True:
            await asyncio.sleep(self.cfg.sweep_s)
            rows = await db.retrying(self._load_stale, what="sweep")
            fresh = [r for r in rows if not self.core.known(r.action.spec.action_id)]
            for row in fresh:
                self.core.enqueue(row.action, self.clock())
            if fresh:
                log.info("sweep picked up %d queued actions", len(fresh))
                self._dirty.set()


async def _committed(fut: asyncio.Future[None]) -> bool:
    try:
        await asyncio.shield(fut)
    except TangramError as exc:
        log.warning("not dispatching: its start was not recorded (%s)", exc)
        return False
    return True


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Scheduler]:
    """The scheduler as configured by the environment and ``overrides`` (see runtime.Build),
    given its pool and bus; ``stack`` closes the bus first, then the pool."""
    mesh, cfg = config.load(overrides)
    pool = await db.open_pool(stack, mesh.postgres_dsn)
    bus = await open_bus(stack, mesh.nats_url, "scheduler")
    return mesh, Scheduler(cfg, bus, pool)
