"""Admission control: refuse new work with ``busy`` before the mesh's queues explode.

Pure: no I/O, no clock (an admission's time is its action's submission time). The backlog is
the scheduler's last :class:`~tangram.contract.Pressure` (accepted-but-unfinished actions,
published every tick) plus what this gateway admitted that the scheduler had not received by
then: the report says the newest submission time it received (``received_up_to``), and the
admissions up to it are forgotten (and an admission that handed the scheduler nothing, a
duplicate or a refused submit, at once: :meth:`Admission.void`). So a burst between two reports
is counted at once, and what finished long ago is not: counting every admission of the last
two intervals instead (as an older scheduler's reports, without that time, still are) refused a
fast service's calls at ~1,800 a second as a backlog of 669 while 64 were open (`bench/gpu.py`:
300 calls/s, its calls waiting out a busy retry of 2 s, against 1,800-2,000 calls/s).
The bound is seconds of work at the measured drain rate, with a floor (a cold mesh has no rate
yet) and a ceiling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tangram.contract import Pressure
from tangram.errors import Busy

# A refused client is told to come back when the backlog has drained to this share of the
# bound: the mesh still has work queued when the retries arrive (it never idles waiting for
# them), and the room freed by then takes a good part of the refused burst.
REFILL_AT = 0.5
RETRY_MIN_S = 0.05  # never ask for a retry sooner (the backlog is over the bound now)
RETRY_MAX_S = 5.0  # nor later: the rate may have risen, and clients have a budget
# nothing finished lately (no rate to compute a drain time from), or the rate is only what
# arrived (the mesh was never at capacity lately): come back this soon at the latest
RETRY_COLD_S = 1.0


@dataclass(frozen=True, slots=True)
class Bounds:
    """The backlog a gateway accepts: ``backlog_s`` of work, within [``floor``, ``ceiling``]
    (its values come from the gateway's config, ``GatewayConfig.bounds``)."""

    backlog_s: float
    floor: int
    ceiling: int
    enabled: bool = True


def limit(rate_per_s: float, bounds: Bounds) -> int:
    """The most accepted-but-unfinished actions the mesh should hold at this drain rate."""
    return min(bounds.ceiling, max(bounds.floor, int(rate_per_s * bounds.backlog_s)))


def retry_after(backlog: int, bound: int, rate_per_s: float, at_capacity: bool = True) -> float:
    """Seconds until ``backlog`` has drained to ``REFILL_AT`` of ``bound`` (clamped); at most
    ``RETRY_COLD_S`` when the rate is not the mesh's capacity (it may drain much faster)."""
    if rate_per_s <= 0:
        return RETRY_COLD_S
    drain_s = (backlog - REFILL_AT * bound) / rate_per_s
    top = RETRY_MAX_S if at_capacity else RETRY_COLD_S
    return round(min(top, max(RETRY_MIN_S, drain_s)), 3)


def _busy(
    backlog: int, bound: int, rate_per_s: float, bounds: Bounds, at_capacity: bool = True
) -> Busy:
    wait_s = retry_after(backlog, bound, rate_per_s, at_capacity)
    return Busy(
        f"the mesh is busy: {backlog} accepted actions are not finished, the limit is {bound} "
        f"(~{bounds.backlog_s:g}s of work at {rate_per_s:.0f} finished/s); "
        f"retry after {wait_s:g}s",
        retry_after_s=wait_s,
    )


@dataclass(slots=True)
class Admitted:
    """One admission a report has not yet said the scheduler received (``counted`` until it
    does, or until the gateway learns it never will: see :meth:`Admission.void`)."""

    submitted_at: float
    counted: bool = True


class Admission:
    """The gateway's view of the backlog: the last report plus what it admitted since."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.reported = 0  # queued + running in the scheduler's last report
        self.rate_per_s = 0.0
        self.at_capacity = False  # whether the rate was measured while actions waited
        # what this gateway admitted that the last report does not count (oldest first)
        self._unseen: deque[Admitted] = deque()
        self._counted = 0  # of those, the ones still counted
        self._older = 0  # a report without ``received_up_to``: the interval before it, counted
        self.bound = limit(0.0, bounds) if bounds.enabled else 2**62
        self.refused = 0
        self.reports = 0

    @property
    def backlog(self) -> int:
        return self.reported + self._older + self._counted

    def observe(self, pressure: Pressure) -> None:
        """A new report replaces the estimate: what it says the scheduler received is in it."""
        self.reported = pressure.backlog
        self.rate_per_s = pressure.finished_per_s
        self.at_capacity = pressure.at_capacity
        seen = pressure.received_up_to
        if seen > 0:
            while self._unseen and self._unseen[0].submitted_at <= seen:
                self.void(self._unseen.popleft())
            self._older = 0
        else:  # an older scheduler: what was admitted before the last report may be in flight
            self._older = self._counted
            while self._unseen:
                self.void(self._unseen.popleft())
        if self.bounds.enabled:
            self.bound = limit(self.rate_per_s, self.bounds)
        self.reports += 1

    def take(self, submitted_at: float = 0.0) -> Admitted | Busy:
        """Count one more action in (submitted at ``submitted_at``, the gateway's clock), or
        say why not (the caller raises it). The submit path's cost: a comparison and an
        append."""
        if self.backlog < self.bound:
            admitted = Admitted(submitted_at)
            self._unseen.append(admitted)
            self._counted += 1
            return admitted
        self.refused += 1
        return _busy(self.backlog, self.bound, self.rate_per_s, self.bounds, self.at_capacity)

    def admit(self, submitted_at: float = 0.0) -> Busy | None:
        """:meth:`take`, for a caller that never voids: None when admitted."""
        taken = self.take(submitted_at)
        return taken if isinstance(taken, Busy) else None

    def void(self, admitted: Admitted) -> None:
        """Stop counting an admission: a report counts it now, or the scheduler will never
        receive it (a duplicate of a durable action, refused at intake, not committed).
        Counted until a later action reached the scheduler, such phantoms filled the bound
        on a quiet mesh, and then no later action got in: a client replaying 512 finished
        action ids left its gateway answering ``busy`` to every new submit, for good."""
        if admitted.counted:
            admitted.counted = False
            self._counted -= 1
