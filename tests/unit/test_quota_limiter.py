"""The limiter: concurrency, sliding request windows, token reservation and true-up."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies.quota_limiter import Grant, Limiter, WaitUntil
from tangram.contract import QuotaSpec
from tangram.errors import InvalidRequest


def grant(result: Grant | WaitUntil) -> Grant:
    assert isinstance(result, Grant), result
    return result


def test_concurrency_held_until_release() -> None:
    lim = Limiter(QuotaSpec("q", concurrency=2))
    a, _ = grant(lim.try_acquire(1, 0, 0.0)), grant(lim.try_acquire(1, 0, 0.0))
    assert lim.try_acquire(1, 0, 0.0) == WaitUntil(math.inf, "concurrency")
    assert lim.next_free_at(0.0) == math.inf
    assert lim.release(a, 0.1)
    assert not lim.release(a, 0.1), "a second release is a no-op"
    grant(lim.try_acquire(1, 0, 0.1))


def test_per_second_window_waits_for_oldest_to_expire() -> None:
    lim = Limiter(QuotaSpec("q", per_second=3), margin_s=0.0)
    for t in (0.0, 0.2, 0.4):
        lim.release(grant(lim.try_acquire(1, 0, t)), t)
    assert lim.try_acquire(1, 0, 0.5) == WaitUntil(1.0, "rate")
    assert lim.next_free_at(0.5) == 1.0
    grant(lim.try_acquire(1, 0, 1.0))
    assert lim.try_acquire(2, 0, 1.0) == WaitUntil(1.4, "rate")


def test_below_one_per_second_stretches_the_window() -> None:
    lim = Limiter(QuotaSpec("q", per_second=0.5), margin_s=0.0)
    lim.release(grant(lim.try_acquire(1, 0, 0.0)), 0.5, sent_at=0.0)
    assert lim.try_acquire(1, 0, 1.0) == WaitUntil(2.0, "rate")


def test_the_longest_blocking_window_wins() -> None:
    lim = Limiter(QuotaSpec("q", per_second=10, per_minute=3), margin_s=0.0)
    for t in (0.0, 0.1, 0.2):
        lim.release(grant(lim.try_acquire(1, 0, t)), t, sent_at=t)
    assert lim.try_acquire(1, 0, 0.3) == WaitUntil(60.0, "rate")


def test_a_call_in_flight_counts_until_its_release_then_from_its_send() -> None:
    lim = Limiter(QuotaSpec("q", per_second=1), margin_s=0.01)
    g = grant(lim.try_acquire(1, 0, 0.0))
    assert lim.try_acquire(1, 0, 5.0) == WaitUntil(math.inf, "rate"), "in flight: no expiry"
    lim.release(g, 5.2, sent_at=4.9)  # sent late (a slow hop): counted from the send
    assert lim.try_acquire(1, 0, 5.2) == WaitUntil(5.91, "rate")
    lim.release(grant(lim.try_acquire(1, 0, 5.91)), 6.0)  # send unknown: from the release
    assert lim.next_free_at(6.0) == 7.01


def test_a_send_time_is_kept_between_the_grant_and_the_release() -> None:
    lim = Limiter(QuotaSpec("q", per_second=1), margin_s=0.0)
    lim.release(grant(lim.try_acquire(1, 0, 1.0)), 2.0, sent_at=0.0)  # a skewed clock
    assert lim.next_free_at(2.0) == 2.0
    lim.release(grant(lim.try_acquire(1, 0, 2.0)), 2.5, sent_at=9.0)
    assert lim.next_free_at(2.5) == 3.5


def test_tokens_reserved_then_trued_up() -> None:
    lim = Limiter(QuotaSpec("llm", tokens_per_minute=1000), margin_s=0.0)
    g = grant(lim.try_acquire(1, 800, 0.0))
    assert lim.try_acquire(1, 300, 1.0) == WaitUntil(math.inf, "tokens")
    lim.release(g, 2.0, sent_at=0.0, tokens_used=500)
    grant(lim.try_acquire(1, 300, 2.0))
    assert isinstance(lim.try_acquire(1, 300, 3.0), WaitUntil)


def test_true_up_above_the_estimate_blocks_later_calls() -> None:
    lim = Limiter(QuotaSpec("llm", tokens_per_minute=1000), margin_s=0.0)
    lim.release(grant(lim.try_acquire(1, 100, 0.0)), 1.0, sent_at=0.0, tokens_used=950)
    assert lim.try_acquire(1, 100, 1.0) == WaitUntil(60.0, "tokens")


def test_true_up_after_expiry_does_not_corrupt_the_count() -> None:
    lim = Limiter(QuotaSpec("llm", tokens_per_minute=1000), margin_s=0.0)
    g = grant(lim.try_acquire(1, 900, 0.0))
    lim.release(g, 61.0, sent_at=0.5, tokens_used=10)
    grant(lim.try_acquire(1, 1000, 61.0))


@pytest.mark.parametrize(
    ("spec", "units", "tokens"),
    [
        (QuotaSpec("q", per_second=2), 3, 0),
        (QuotaSpec("q", concurrency=1), 2, 0),
        (QuotaSpec("q", tokens_per_minute=100), 1, 101),
        (QuotaSpec("q", per_second=2), 0, 0),
        (QuotaSpec("q", per_second=2), 1, -1),
    ],
)
def test_impossible_requests_are_caller_errors(spec: QuotaSpec, units: int, tokens: int) -> None:
    with pytest.raises(InvalidRequest):
        Limiter(spec).try_acquire(units, tokens, 0.0)


def test_a_429_pauses_and_still_spends_quota() -> None:
    lim = Limiter(QuotaSpec("q", per_second=2), margin_s=0.0)
    g = grant(lim.try_acquire(1, 0, 0.0))
    lim.release(g, 0.1, status=429, retry_after_s=3.0)
    assert lim.try_acquire(1, 0, 1.0) == WaitUntil(3.1, "paused")
    assert lim.learned_rates() == {"per_second": 1.0}


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(1, 6),
    span=st.sampled_from([1.0, 60.0]),
    gaps=st.lists(st.floats(0.0, 0.7), min_size=1, max_size=80),
    units=st.lists(st.integers(1, 3), min_size=80, max_size=80),
)
def test_no_interval_of_a_window_holds_more_than_the_limit(
    limit: int, span: float, gaps: list[float], units: list[int]
) -> None:
    field = "per_second" if span == 1.0 else "per_minute"
    lim = Limiter(QuotaSpec("q", **{field: limit}), margin_s=0.0)
    granted: list[tuple[float, int]] = []
    now = 0.0
    for gap, n in zip(gaps, units, strict=False):
        now += gap * span
        n = min(n, limit)
        result = lim.try_acquire(n, 0, now)
        if isinstance(result, Grant):
            granted.append((now, n))
            lim.release(result, now, status=200)
        else:
            assert result.at > now
    for start, _ in granted:
        inside = sum(n for t, n in granted if start <= t < start + span)
        assert inside <= limit


@settings(max_examples=40, deadline=None)
@given(steps=st.lists(st.tuples(st.floats(0, 0.3), st.integers(1, 3)), max_size=60))
def test_waiting_until_the_answer_then_retrying_is_granted(steps: list[tuple[float, int]]) -> None:
    lim = Limiter(QuotaSpec("q", per_second=4, per_minute=30), margin_s=0.0)
    now = 0.0
    for gap, n in steps:
        now += gap
        result = lim.try_acquire(n, 0, now)
        if isinstance(result, WaitUntil):
            now = result.at
            result = lim.try_acquire(n, 0, now)
        lim.release(grant(result), now)


def test_a_saturated_window_paces_its_grants_evenly() -> None:
    """Thirty calls queued for ten a second: one every 0.1 s, not ten at once then one per
    expiry; the window's own limit still holds."""
    lim = Limiter(QuotaSpec("q", per_second=10), margin_s=0.0)
    grant(lim.try_acquire(1, 0, 0.0, queued=30))
    assert lim.try_acquire(1, 0, 0.0, queued=29) == WaitUntil(0.1, "rate")
    assert lim.next_free_at(0.05, queued=29) == pytest.approx(0.1)
    grant(lim.try_acquire(1, 0, 0.1, queued=29))
    grant(lim.try_acquire(2, 0, 0.2, queued=28))  # two units: the next two paces later
    assert lim.try_acquire(1, 0, 0.3, queued=26) == WaitUntil(pytest.approx(0.4), "rate")


def test_a_window_with_room_for_every_queued_call_grants_them_at_once() -> None:
    lim = Limiter(QuotaSpec("q", per_second=10), margin_s=0.0)
    for left in range(10, 0, -1):
        grant(lim.try_acquire(1, 0, 0.0, queued=left))
    assert lim.try_acquire(1, 0, 0.0, queued=1) == WaitUntil(math.inf, "rate")  # full


def test_day_windows_and_callers_without_a_queue_are_not_paced() -> None:
    per_day = Limiter(QuotaSpec("q", per_day=1000), margin_s=0.0)
    for left in range(50, 0, -1):
        grant(per_day.try_acquire(1, 0, 0.0, queued=left + 2000))
    per_second = Limiter(QuotaSpec("q", per_second=10), margin_s=0.0)
    for _ in range(10):
        grant(per_second.try_acquire(1, 0, 0.0))  # queued unknown (0): as before
