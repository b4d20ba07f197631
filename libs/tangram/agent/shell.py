"""The node agent's async shell: bus subscriptions, owned loops and tasks, and the executor.

:class:`Agent` carries out what :class:`~tangram.agent.core.AgentCore` decides; the kind of
work (shell commands on cores, model calls on GPUs, rate-limited HTTP calls) lives behind the
:class:`Executor` protocol. The agent is constructed with an open bus (:class:`~tangram.bus.Bus`),
which its builder closes after the agent stopped (a :class:`~tangram.membus.MemoryBus` in
tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec
from nats.aio.msg import Msg
from prometheus_client.metrics_core import Metric

from tangram import metrics, ops_http, subjects
from tangram.agent.core import (
    AgentConfig,
    AgentCore,
    Announce,
    Canary,
    Deliver,
    Drop,
    Effect,
    PrepareServices,
    Publish,
    Run,
    Stop,
)
from tangram.agent.starts import Launches
from tangram.bus import BaseBus
from tangram.contract import (
    Ack,
    Commands,
    Completion,
    Completions,
    Dispatch,
    ErrorKind,
    Inventory,
    NodeCommand,
    NodeLeaving,
    NodeReport,
    Outcome,
    PreparedService,
    Reconcile,
    ServiceSpec,
    encode,
)
from tangram.errors import Fenced, InvalidRequest, TangramError
from tangram.runtime import Probe, Service

log = logging.getLogger(__name__)

BATCH_ITEM_OVERHEAD = 8  # a completion's share of its batch message's framing, in bytes

Clock = Callable[[], float]


class Executor(Protocol):
    """The kind-specific half of a node agent: runs what was dispatched, holds environments."""

    async def start(self) -> Inventory:
        """Prepare (clean leftovers of a previous incarnation); what this node offers."""

    async def close(self) -> None:
        """Kill what runs and release every environment."""

    async def run(self, dispatch: Dispatch) -> Outcome:
        """Run one dispatched action to its end; facts only (a failure kind or exit code)."""

    async def kill(self, action_id: str) -> None:
        """Kill a running action (its ``run`` then returns)."""

    async def drop_env(self, trajectory_id: str) -> None:
        """Remove a trajectory's environment and everything in it."""

    def envs(self) -> Mapping[str, float]:
        """Live environments: trajectory_id -> last use, on the agent's clock."""


@runtime_checkable
class Prepares(Protocol):
    """An executor that prepares model services on ``Prepare`` (a GPU node); without this
    hook the agent refuses ``Prepare``."""

    async def prepare(self, services: Sequence[ServiceSpec]) -> None:
        """Build what is new or changed (never on the event loop); a failure is reported in
        :meth:`Reports.services`, never raised."""


@runtime_checkable
class Tiers(Protocol):
    """An executor some of whose environments hold no memory (saved to disk): each report
    names them, so that the scheduler books only the others' memory."""

    def envs_on_disk(self) -> tuple[str, ...]:
        """Of ``envs``, those on disk now."""


@runtime_checkable
class Canaries(Protocol):
    """An executor that can prove its execution path works, for the health detector's canary
    (``Ping.canary``); without this hook a canary is answered as a plain ping."""

    async def canary(self) -> None:
        """Run a trivial action through the path real actions take and return once it
        completed (raise if it failed). It takes no granted unit: it is not booked, and runs
        beside whatever runs (see each executor for why that is sound)."""


@runtime_checkable
class Reports(Protocol):
    """An executor whose prepared services go into every heartbeat."""

    def services(self) -> tuple[PreparedService, ...]:
        """Every prepared service (ready or failed) and where it is resident now."""


class Agent(Service):
    """A node agent: registers, heartbeats, runs dispatches, reports until acked, leaves."""

    def __init__(
        self,
        bus: BaseBus,
        executor: Executor,
        cfg: AgentConfig,
        *,
        name: str = "agent",
        clock: Clock = time.time,
        mono: Clock = time.monotonic,
    ) -> None:
        super().__init__()
        self.name = name
        self.bus = bus
        self.executor = executor
        self.cfg = cfg
        self.to_scheduler = subjects.sched_node(cfg.node_id)  # this node's own (see auth)
        self.clock = clock
        self.mono = mono  # the start lease's clock (see core)
        # The optional hooks of a GPU node's executor (see Prepares, Reports).
        self._preparer = executor if isinstance(executor, Prepares) else None
        self._reports = executor if isinstance(executor, Reports) else None
        self._canaries = executor if isinstance(executor, Canaries) else None
        self._starts = executor.starts if isinstance(executor, Launches) else None
        self._canary: asyncio.Task[None] | None = None  # one at a time, shared by probes
        self.core = AgentCore(cfg, prepares=self._preparer is not None)
        self._runs: set[asyncio.Task[None]] = set()
        self._sends: set[asyncio.Task[None]] = set()
        self._prepares: set[asyncio.Task[None]] = set()
        self._outgoing: list[Completion] = []  # completions not sent yet, oldest first
        self._deliveries: set[asyncio.Task[None]] = set()  # the delivery loops running
        self._reports_out: set[asyncio.Task[None]] = set()  # reports awaiting their answer

    @property
    def node_id(self) -> str:
        return self.cfg.node_id

    @property
    def incarnation(self) -> str:
        return self.cfg.incarnation

    # ------------------------------------------------------------------ lifecycle

    async def on_start(self) -> None:
        inventory = await self.executor.start()
        self.bus.serve(subjects.node(self.node_id), self.on_command, max_in_flight=100_000)
        self.bus.serve(subjects.NODES_BROADCAST, self.on_command, max_in_flight=16)
        await self.bus.start()
        self._tiers()
        envs = self.executor.envs()
        await self._apply(self.core.register(inventory, envs, self.clock(), self.mono()))
        self.spawn(self._every(self.cfg.heartbeat_s, self._heartbeat), "heartbeat")
        self.spawn(self._every(self.cfg.resend_s, self._resend), "resend")
        self.spawn(self._every(max(0.05, self.cfg.env_ttl_s / 4), self._expire), "env-ttl")

    async def on_stop(self, grace_s: float) -> None:
        """Drain notice, stop intake, let runs finish within ``grace_s``, kill the rest, stop
        the loops, a last bounded flush of the outbox, close the executor, goodbye."""
        await self._apply(self.core.drain())
        await self.bus.stop_serving(0.1)
        await _wait(self._runs, grace_s)
        await self._apply(self.core.kill_all(ErrorKind.NODE_DIED))
        await _wait(self._runs, self.cfg.kill_wait_s)
        await self._cancel_tasks()
        await _wait(self._reports_out, 0.0, cancel=True)
        await _wait(self._prepares, 0.0, cancel=True)
        await _wait({self._canary} if self._canary else set(), 0.0, cancel=True)
        await self._apply(self.core.flush(self.clock()))
        self._send_outgoing()  # now, not on the next turn: the wait below covers it
        await _wait(self._sends, self.cfg.flush_s, cancel=True)
        envs = tuple(self.executor.envs())
        await self.executor.close()
        await _wait(self._runs, 0.0, cancel=True)
        await self._apply(self.core.goodbye(envs))

    def dependencies(self) -> dict[str, Probe]:
        return {"bus": ops_http.bus_probe(self.bus)}

    def collect(self) -> list[Metric]:
        return metrics.unit_families(_units(self.node_id, self.core), "busy")

    # ------------------------------------------------------------------ commands

    async def on_command(self, cmd: NodeCommand, msg: Msg) -> Ack:
        if not isinstance(cmd, Commands):
            await self._command(cmd)
            return Ack()
        for item in cmd.items:  # one refused command does not stop the others
            with contextlib.suppress(InvalidRequest):
                await self._command(item)
        return Ack()

    async def _command(self, cmd: NodeCommand) -> None:
        try:
            # only a Reconcile reads the environments (a dispatch must not pay for listing them)
            envs = self.executor.envs() if isinstance(cmd, Reconcile) else ()
            effects = self.core.command(cmd, envs, self.clock(), self.mono())
        except InvalidRequest as exc:
            log.warning("%s %s: refused %s: %s", self.name, self.node_id, type(cmd).__name__, exc)
            raise
        await self._apply(effects)
        if isinstance(cmd, Reconcile) and self._outgoing:
            # A new scheduler asks for everything: what it re-sends goes now, not behind a
            # delivery stuck waiting on the scheduler it replaced (up to its 5 s timeout,
            # the new one booking those cores busy meanwhile). A duplicate is acked as one.
            self._own(self._deliver_all(), self._sends, self._deliveries)

    # ------------------------------------------------------------------ effects

    async def _apply(self, effects: list[Effect]) -> None:
        for e in effects:
            match e:
                case Run(dispatch=d):
                    self._own(self._run(d), self._runs)
                case Stop(action_id=aid):
                    await self.executor.kill(aid)
                case Drop(trajectory_id=tid):
                    await self.executor.drop_env(tid)
                case Publish(msg=NodeReport() as m):
                    if self.core.may_send(m):
                        m = self._with_starts(self._with_services(m))
                        self._own(self._report(m), self._reports_out)
                case Publish(msg=m):
                    if self.core.may_send(m):
                        await self.bus.publish(self.to_scheduler, m)
                case Deliver(completion=c):
                    self._coalesce(c)
                case Announce(msg=m):
                    await self._announce(m)
                case PrepareServices(services=specs):
                    self._own(self._prepare(specs), self._prepares)
                case Canary():
                    await self._run_canary()

    def _with_services(self, m: NodeReport) -> NodeReport:
        """A report carries the executor's prepared services (a GPU node)."""
        if self._reports is not None:
            return msgspec.structs.replace(m, services=self._reports.services())
        return m

    def _with_starts(self, m: NodeReport) -> NodeReport:
        """A report carries the executor's launches as they are now (``Progress.spawned``,
        ``spawning``): the detector watches the start phase with them."""
        if self._starts is None or m.progress is None:
            return m
        spawned, spawning = self._starts.snapshot()
        progress = msgspec.structs.replace(m.progress, spawned=spawned, spawning=spawning)
        return msgspec.structs.replace(m, progress=progress)

    async def _report(self, m: NodeReport) -> None:
        """Send a report and take the scheduler's answer: it renews the start lease (from
        when the report left) and may raise the epoch floor. No answer (the broker or the
        scheduler away) renews nothing: held dispatches wait. Fenced, the agent stops."""
        sent = self.mono()
        try:
            ack = await self.bus.request(
                self.to_scheduler, m, timeout=max(1.0, 2 * self.cfg.heartbeat_s)
            )
        except Fenced as exc:
            await self._fenced(exc)
            return
        except TangramError as exc:
            log.debug("report %d not answered: %s", m.seq, exc)
            return
        await self._apply(self.core.answered(ack, sent, self.clock(), self.mono()))

    async def _fenced(self, exc: Fenced) -> None:
        """This incarnation was declared failed: nothing held starts, what runs is killed,
        and the agent stops with the error (its supervisor starts a new incarnation)."""
        if self.fatal is not None:
            return
        log.error("%s %s: fenced by the scheduler: %s", self.name, self.node_id, exc)
        await self._apply(self.core.kill_all(ErrorKind.NODE_DIED))
        self.fatal = exc
        self.stopped.set()

    async def _run_canary(self) -> None:
        """The executor's canary, the probe answered once it completed. Probes that come
        while one runs share it (a wedged executor holds one canary, not one per probe);
        a probe that gives up (its timeout) leaves it running for the next."""
        if self._canaries is None:
            return  # an executor without the hook: the ping's answer says what it can
        if self._canary is None or self._canary.done():
            self._canary = asyncio.get_running_loop().create_task(self._canaries.canary())
            self._canary.add_done_callback(_log_failure)
        await asyncio.shield(self._canary)

    async def _prepare(self, specs: tuple[ServiceSpec, ...]) -> None:
        """Prepare on the executor, then report at once: the scheduler waits for it."""
        if self._preparer is not None:  # else the core refused the command
            await self._preparer.prepare(specs)
            await self._heartbeat()

    async def _run(self, dispatch: Dispatch) -> None:
        """Run ``dispatch``, then, in the same task, the first action its end starts (the freed
        units' next): started on the turn of the loop that saw the end, not on the next one as
        a new task's first step would be."""
        d: Dispatch | None = dispatch
        while d is not None:
            aid = d.action.spec.action_id
            outcome = self.core.not_started(aid, self.clock()) or await self._execute(d)
            effects = self.core.finished(aid, outcome, self.clock(), self.mono())
            d = next((e.dispatch for e in effects if isinstance(e, Run)), None)
            rest = [e for e in effects if not (isinstance(e, Run) and e.dispatch is d)]
            try:
                await self._apply(rest)
            except Exception:
                if d is not None:  # its units are booked to it: it runs, in a task of its own
                    self._own(self._run(d), self._runs)
                raise

    async def _execute(self, d: Dispatch) -> Outcome:
        """The executor's outcome; an executor that raises is an internal failure."""
        try:
            return await self.executor.run(d)
        except TangramError as exc:
            detail = str(exc)
        except Exception as exc:
            log.exception("executor failed running %s", d.action.spec.action_id)
            detail = f"{type(exc).__name__}: {exc}"
        now = self.clock()
        return Outcome(failure=ErrorKind.INTERNAL, detail=detail, started_at=now, finished_at=now)

    def _coalesce(self, c: Completion) -> None:
        """Queue a completion for a delivery loop (started on the next turn of the event
        loop, so that completions of one turn go together)."""
        if not self._outgoing and self._delivery_room():
            asyncio.get_running_loop().call_soon(self._send_outgoing)
        self._outgoing.append(c)

    def _send_outgoing(self) -> None:
        """Start a delivery loop unless ``completions_in_flight`` run: at most that many
        batches in flight, so while the scheduler commits them the next batch gathers (group
        commit across the hop), and a completion does not wait out a whole commit behind
        another when a slot is free (a lone completion on a quiet node leaves at once)."""
        if self._outgoing and self._delivery_room():
            self._own(self._deliver_all(), self._sends, self._deliveries)

    def _delivery_room(self) -> bool:
        """Whether another delivery loop may start. A loop that has ended counts for nothing
        even before its done-callback leaves the set: counted, a completion queued in that gap
        would start no loop and wait for ever (never sent, so never due for a resend)."""
        running = sum(1 for task in self._deliveries if not task.done())
        return running < self.cfg.completions_in_flight

    async def _deliver_all(self) -> None:
        while self._outgoing:
            await self._deliver(self._next_batch())

    def _next_batch(self) -> list[Completion]:
        """The oldest outgoing completions that fit one message together."""
        batch: list[Completion] = []
        size = 0
        while self._outgoing:
            n = len(encode(self._outgoing[0])) + BATCH_ITEM_OVERHEAD
            if batch and size + n > self.cfg.completion_budget:
                break
            batch.append(self._outgoing.pop(0))
            size += n
        return batch

    async def _deliver(self, batch: list[Completion]) -> None:
        batch = [c for c in batch if self.core.may_send(c)]
        if not batch:
            return
        msg = batch[0] if len(batch) == 1 else Completions(items=tuple(batch))
        ids = ", ".join(c.action_id for c in batch)
        delivered = False
        try:
            await self.bus.request(self.to_scheduler, msg, timeout=self.cfg.completion_timeout_s)
            delivered = True
        except InvalidRequest as exc:  # refused: it would be again; say so louder
            if len(batch) > 1:  # one refused completion must not hold back the others
                for c in batch:
                    await self._deliver([c])
                return
            log.warning("completion of %s refused: %s", ids, exc)
            self.core.refused(batch[0].action_id, str(exc))  # never resent as it was
            return
        except TangramError as exc:
            log.info("completion of %s not acknowledged yet: %s", ids, exc)
        except Exception:  # a bug: still never leave a completion marked in flight
            log.exception("sending the completion of %s failed", ids)
        for c in batch:
            (self.core.delivered if delivered else self.core.undelivered)(c.action_id)

    async def _announce(self, m: NodeLeaving) -> None:
        """Best effort: the scheduler may be down, and the agent leaves anyway."""
        if not self.core.may_send(m):
            return
        try:
            await self.bus.request(self.to_scheduler, m, timeout=self.cfg.leave_timeout_s)
        except TangramError as exc:
            log.info("leaving notice not acknowledged: %s", exc)

    def _own(
        self, coro: Coroutine[Any, Any, None], *into: set[asyncio.Task[None]]
    ) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        for owner in into:
            owner.add(task)
            task.add_done_callback(owner.discard)
        task.add_done_callback(_log_failure)
        return task

    # ------------------------------------------------------------------ loops

    async def _every(self, period_s: float, tick: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """Run ``tick`` every ``period_s``; a broker outage skips ticks, it never ends the loop
        (losing the broker is not losing the node)."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await tick()
            except TangramError as exc:
                log.info("a periodic report was skipped: %s", exc)

    def _tiers(self) -> None:
        if isinstance(self.executor, Tiers):
            self.core.on_disk = self.executor.envs_on_disk()

    async def _heartbeat(self) -> None:
        self._tiers()
        await self._apply(self.core.heartbeat(self.executor.envs(), self.clock()))

    async def _resend(self) -> None:
        await self._apply(self.core.resend(self.clock()))

    async def _expire(self) -> None:
        await self._apply(self.core.expire(self.executor.envs(), self.clock()))


async def _wait(tasks: set[asyncio.Task[None]], timeout_s: float, *, cancel: bool = False) -> None:
    """Wait for ``tasks`` up to ``timeout_s``; with ``cancel``, cancel what is left."""
    if not tasks:
        return
    if timeout_s > 0:
        await asyncio.wait(set(tasks), timeout=timeout_s)
    if cancel:
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _units(node_id: str, core: AgentCore) -> list[metrics.Units]:
    """The node's cores or GPUs, and how many its running actions hold (a quota node: none)."""
    inv = core.inventory
    running = (a.units for aid, a in core.active.items() if aid not in core.waiting)
    busy = len(set().union(*running))
    if inv.kind == "gpu":
        return [metrics.Units(node_id, "gpu", len(inv.gpus), busy)]
    if inv.kind == "cpu":
        return [metrics.Units(node_id, "core", sum(len(n.cores) for n in inv.numa), busy)]
    return []


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("agent task %s failed", task.get_name(), exc_info=task.exception())
