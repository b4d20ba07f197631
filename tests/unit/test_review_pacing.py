"""Review of quota pacing (49fd34b, 6a98b33): cases where pacing disagrees with its docstrings."""

from __future__ import annotations

import pytest

from services.scheduler.policies.quota_limiter import Grant, Limiter, WaitUntil
from tangram.contract import QuotaSpec

from .test_quota_core import core, http, lease, results, starts
from .test_quota_limiter import grant


def test_a_throttled_window_still_admits_one_request_per_window() -> None:
    """The module docstring: "an empty window always admits one request, so a limit never
    scales below one per window". After 429s cut the AIMD factor (per_second=1: cap 1/32), the
    window is empty again one second after the last send, yet the pace (span / (limit *
    factor)) holds the next queued call for 32 s."""
    lim = Limiter(QuotaSpec("q", per_second=1), margin_s=0.0)
    now = 0.0
    for _ in range(5):  # five 429 episodes: factor 1 -> 1/32
        now, g = _granted(lim, now)
        lim.release(g, now, sent_at=now, status=429, retry_after_s=0.0)
    assert lim.adaptive.factor == pytest.approx(1 / 32)
    now, g = _granted(lim, now)
    lim.release(g, now, sent_at=now)  # no status: the factor stays
    later = now + 1.0  # the window (span 1 s) is empty again
    assert lim.next_free_at(later, queued=9) == later  # paced: now + 32 s


def _granted(lim: Limiter, now: float) -> tuple[float, Grant]:
    """Retry as the core does, at each answer, until granted (ten calls queued)."""
    while not isinstance(got := lim.try_acquire(1, 0, now, queued=10), Grant):
        now = got.at
    return now, got


def test_cancelled_calls_left_in_the_fair_queue_do_not_pace_the_live_ones() -> None:
    """Five live calls for ten a second have room at once ("a window with room for every
    queued call grants them at once"); twenty cancelled calls still sitting in the fair
    queue (skipped only when they come up) make ``len(q.queue)`` 25, so the five are paced."""
    c = core(QuotaSpec("q", per_second=10))
    for aid in "abcde":
        c.enqueue(http(aid), 0.0)
    for k in range(20):
        c.enqueue(http(f"x{k}"), 0.0)
    for k in range(20):
        assert results(c.cancel(f"x{k}", 0.0))
    assert c.states(0.0)[0].queued == 5
    assert len(starts(c.schedule(0.0))) == 5  # paced: 1


def test_timed_out_calls_left_in_the_fair_queue_do_not_pace_the_live_ones() -> None:
    """As above with queue timeouts: expired calls leave ``waiting`` but not the fair queue."""
    c = core(QuotaSpec("q", per_second=10))
    for aid in "abcde":
        c.enqueue(http(aid), 0.0)
    for k in range(20):
        c.enqueue(http(f"x{k}", queue_timeout_s=0.5), 0.0)
    assert len(results(c.tick(1.0))) == 20
    assert len(starts(c.schedule(1.0))) == 5  # paced: 1


def test_leases_of_many_units_queued_for_a_window_are_paced() -> None:
    """Three leases of 4 units want 12 units of a 10-a-second window: more than it holds. The
    queue is counted in calls (3) against the window's units (10), so it is taken as having
    room: two leases (8 units) are granted at once, a burst, then the third waits a window."""
    c = core(QuotaSpec("q", per_second=10))
    for aid in "abc":
        c.enqueue(lease(aid, units=4), 0.0)
    granted = results(c.schedule(0.0))
    assert len(granted) == 1  # not paced: 2


def test_a_respec_keeps_the_pace() -> None:
    """A saturated per_second=10 window paces one call every 0.1 s; a respec that only adds
    a per_day window (every old window carried) forgets the pace: the next call is granted
    at once, 10 ms after the previous one."""
    lim = Limiter(QuotaSpec("q", per_second=10), margin_s=0.0)
    grant(lim.try_acquire(1, 0, 0.0, queued=30))
    assert isinstance(lim.try_acquire(1, 0, 0.01, queued=29), WaitUntil)
    lim.respec(QuotaSpec("q", per_second=10, per_day=100_000))
    got = lim.try_acquire(1, 0, 0.01, queued=29)
    assert not isinstance(got, Grant)  # paced before the respec; granted at once after it
