"""``Timings.wait_s``: the time a quota action waited for its limiter, and only that. It runs
from the scheduler's receipt of the action until the limiter could admit it (the time its
refusal named, or the release that ended a wait for one), not until the pass that granted it:
a late pass, a missing quota agent and the hops are the system's (bench.quota subtracts
``wait_s`` alone from the client's time). A retried call's waits add up; a call cancelled or
timed out while waiting waited until then."""

from __future__ import annotations

import pytest

from services.scheduler.core.effects import StartOnNode
from services.scheduler.core.quota import QuotaCore
from tangram.contract import (
    ActionResult,
    ErrorKind,
    LeaseEnd,
    QuotaSpec,
    Timings,
)
from tangram.contract.base import _Msg, codec, encode

from .test_quota_core import agent, answer, core, http, lease, results, starts


def timings(r: ActionResult) -> Timings:
    assert r.timings is not None
    assert r.timings.queue_s >= r.timings.wait_s
    return r.timings


def done(c: QuotaCore, s: StartOnNode, at: float) -> Timings:
    """Complete ``s`` (sent 2 ms after ``at``); its result's timings."""
    (r,) = results(c.complete(answer(s, at=at + 0.002), at + 0.03))
    assert r.ok, r
    return timings(r)


def test_a_call_admitted_at_once_waited_nothing() -> None:
    """Received at 1.0 (submitted 10 ms earlier), granted by a pass 4 ms later: that pass is
    the system's, the limiter held it for no time."""
    c = core(QuotaSpec("q", per_second=10))
    c.enqueue(http("a", now=0.99), 1.0)
    (s,) = starts(c.schedule(1.004))
    t = done(c, s, 1.004)
    assert t.wait_s == 0.0
    assert t.queue_s == pytest.approx(0.016)


def test_calls_held_by_a_saturated_window_wait_until_the_limiter_admits_them() -> None:
    """Twelve calls for a window of ten a second are paced one every 0.1 s: each waits until
    its pace, whatever the time of the pass that grants it (the third's comes 30 ms late)."""
    c = core(QuotaSpec("q", per_second=10))
    for k in range(12):
        c.enqueue(http(f"c{k}"), 0.0)
    (a,) = starts(c.schedule(0.0))
    assert c.next_at(0.0) == pytest.approx(0.1)
    (b,) = starts(c.schedule(0.1))
    assert c.next_at(0.1) == pytest.approx(0.2)
    assert starts(c.schedule(0.15)) == []  # a pass before the pace grants nothing
    (third,) = starts(c.schedule(0.23))
    waits = [done(c, s, at).wait_s for s, at in ((a, 0.0), (b, 0.1), (third, 0.23))]
    assert waits == pytest.approx([0.0, 0.1, 0.2])


def test_a_call_behind_a_full_concurrency_limit_waits_until_the_release() -> None:
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(http("a"), 0.0)
    c.enqueue(http("b"), 0.1)
    (a,) = starts(c.schedule(0.1))
    assert starts(c.schedule(0.2)) == []
    done(c, a, 0.47)  # released at 0.5
    (b,) = starts(c.schedule(0.504))
    assert done(c, b, 0.504).wait_s == pytest.approx(0.4)  # 0.1 -> 0.5, not the pass at 0.504


def test_a_wait_for_a_quota_agent_is_not_the_limiters() -> None:
    c = core(QuotaSpec("q", per_second=10), agents=0)
    c.enqueue(http("a"), 0.0)
    assert starts(c.schedule(0.0)) == []
    c.node_report(agent(), 0.5)
    (s,) = starts(c.schedule(0.5))
    assert done(c, s, 0.5).wait_s == 0.0


def test_a_retried_call_adds_up_its_waits() -> None:
    """Held 0.3 s behind another call, then answered 429 with Retry-After: 1: the retry waits
    out the pause (granted by a pass 50 ms after it ends): 0.3 + 1.0 s."""
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(http("x"), 0.0)
    c.enqueue(http("a"), 0.0)
    (x,) = starts(c.schedule(0.0))
    done(c, x, 0.27)  # released at 0.3
    (a1,) = starts(c.schedule(0.31))
    assert (
        c.complete(answer(a1, 429, headers={"Retry-After": "1"}, at=0.32), 0.4) == []
    )  # queued again
    assert starts(c.schedule(0.4)) == []
    assert c.next_at(0.4) == pytest.approx(1.4)  # the pause
    (a2,) = starts(c.schedule(1.45))
    t = done(c, a2, 1.45)
    assert t.wait_s == pytest.approx(1.3)


def test_a_call_cancelled_or_timed_out_while_waiting_waited_until_then() -> None:
    """Both wait behind a call holding the one unit: the cancelled one from its receipt at
    0.1 to its cancel at 0.7; the timed-out one (received at 0.2, submitted at 0.0) until its
    queue timeout ends it at 0.6."""
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(http("x"), 0.0)
    c.enqueue(http("a"), 0.1)
    c.enqueue(http("b", queue_timeout_s=0.5), 0.2)
    assert len(starts(c.schedule(0.2))) == 1
    (timed_out,) = results(c.tick(0.6))
    (cancelled,) = results(c.cancel("a", 0.7))
    assert timed_out.error is not None
    assert timed_out.error.kind is ErrorKind.QUEUE_TIMEOUT
    assert timings(timed_out).wait_s == pytest.approx(0.4)
    assert timings(timed_out).queue_s == pytest.approx(0.6)
    assert cancelled.status == "cancelled"
    assert timings(cancelled).wait_s == pytest.approx(0.6)


def test_a_lease_waits_for_the_lease_before_it() -> None:
    c = core(QuotaSpec("q", concurrency=2))
    c.enqueue(lease("first", units=2), 0.0)
    c.enqueue(lease("second"), 0.1)
    (first,) = results(c.schedule(0.1))
    assert timings(first).wait_s == 0.0
    assert results(c.schedule(0.2)) == []
    c.lease_end(LeaseEnd(lease_id="first"), 0.9)
    (second,) = results(c.schedule(0.95))
    assert second.lease is not None
    assert timings(second).wait_s == pytest.approx(0.8)


def test_a_new_arrival_after_an_empty_queue_is_not_charged_an_old_refusal() -> None:
    """The last refusal (a pace until 0.1) is forgotten once the queue empties: a call that
    comes when the window has room again waits nothing."""
    c = core(QuotaSpec("q", per_second=10))
    c.enqueue(http("a"), 0.0)
    c.enqueue(http("b"), 0.0)
    c.enqueue(http("x"), 0.0)
    assert results(c.cancel("x", 0.0))
    assert len(starts(c.schedule(0.0))) == 2  # room for both: no pace
    c.enqueue(http("late"), 3.0)
    (s,) = starts(c.schedule(3.01))
    assert done(c, s, 3.01).wait_s == 0.0


class OldTimings(_Msg):
    """Timings as a peer built before ``wait_s`` knows them."""

    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0
    restore_s: float = 0.0


def test_wait_s_is_additive_on_the_wire() -> None:
    old = OldTimings(submitted_at=1.0, queue_s=0.5)
    assert codec.decode(encode(old), Timings) == Timings(submitted_at=1.0, queue_s=0.5)
    new = Timings(submitted_at=1.0, queue_s=0.5, wait_s=0.25)
    assert codec.decode(encode(new), OldTimings) == old
