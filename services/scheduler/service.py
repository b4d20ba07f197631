"""The scheduler shell: feeds NATS events and time into the pure core and carries out its effects.

Ordering: every handler changes the core synchronously before its first ``await``, so the core
sees events in arrival order. Durability: results are pushed to clients at once and written to
Postgres by a group-commit writer; a node's completion is acked only after its record is
committed, so a crash in between makes the node re-send it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import asyncpg
from nats.aio.msg import Msg

from services.scheduler import store
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import CoreConfig, SchedulerCore
from services.scheduler.effects import (
    DropEnvOnNode,
    Effect,
    EnvChanged,
    Finish,
    KillOnNode,
    StartOnNode,
)
from services.scheduler.policy import make_policy
from tangram import db, subjects
from tangram.bus import Bus
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
from tangram.runtime import Service

log = logging.getLogger(__name__)


class Scheduler(Service):
    name = "scheduler"

    def __init__(
        self, mesh: MeshConfig, cfg: SchedulerConfig, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__()
        self.mesh = mesh
        self.cfg = cfg
        self.clock = clock
        self.core = SchedulerCore(
            make_policy(cfg.policy),
            CoreConfig(node_timeout_s=cfg.node_timeout_s, dispatch_grace_s=cfg.dispatch_grace_s),
        )
        self.epoch = 0
        self.bus: Bus | None = None
        self.pool: asyncpg.Pool | None = None
        self.writer: db.GroupCommit[store.Record, None] | None = None
        self.pending: dict[str, asyncio.Future[None]] = {}  # finish records not yet committed
        self._dirty = asyncio.Event()

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        self.pool = await db.connect(self.mesh.postgres_dsn, max_size=4)
        await db.migrate(self.pool)
        self.epoch = await store.next_epoch(self.pool)
        await self._rebuild()
        pool = self.pool
        self.writer = db.GroupCommit(lambda batch: self._write(pool, batch), max_batch=1024)
        self.writer.start()
        self.bus = await Bus.connect(self.mesh.nats_url, "scheduler")
        self.bus.serve(subjects.SCHED_ACTIONS, SchedulerRequest, self.on_action,
                       queue=subjects.SCHEDULER_QUEUE, max_in_flight=100_000)  # fmt: skip
        self.bus.serve(subjects.SCHED_NODES, NodeMessage, self.on_node,
                       queue=subjects.SCHEDULER_QUEUE, max_in_flight=100_000)  # fmt: skip
        await self.bus.start()
        self.core.hold_until(self.clock() + self.cfg.reconcile_grace_s)
        await self.bus.publish(subjects.NODES_BROADCAST, Reconcile(epoch=self.epoch))
        self.spawn(self._decide_loop(), "decide")
        self.spawn(self._tick_loop(), "tick")
        self.spawn(self._sweep_loop(), "sweep")
        log.info("scheduler epoch %d up, policy %s", self.epoch, self.core.policy.name)

    async def on_stop(self, grace_s: float) -> None:
        if self.bus is not None:
            await self.bus.stop_serving(grace_s)
        if self.writer is not None:
            await self.writer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.pool is not None:
            await self.pool.close()

    async def _rebuild(self) -> None:
        """Rebuild the books from Postgres; node reports confirm them (see core)."""
        assert self.pool is not None
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

    async def _write(self, pool: asyncpg.Pool, batch: Any) -> list[None]:
        return await db.retrying(lambda: store.write(pool, batch, self.clock()), what="record")

    # ------------------------------------------------------------------ handlers

    async def on_action(self, req: Any, msg: Msg) -> Any:
        now = self.clock()
        match req:
            case Enqueue(action=action):
                self.core.enqueue(action, now)
                self._dirty.set()
                return None
            case CloseEnvCmd(trajectory_id=tid):
                await self.apply(self.core.close_env(tid, now))
            case CancelCmd(action_id=aid):
                await self.apply(self.core.cancel(aid, now))
            case StatusQuery():
                return SchedulerStatus(epoch=self.epoch, policy=self.core.policy.name,
                                       **self.core.snapshot())  # fmt: skip
        self._dirty.set()
        return Ack()

    async def on_node(self, req: Any, msg: Msg) -> Any:
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
                await self.apply(self.core.node_leaving(node_id, inc, now, draining))
        self._dirty.set()
        return Ack()

    async def _completion(self, c: Completion, now: float) -> Ack:
        aid = c.result.action_id
        effects = self.core.complete(c.node_id, c.incarnation, c.attempt, c.result, now)
        self._dirty.set()
        await self.apply(effects)
        pending = self.pending.get(aid)
        if pending is not None:
            await asyncio.shield(pending)  # ack only once the terminal record is committed
        return Ack()

    # ------------------------------------------------------------------ effects

    async def apply(self, effects: list[Effect]) -> None:
        assert self.bus is not None
        assert self.writer is not None
        for e in effects:
            match e:
                case StartOnNode():
                    self.writer.enqueue(store.Started(e, self.clock()))
                    cmd = Dispatch(
                        action=e.action, cores=e.cores, epoch=self.epoch, incarnation=e.incarnation
                    )
                    await self.bus.publish(subjects.node(e.node_id), cmd,
                                           traceparent=e.action.traceparent)  # fmt: skip
                case Finish():
                    self._finish(e)
                    if e.action.reply_subject:
                        await self.bus.publish(e.action.reply_subject, e.result,
                                               traceparent=e.action.traceparent)  # fmt: skip
                case KillOnNode():
                    kill = Kill(action_id=e.action_id, epoch=self.epoch, reason=e.reason)
                    await self.bus.publish(subjects.node(e.node_id), kill)
                case DropEnvOnNode():
                    drop = DropEnv(trajectory_id=e.trajectory_id, epoch=self.epoch)
                    await self.bus.publish(subjects.node(e.node_id), drop)
                case EnvChanged():
                    self.writer.enqueue(e)

    def _finish(self, e: Finish) -> None:
        assert self.writer is not None
        aid = e.result.action_id
        fut = self.writer.enqueue(e)
        self.pending[aid] = fut
        fut.add_done_callback(lambda _f: self.pending.pop(aid, None))

    # ------------------------------------------------------------------ loops

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
        assert self.pool is not None
        return await store.load_open(self.pool, older_than=self.clock() - self.cfg.sweep_s)

    async def _sweep_loop(self) -> None:
        """Pick up durable actions whose hand-off from the gateway was lost."""
        assert self.pool is not None
        while True:
            await asyncio.sleep(self.cfg.sweep_s)
            rows = await db.retrying(self._load_stale, what="sweep")
            fresh = [r for r in rows if not self.core.known(r.action.spec.action_id)]
            for row in fresh:
                self.core.enqueue(row.action, self.clock())
            if fresh:
                log.info("sweep picked up %d queued actions", len(fresh))
                self._dirty.set()
