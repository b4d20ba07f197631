"""The quota core counts SENDS, which is what a provider counts: whatever the delays between a
grant and its send (scheduler -> bus -> agent), between the send and the report, and whatever
the agent's clock reads, no interval of a window's length ever holds more sends than its limit;
and a closed loop with realistic delays still reaches >= 95% of the limit.

Why it holds: a call counts from its grant until its report, then from ``sent_at`` (never earlier
than the real send). Take any interval ``[t, t + span)`` and, of the calls sent in it, the last
one granted, at ``g``. Every other of those calls was granted before ``g`` and, at ``g``, either
still in flight (counted) or reported with a send at or after ``t > g - span`` (counted): so the
grant at ``g`` saw all of them, and admitted one more only below the limit.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.effects import Finish, StartOnNode
from services.scheduler.core.quota import QuotaCore
from services.scheduler.sim.deepsearch import Provider
from tangram.contract import Completion, HttpResponse, Outcome, QuotaSpec
from tests.unit.test_quota_core import agent, http

Delay = Callable[[], float]


@dataclass
class Loop:
    """A closed loop of callers through the pure core: each dispatch is sent ``hop()`` after
    its grant, answered ``latency_s`` later and reported ``report()`` after that; the agent's
    clock reads ``skew_s`` off the scheduler's; the scheduler wakes ``wake()`` late."""

    spec: QuotaSpec
    callers: int
    hop: Delay
    report: Delay
    wake: Delay
    latency_s: float = 0.02
    skew_s: float = 0.0
    provider: Provider | None = None  # answers by its arrival-counted window (None: 200)
    sends: list[float] = field(default_factory=list)
    answers: list[tuple[float, int]] = field(default_factory=list)

    def run(self, duration_s: float) -> list[float]:
        c = QuotaCore()
        c.set_quota(self.spec, 0.0)
        c.node_report(agent(), 0.0)
        seq = itertools.count()
        events: list[tuple[float, int, StartOnNode | Completion | None]] = []
        for n in range(self.callers):
            c.enqueue(http(f"{n}.0", job=f"job{n % 3}"), 0.0)
        now = 0.0
        while now <= duration_s:
            for e in c.schedule(now):
                if isinstance(e, StartOnNode):
                    heapq.heappush(events, (now + self.hop(), next(seq), e))
            woken = c.next_at(now)
            if woken is not None:
                heapq.heappush(events, (woken + self.wake(), next(seq), None))
            if not events:
                break
            now, _, event = heapq.heappop(events)
            if isinstance(event, StartOnNode):  # the agent sends it now
                done = self._send(event, now)
                heapq.heappush(events, (now + self.latency_s + self.report(), next(seq), done))
            elif event is not None and any(isinstance(e, Finish) for e in c.complete(event, now)):
                caller, k = event.action_id.split(".")  # the caller calls again
                c.enqueue(http(f"{caller}.{int(k) + 1}", job=f"job{int(caller) % 3}"), now)
        return self.sends

    def _send(self, e: StartOnNode, sent: float) -> Completion:
        self.sends.append(sent)
        status, retry = (200, None) if self.provider is None else self.provider.call(sent)
        self.answers.append((sent, status))
        headers = {} if retry is None else {"Retry-After": str(math.ceil(retry))}
        outcome = Outcome(
            http=HttpResponse(status=status, headers=headers),
            started_at=sent + self.skew_s,
            finished_at=sent + self.latency_s + self.skew_s,
        )
        return Completion(
            e.node_id, e.incarnation, e.action.spec.action_id, e.action.attempt, outcome
        )


def most_in_any_window(sends: list[float], span: float) -> int:
    """The largest number of sends in any interval ``[t, t + span)``."""
    sends = sorted(sends)
    j, best = 0, 0
    for i, t in enumerate(sends):
        while sends[j] <= t - span:
            j += 1
        best = max(best, i - j + 1)
    return best


delays = st.lists(st.floats(0.0, 0.3), min_size=1, max_size=50)


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(1, 8),
    hops=delays,
    reports=delays,
    skew=st.floats(-5.0, 5.0),
    callers=st.integers(1, 30),
)
def test_sends_never_exceed_the_limit_in_any_window(
    limit: int, hops: list[float], reports: list[float], skew: float, callers: int
) -> None:
    hop, report = itertools.cycle(hops), itertools.cycle(reports)
    loop = Loop(
        QuotaSpec("q", per_second=limit),
        callers,
        hop=lambda: next(hop),
        report=lambda: next(report),
        wake=lambda: 0.0,
        skew_s=skew,
    )
    sends = loop.run(duration_s=6.0)
    assert sends, "something was granted"
    assert most_in_any_window(sends, 1.0) <= limit


@settings(max_examples=20, deadline=None)
@given(hops=delays, skew=st.floats(-5.0, 5.0))
def test_per_minute_and_per_second_windows_hold_together(hops: list[float], skew: float) -> None:
    hop = itertools.cycle(hops)
    loop = Loop(
        QuotaSpec("q", per_second=4, per_minute=30),
        20,
        hop=lambda: next(hop) * 10,  # up to 3 s on the way
        report=lambda: 0.01,
        wake=lambda: 0.0,
        skew_s=skew,
    )
    sends = loop.run(duration_s=130.0)
    assert most_in_any_window(sends, 1.0) <= 4
    assert most_in_any_window(sends, 60.0) <= 30


def test_a_closed_loop_with_realistic_delays_reaches_95_percent() -> None:
    rng = random.Random(7)
    loop = Loop(
        QuotaSpec("q", per_second=50, concurrency=16),
        300,
        hop=lambda: rng.uniform(0.003, 0.015) + (rng.random() < 0.05) * 0.03,
        report=lambda: rng.uniform(0.001, 0.005),
        wake=lambda: rng.uniform(0.0, 0.002),
        latency_s=0.02,
        skew_s=0.25,
    )
    sends = loop.run(duration_s=30.0)
    steady = [t for t in sends if 5.0 <= t < 25.0]
    assert len(steady) / 20.0 >= 0.95 * 50
    assert most_in_any_window(sends, 1.0) <= 50


def test_declared_twice_too_high_converges_with_realistic_delays() -> None:
    rng = random.Random(11)
    loop = Loop(
        QuotaSpec("q", per_second=100, concurrency=16),
        300,
        hop=lambda: rng.uniform(0.003, 0.015) + (rng.random() < 0.05) * 0.03,
        report=lambda: rng.uniform(0.001, 0.005),
        wake=lambda: rng.uniform(0.0, 0.002),
        provider=Provider(limit=50),
    )
    loop.run(duration_s=40.0)
    late = [s for t, s in loop.answers if t >= 15.0]
    assert sum(s == 429 for s in late) / len(late) < 0.02
    assert sum(s == 200 for s in late) / 25.0 >= 0.9 * 50
