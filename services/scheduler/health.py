"""The health detector's thin shell inside the scheduler (the pure rules: ``tangram.health``).

It lives in the leading scheduler rather than in a process of its own: the scheduler already
reads every agent's reports, alone knows what work each agent holds and how long it should
take, and alone can recover a failed role (fence the incarnation, end or re-queue its work);
a separate process would cost a process and add a "node failed" message that could be forged.

What it does: feeds reports and the books' workload to the detector, pings suspects on their
own command subject, refuses reports of a fenced incarnation (so its start lease lapses),
hands failures to the core, and records every transition in Postgres (``health_events``), as
a span and in the log. Losing the broker pauses judgement (see ``tangram.health``). The
leader alone bounds that history (:func:`prune`, a task of its own every ``prune_s``).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg
import msgspec

from services.scheduler.core.effects import Effect
from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.scheduler import SchedulerCore
from tangram import db, subjects, telemetry
from tangram.bus import BaseBus, Bus
from tangram.contract import Ack, NodeReport, NodeRow, Ping, SchedulerStatus
from tangram.errors import Fenced, TangramError
from tangram.health import Changed, Detector, Failed, HealthConfig, Probe
from tangram.health import Effect as HealthEffect
from tangram.metrics import health_transition

log = logging.getLogger(__name__)

RECORDS_HELD = 10_000  # transitions kept for Postgres while it is away
WRITE_TIMEOUT_S = 5.0
PRUNE_FIRST_S = 60.0  # the first pruning after this scheduler leads (then every prune_s)

Apply = Callable[[list[Effect]], Awaitable[None]]

_INSERT = """
INSERT INTO health_events (at, node_id, incarnation, role, old_state, new_state, reason)
SELECT * FROM unnest($1::timestamptz[], $2::text[], $3::text[], $4::text[], $5::text[],
                     $6::text[], $7::text[])
"""

# How long a fenced incarnation is fenced again by a new leader (``restore``); pruning keeps
# those rows whatever its bounds say.
FENCED_WINDOW = "interval '1 day'"

_FENCED = f"""
SELECT DISTINCT node_id, incarnation FROM health_events
WHERE new_state IN ('fenced', 'failed') AND at > now() - {FENCED_WINDOW}
"""

PRUNE_BATCH = 10_000  # rows one DELETE removes: each statement stays short

# The history is bounded by age ($1 seconds) and by count (the newest $2 rows), in batches.
_PRUNE = f"""
DELETE FROM health_events WHERE id IN (
    SELECT id FROM health_events
    WHERE (at < now() - make_interval(secs => $1)
           OR id <= (SELECT id FROM health_events ORDER BY id DESC OFFSET $2 LIMIT 1))
      AND NOT (new_state IN ('fenced', 'failed') AND at > now() - {FENCED_WINDOW})
    LIMIT $3
)
"""


async def prune(pool: asyncpg.Pool, keep_s: float, keep_rows: int) -> int:
    """Delete the transitions older than ``keep_s`` or beyond the newest ``keep_rows`` (but
    the fenced incarnations a new leader restores); how many went."""
    pruned = 0
    while True:
        async with asyncio.timeout(WRITE_TIMEOUT_S):
            status = await pool.execute(_PRUNE, keep_s, keep_rows, PRUNE_BATCH)
        n = int(status.split()[-1])  # "DELETE n"
        pruned += n
        if n < PRUNE_BATCH:
            return pruned


@dataclass
class Monitor:
    """Judges the agents of one scheduler's books; ``run`` is its loop."""

    cfg: HealthConfig
    core: SchedulerCore
    quotas: QuotaCore
    bus: BaseBus
    pool: asyncpg.Pool
    clock: Callable[[], float]
    apply: Apply  # carries out the core's recovery effects (the scheduler's ``apply``)
    detector: Detector = field(init=False)
    _probes: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    _records: list[Changed] = field(init=False, default_factory=list)
    _writing: asyncio.Task[None] | None = field(init=False, default=None)
    _pruning: asyncio.Task[None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.detector = Detector(self.cfg)

    # ------------------------------------------------------------------ reports

    def report(self, r: NodeReport, epoch: int) -> Ack:
        """Take an agent's report, or refuse it with :class:`Fenced`; the answer carries the
        epoch and the start lease (see ``tangram.agent.core``)."""
        key = (r.node_id, r.incarnation)
        if self.core.fenced(*key) or self.quotas.fenced(*key) or self.detector.fenced(*key):
            raise Fenced(f"node {r.node_id} incarnation {r.incarnation} was declared failed")
        now = self.clock()
        role = r.inventory.kind
        self._handle(self.detector.report(r.node_id, r.incarnation, role, r.progress, now))
        return Ack(epoch=epoch, lease_s=self.cfg.lease_s)

    async def restore(self) -> None:
        """Fence again what an earlier scheduler fenced (from ``health_events``), so that an
        agent paused through a takeover is not taken back by the new leader."""
        rows = await self.pool.fetch(_FENCED)
        for r in rows:
            self.core.departed[r["node_id"], r["incarnation"]] = None
        if rows:
            log.info("health: %d fenced incarnations restored", len(rows))

    def left(self, node_id: str, incarnation: str) -> None:
        self.detector.left(node_id, incarnation)

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """Judge every ``check_s``: connectivity first (an outage of our own judges nobody),
        then the books' workload, then the bounds; failures go to the core at once."""
        self._pruning = asyncio.get_running_loop().create_task(self._prune_loop())
        try:
            while True:
                await asyncio.sleep(self.cfg.check_s)
                now = self.clock()
                self._link(now)
                self._workload(now)
                failed = self._handle(self.detector.tick(now))
                for f in failed:
                    await self.apply(self._recover(f, now))
                if self._records and (self._writing is None or self._writing.done()):
                    # off the judging loop: a stalled Postgres must not stall detection
                    self._writing = asyncio.get_running_loop().create_task(self._write())
        finally:
            owned = (self._writing, self._pruning)
            for task in (*self._probes, *(t for t in owned if t is not None)):
                task.cancel()

    async def _prune_loop(self) -> None:
        """Bound ``health_events`` (its own task, off the judging loop and far from any
        action's path): soon after this scheduler leads, then every ``prune_s``."""
        delay = min(self.cfg.prune_s, PRUNE_FIRST_S)
        while True:
            await asyncio.sleep(delay)
            delay = self.cfg.prune_s
            try:
                n = await prune(self.pool, self.cfg.events_keep_s, self.cfg.events_keep_rows)
            except Exception as exc:  # its own task: nothing may escape unlogged; next round
                level = logging.INFO if db.transient(exc) else logging.WARNING
                log.log(level, "health_events not pruned: %r", exc)
                continue
            if n:
                log.info("health_events: %d old transitions pruned", n)

    def _recover(self, f: Failed, now: float) -> list[Effect]:
        """The failed role only: its books end (node) or its calls do (quota agent)."""
        why = f"declared failed: {f.why}"
        lease_s = self.cfg.lease_s
        return self.core.node_failed(
            f.node_id, f.incarnation, now, why, lease_s
        ) + self.quotas.agent_failed(f.node_id, f.incarnation, now, why)

    def _link(self, now: float) -> None:
        connected = not isinstance(self.bus, Bus) or self.bus.nc.is_connected
        if not connected and not self.detector.offline:
            log.warning("health: lost the broker; judging nobody until it is back")
            self.detector.disconnected()
        elif connected and self.detector.offline:
            log.info("health: back on the broker; every agent gets a fresh window")
            self._handle(self.detector.reconnected(now))

    def _workload(self, now: float) -> None:
        """Which agents the books give work, and the longest it should take (its timeout)."""
        expected: dict[str, float] = {}
        work = [(r.node_id, r.action) for r in self.core.running.values()]
        work += [(c.node_id, c.action) for c in self.quotas.calls.values()]
        for node_id, action in work:
            expected[node_id] = max(expected.get(node_id, 0.0), action.spec.timeout_s)
        for node_id in self.detector.members:
            self.detector.work(node_id, node_id in expected, expected.get(node_id, 0.0), now)

    def _handle(self, effects: list[HealthEffect]) -> list[Failed]:
        failed: list[Failed] = []
        for e in effects:
            match e:
                case Probe():
                    if e.canary:
                        log.info(
                            "node %s (%s): ping answered, canary asked", e.node_id, e.incarnation
                        )
                    task = asyncio.get_running_loop().create_task(self._ping(e))
                    self._probes.add(task)
                    task.add_done_callback(self._probes.discard)
                case Changed():
                    self._changed(e)
                case Failed():
                    failed.append(e)
        return failed

    async def _ping(self, p: Probe) -> None:
        """Ping the probed incarnation (or have it run its canary). To a ping any answer
        counts, an error reply too (its command path is alive), but ``invalid_request``: the
        node's other incarnation refusing a probe meant for this one. A canary counts only
        once it completed: an error (it failed) is no answer. An older agent answers a
        canary at once, as a ping."""
        ping = Ping(canary=p.canary, incarnation=p.incarnation)
        try:
            await self.bus.request(subjects.node(p.node_id), ping, timeout=self.cfg.probe_timeout_s)
        except TangramError as exc:
            if p.canary or exc.code in ("unavailable", "timeout", "invalid_request"):
                log.info("node %s (%s): probe %s: %s", p.node_id, p.incarnation, p.probe, exc)
                return  # no answer: the detector's deadline decides
        self._handle(self.detector.answered(p.node_id, p.incarnation, p.probe, self.clock()))

    def _changed(self, c: Changed) -> None:
        level = logging.INFO if c.new == "healthy" else logging.WARNING
        log.log(level, "node %s (%s): %s -> %s: %s", c.node_id, c.incarnation, c.old, c.new, c.why)
        with telemetry.tracer().start_as_current_span(f"health {c.new}") as span:
            span.set_attributes(
                {
                    "tangram.node_id": c.node_id,
                    "tangram.incarnation": c.incarnation,
                    "tangram.role": c.role,
                    "tangram.health.old": str(c.old),
                    "tangram.health.new": str(c.new),
                    "tangram.health.why": c.why,
                }
            )
        health_transition(c.role, str(c.old), str(c.new))
        self._records.append(c)
        del self._records[:-RECORDS_HELD]  # Postgres away for long: the oldest go (logged)

    async def _write(self) -> None:
        """Record the transitions so far (kept for the next round if Postgres is away)."""
        if not self._records:
            return
        batch, self._records = self._records, []
        utc = datetime.UTC
        cols = [
            [datetime.datetime.fromtimestamp(c.at, utc) for c in batch],
            [c.node_id for c in batch],
            [c.incarnation for c in batch],
            [c.role for c in batch],
            [str(c.old) for c in batch],
            [str(c.new) for c in batch],
            [c.why for c in batch],
        ]
        try:
            async with asyncio.timeout(WRITE_TIMEOUT_S):
                async with self.pool.acquire() as conn:
                    await conn.execute(_INSERT, *cols)
        except Exception as exc:  # a task of its own: nothing may escape unlogged
            level = logging.INFO if db.transient(exc) else logging.WARNING
            log.log(level, "health transitions not recorded yet: %r", exc)
            self._records = (batch + self._records)[-RECORDS_HELD:]

    # ------------------------------------------------------------------ status

    def annotate(self, status: SchedulerStatus, now: float) -> SchedulerStatus:
        """Each node row with its health, phase and how long since it last made progress."""
        rows: list[NodeRow] = []
        for row in status.node_rows:
            m = self.detector.members.get(row.node_id)
            if m is not None:
                phase = "draining" if row.draining else ("busy" if m.busy else "idle")
                since = round(now - m.last_progress, 1)
                row = msgspec.structs.replace(
                    row, health=str(m.health), phase=phase, last_progress_s=since
                )
            rows.append(row)
        return msgspec.structs.replace(status, node_rows=rows)
