"""The scheduler's side of admission control: measure its backlog and how fast it drains,
and publish both to every gateway on each tick (see tangram.contract.Pressure).

Counting finishes needs no hook in the cores: each core remembers finished action ids in
``recent``, an insertion-ordered dict, so the ids added since the last tick are the ones after
the newest id seen then. Walking them backwards costs one step per finish.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.scheduler import SchedulerCore
from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import Pressure
from tangram.errors import TangramError

log = logging.getLogger(__name__)

# The drain rate is the finishes of the last few seconds: long enough to smooth one tick's
# burst of completions, short enough that the gateways' bound follows a change of load.
WINDOW_S = 5.0
# The rate while actions waited in the queue (the mesh at capacity) is trusted as its capacity
# once measured over this long; capacity measured longer ago than SATURATED_MAX_AGE_S is
# forgotten (the mix of actions may have changed).
SATURATED_MIN_S = 0.5
SATURATED_MAX_AGE_S = 60.0
# Pressure is also published as actions arrive, at most this often (and on every tick).
PRESSURE_MIN_S = 0.05


@dataclass
class DrainRate:
    """How fast the mesh finishes actions (time is passed in by the caller): over the last
    ``window_s`` of the intervals that began with actions queued, when there are enough of
    them (:meth:`at_capacity`), else over the last ``window_s`` of wall time.

    A mesh that had nothing queued finished what arrived, not what it can: over wall time, a
    burst after a quiet spell measured the quiet spell, the gateways' bound fell to its floor
    and the burst's refused submits were told to come back up to 5 s later (bench.throughput
    at 1,000/s offered after 500/s: p99 5-6 s in about one run in three)."""

    window_s: float = WINDOW_S
    total: int = 0
    _marks: deque[tuple[float, int]] = field(default_factory=deque)
    _full: deque[tuple[float, float, int]] = field(default_factory=deque)  # end, seconds, finished
    _full_s: float = 0.0
    _full_n: int = 0

    def add(self, finished: int, now: float, queued_before: bool = False) -> None:
        """``finished`` more since the last call; ``queued_before``: actions were queued at the
        last call (the interval since then ran at capacity)."""
        if queued_before and self._marks and now > self._marks[-1][0]:
            self._full.append((now, now - self._marks[-1][0], finished))
            self._full_s += now - self._marks[-1][0]
            self._full_n += finished
        while self._full and (
            now - self._full[0][0] > SATURATED_MAX_AGE_S
            or self._full_s - self._full[0][1] >= self.window_s
        ):
            _, seconds, n = self._full.popleft()
            self._full_s -= seconds
            self._full_n -= n
        if not self._full:  # no float residue left behind
            self._full_s, self._full_n = 0.0, 0
        self.total += finished
        self._marks.append((now, self.total))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.window_s:
            self._marks.popleft()

    def at_capacity(self) -> bool:
        """Whether :meth:`per_s` is the mesh's capacity (measured while actions waited)."""
        return self._full_s >= SATURATED_MIN_S

    def per_s(self) -> float:
        if self.at_capacity():
            return self._full_n / self._full_s
        if len(self._marks) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._marks[0], self._marks[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def span_s(self) -> float:
        return self._marks[-1][0] - self._marks[0][0] if self._marks else 0.0


class Gauge:
    """Owned by the scheduler's tick loop: one :meth:`publish` per tick."""

    def __init__(self, bus: BaseBus, epoch: int) -> None:
        self.bus = bus
        self.epoch = epoch
        self.rate = DrainRate()
        self._seen: int | None = None  # the cores' finishes at the last look
        self._queued = False  # whether actions were queued at the last look

    def measure(
        self, core: SchedulerCore, quotas: QuotaCore, now: float, received_up_to: float = 0.0
    ) -> Pressure:
        """The pressure now (pure but for the counters it advances); ``received_up_to``: the
        newest submission time among the actions received."""
        total = core.finished + quotas.finished
        # the first look only sets the mark: finishes before it are history
        self.rate.add(0 if self._seen is None else total - self._seen, now, self._queued)
        self._seen = total
        n, q = core.snapshot(), quotas.snapshot()
        queued = n["queued"] + q["quota_waiting"]
        self._queued = queued > 0
        return Pressure(
            epoch=self.epoch,
            queued=queued,
            running=n["running"] + q["quota_calls"],
            finished_per_s=round(self.rate.per_s(), 3),
            window_s=round(self.rate.span_s(), 3),
            received_up_to=received_up_to,
            at_capacity=self.rate.at_capacity(),
        )

    async def publish(
        self, core: SchedulerCore, quotas: QuotaCore, now: float, received_up_to: float = 0.0
    ) -> None:
        """Measure and publish; a broker that is away only delays the gateways' next look."""
        pressure = self.measure(core, quotas, now, received_up_to)
        try:
            await self.bus.publish(subjects.SCHED_PRESSURE, pressure)
        except TangramError as exc:
            log.debug("pressure not published: %s", exc)
