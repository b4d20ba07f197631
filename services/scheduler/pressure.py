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
# Pressure is also published as actions arrive, at most this often (and on every tick).
PRESSURE_MIN_S = 0.05


@dataclass
class DrainRate:
    """Finishes per second over the last ``window_s`` (time is passed in by the caller)."""

    window_s: float = WINDOW_S
    total: int = 0
    _marks: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, finished: int, now: float) -> None:
        self.total += finished
        self._marks.append((now, self.total))
        while len(self._marks) > 2 and now - self._marks[1][0] >= self.window_s:
            self._marks.popleft()

    def per_s(self) -> float:
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

    def measure(
        self, core: SchedulerCore, quotas: QuotaCore, now: float, received_up_to: float = 0.0
    ) -> Pressure:
        """The pressure now (pure but for the counters it advances); ``received_up_to``: the
        newest submission time among the actions received."""
        total = core.finished + quotas.finished
        # the first look only sets the mark: finishes before it are history
        self.rate.add(0 if self._seen is None else total - self._seen, now)
        self._seen = total
        n, q = core.snapshot(), quotas.snapshot()
        return Pressure(
            epoch=self.epoch,
            queued=n["queued"] + q["quota_waiting"],
            running=n["running"] + q["quota_calls"],
            finished_per_s=round(self.rate.per_s(), 3),
            window_s=round(self.rate.span_s(), 3),
            received_up_to=received_up_to,
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
