"""Service heartbeats: gateways and schedulers say every ``TANGRAM_HEARTBEAT_S`` who they are,
which phase they are in and how far their progress counters got; the leading scheduler keeps
the last beat of each instance and judges it (:class:`Book`, a pure core).

The rule is simpler than the node agents' detector (``tangram.health``), because nothing is
recovered from it -- a supervisor restarts a dead service, the standby takes the lead by its
lock -- it only tells the operator (``tangram status``, the dashboard) what is alive:

- *silent*: no beat for ``TANGRAM_HEALTH_SILENT_S``: dead, paused or cut off from the broker
  (while the leader itself is cut off, everyone it hears through the broker is silent to it);
- *stalled*: it says it is busy and its counters have not moved for ``TANGRAM_HEALTH_SUSPECT_S``;
- *stopped*: its last beat said it stopped (a graceful stop);
- else *healthy*. A gateway and a standby scheduler are idle members (never busy): however
  little they do, they are healthy while they beat.

Identity: a beat comes on its role's subject, which only that role's credential may publish
on (``auth.ROUTES``), and the listener refuses one that names another role, so a gateway cannot
pose as a scheduler. What the broker cannot stop: every process of one role shares its
credential, so any gateway may beat as any gateway *instance* (keep a dead one looking alive,
or invent many: the book holds at most ``MAX_INSTANCES``, the longest silent go first). Beats
decide nothing but what status shows, so that is what such a forgery could mislead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Final

from nats.aio.msg import Msg

from tangram import subjects
from tangram.bus import BaseBus, Bus
from tangram.contract.beats import ServiceBeat, ServiceRow
from tangram.errors import InvalidRequest, TangramError

log = logging.getLogger(__name__)

ENDPOINTS: Final = {"gateway": subjects.GATEWAY_BEATS, "scheduler": subjects.SCHEDULER_BEATS}
MAX_INSTANCES: Final = 256  # instances the book holds (forged ones cannot grow it further)
FORGET_S: Final = 300.0  # a silent or stopped instance leaves the table after this long
# A standby connects to the broker only once it has waited this long for the lead: the one
# that leads at once never opens (and cancels) a connection it does not need.
STANDBY_AFTER_S: Final = 0.5
RECONNECT_S: Final = (0.25, 4.0)  # the standby's connection attempts: first and longest wait
CONNECT_S = 5.0  # one attempt's deadline


@dataclass(frozen=True, slots=True)
class Identity:
    """One service process: its role, an id of this incarnation, where it runs, since when."""

    service: str
    instance: str
    pid: int
    host: str
    started_at: float


def identity(service: str) -> Identity:
    return Identity(
        service, uuid.uuid4().hex[:12], os.getpid(), socket.gethostname()[:64], time.time()
    )


@dataclass(frozen=True, slots=True)
class Phase:
    """What a service says of itself in one beat."""

    phase: str
    epoch: int = 0
    busy: bool = False
    counters: Mapping[str, int] = field(default_factory=dict)


def beat(who: Identity, now: Phase, at: float) -> ServiceBeat:
    return ServiceBeat(
        service=who.service,
        instance=who.instance,
        pid=who.pid,
        host=who.host,
        started_at=who.started_at,
        phase=now.phase,
        epoch=now.epoch,
        busy=now.busy,
        counters=dict(now.counters),
        sent_at=at,
    )


# --------------------------------------------------------------------------- sending


async def beating(
    bus: BaseBus,
    who: Identity,
    period_s: float,
    state: Callable[[], Phase],
    *,
    final: bool = True,
    clock: Callable[[], float] = time.time,
) -> None:
    """Publish ``state()`` every ``period_s`` until cancelled; then, if ``final``, one last beat
    saying ``stopped``. Never raises for the broker: while it is away a beat is skipped (not
    buffered: a stale beat says nothing) and the next one goes once it is back."""
    endpoint = ENDPOINTS[who.service]
    away = False
    try:
        while True:
            if isinstance(bus, Bus) and not bus.nc.is_connected:
                away = True
            else:
                try:
                    await bus.publish(endpoint, beat(who, state(), clock()))
                    if away:
                        log.info("%s: heartbeats resumed", who.service)
                    away = False
                except TangramError as exc:
                    if not away:
                        log.warning("%s: heartbeat not sent (%s); retrying", who.service, exc)
                    away = True
            await asyncio.sleep(period_s)
    except asyncio.CancelledError:
        if final:
            with contextlib.suppress(TangramError, TimeoutError):
                last = beat(who, Phase("stopped"), clock())
                await asyncio.wait_for(bus.publish(endpoint, last), 0.5)
        raise


@contextlib.asynccontextmanager
async def standby(url: str, who: Identity, period_s: float) -> AsyncIterator[None]:
    """Beat ``standby`` on a connection of its own while the body runs (a scheduler waiting for
    the lead has no other); the connection is closed when the body is done."""
    task = asyncio.get_running_loop().create_task(
        _standby(url, who, period_s), name=f"{who.service}:standby-beats"
    )
    task.add_done_callback(_said_if_died)  # the wait for the lead goes on without them
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def _said_if_died(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("standby heartbeats stopped: %r", exc)


async def _standby(url: str, who: Identity, period_s: float) -> None:
    await asyncio.sleep(STANDBY_AFTER_S)
    bus: Bus | None = None
    wait_s, said = RECONNECT_S[0], False
    try:
        while bus is None:
            try:
                bus = await _connect(url, f"{who.service}-standby")
            except TangramError as exc:  # the broker away: the wait for the lead goes on
                if not said:
                    log.warning("standby heartbeats: %s; retrying", exc)
                    said = True
                await asyncio.sleep(wait_s)
                wait_s = min(RECONNECT_S[1], wait_s * 2)
        await beating(bus, who, period_s, lambda: Phase("standby"), final=False)
    finally:
        if bus is not None:
            await bus.close()


async def _connect(url: str, name: str) -> Bus:
    """A connection; if the lead comes while it is being made (cancelled), it is let finish
    and closed aside (a connect cut half-way could leave the client's tasks behind), without
    delaying the takeover."""
    connecting = asyncio.ensure_future(Bus.connect(url, name, deadline_s=CONNECT_S))
    try:
        return await asyncio.shield(connecting)
    except asyncio.CancelledError:
        task = asyncio.ensure_future(_close_when_made(connecting))
        _closing.add(task)
        task.add_done_callback(_closing.discard)
        raise


_closing: set[asyncio.Task[None]] = set()  # connections being closed aside (held: owned)


async def _close_when_made(connecting: asyncio.Future[Bus]) -> None:
    with contextlib.suppress(Exception):
        await (await connecting).close()


# --------------------------------------------------------------------------- listening


@dataclass(slots=True)
class _Heard:
    beat: ServiceBeat
    heard_at: float  # the listener's clock
    progress_at: float  # when its counters last moved (or its window last restarted)


class Book:
    """The last beat of each instance, judged on the listener's clock (pure: ``now`` given)."""

    def __init__(self, silent_s: float, stalled_s: float, forget_s: float = FORGET_S) -> None:
        self.silent_s = silent_s
        self.stalled_s = stalled_s
        self.forget_s = forget_s
        self.members: dict[tuple[str, str], _Heard] = {}

    def heard(self, b: ServiceBeat, role: str, now: float) -> None:
        """Keep ``b``, heard on ``role``'s subject; refuse one speaking for another role."""
        if b.service != role:
            raise InvalidRequest(f"a heartbeat for {b.service!r} on the {role} subject: refused")
        key = (b.service, b.instance)
        prev = self.members.get(key)
        moved = (
            prev is None
            or prev.beat.counters != b.counters
            or prev.beat.phase != b.phase
            or (b.busy and not prev.beat.busy)
        )
        since = now if moved or prev is None else prev.progress_at
        self.members[key] = _Heard(b, now, since)
        if prev is None:
            self._bound(now)

    def _bound(self, now: float) -> None:
        """Forget the long silent; over :data:`MAX_INSTANCES`, the longest silent first."""
        old = [k for k, h in self.members.items() if now - h.heard_at > self.forget_s]
        for k in old:
            del self.members[k]
        while len(self.members) > MAX_INSTANCES:
            del self.members[min(self.members, key=lambda k: self.members[k].heard_at)]

    def health(self, h: _Heard, now: float) -> str:
        if h.beat.phase == "stopped":
            return "stopped"
        if now - h.heard_at > self.silent_s:
            return "silent"
        if h.beat.busy and now - h.progress_at > self.stalled_s:
            return "stalled"
        return "healthy"

    def rows(self, now: float) -> list[ServiceRow]:
        """Every instance heard, by role, then oldest first."""
        self._bound(now)
        heard = sorted(self.members.values(), key=lambda h: (h.beat.service, h.beat.started_at))
        return [
            ServiceRow(
                service=h.beat.service,
                instance=h.beat.instance,
                host=h.beat.host,
                pid=h.beat.pid,
                health=self.health(h, now),
                phase=h.beat.phase,
                epoch=h.beat.epoch,
                heard_s=round(now - h.heard_at, 1),
                last_progress_s=round(now - h.progress_at, 1),
                counters=dict(h.beat.counters),
            )
            for h in heard
        ]


# The services' status table, as `tangram status` and the dashboard show it (see cells).
COLUMNS: Final = (
    *("SERVICE", "INSTANCE", "HOST:PID", "HEALTH", "PHASE"),
    *("HEARD", "PROGRESS", "COUNTERS"),
)


def cells(r: ServiceRow) -> list[str]:
    """One gateway or scheduler as the leader last heard it: a row under :data:`COLUMNS`."""
    return [
        r.service,
        r.instance,
        f"{r.host}:{r.pid}",
        r.health,
        f"{r.phase}, epoch {r.epoch}" if r.epoch else r.phase,
        ago(r.heard_s),
        ago(r.last_progress_s),
        " ".join(f"{k}={v}" for k, v in sorted(r.counters.items())) or "-",
    ]


def ago(s: float | None) -> str:
    """How long ago, as the status tables say it ('?': never)."""
    return "?" if s is None else f"{s:.1f}s ago"


class Listener:
    """Serves the heartbeat subjects into a :class:`Book`. A beat that does not decode, or that
    names another role, is refused by the bus: dropped with a (rate-limited) log line."""

    def __init__(self, book: Book, clock: Callable[[], float] = time.time) -> None:
        self.book = book
        self.clock = clock

    def serve(self, bus: BaseBus) -> None:
        """Register on ``bus`` (started with its other endpoints; no queue group)."""
        for role, endpoint in ENDPOINTS.items():
            bus.serve(endpoint, self._on_beat(role), max_in_flight=1)

    def _on_beat(self, role: str) -> Callable[[ServiceBeat, Msg], Awaitable[None]]:
        async def on_beat(b: ServiceBeat, msg: Msg) -> None:
            self.book.heard(b, role, self.clock())

        return on_beat

    def rows(self) -> list[ServiceRow]:
        return self.book.rows(self.clock())
