"""AIMD: cut on 429 once per episode, additive recovery under a ceiling, header hints, and
convergence on a provider whose real limit is half the declared one."""

from __future__ import annotations

import email.utils

import pytest

from services.scheduler.policies.quota_adaptive import (
    Aimd,
    AimdConfig,
    Hints,
    parse_delay,
    parse_hints,
)
from services.scheduler.policies.quota_limiter import Limiter, WaitUntil
from services.scheduler.sim.deepsearch import Provider, closed_loop
from tangram.contract import QuotaSpec

WALL = 1_700_000_000.0


def test_cut_once_per_episode_and_pause() -> None:
    aimd = Aimd(AimdConfig(beta=0.5), now=0.0)
    aimd.on_throttle(1.0, sent_at=0.9, retry_after_s=2.0)
    aimd.on_throttle(1.1, sent_at=0.95, retry_after_s=0.5)  # sent before the cut: same episode
    assert aimd.factor == 0.5
    assert aimd.paused_until == 3.0
    aimd.on_throttle(4.0, sent_at=3.5, retry_after_s=None)
    assert aimd.factor == 0.25
    assert aimd.paused_until == 5.0  # the default pause


def test_recovery_is_additive_and_stops_below_the_ceiling() -> None:
    cfg = AimdConfig(beta=0.5, step=0.1, period_s=1.0, headroom=0.1, probe_periods=1000)
    aimd = Aimd(cfg, now=0.0)
    aimd.on_throttle(0.0, sent_at=0.0, retry_after_s=0.0)  # ceiling 1.0, factor 0.5
    aimd.on_success(2.5)
    assert aimd.factor == pytest.approx(0.7)
    aimd.on_success(100.0)
    assert aimd.factor == pytest.approx(0.9)


def test_probing_raises_the_ceiling_after_calm_periods() -> None:
    cfg = AimdConfig(beta=0.5, step=1.0, headroom=0.0, probe_periods=5, probe_step=0.1)
    aimd = Aimd(cfg, now=0.0)
    aimd.on_throttle(0.0, sent_at=0.0, retry_after_s=0.0)
    aimd.on_throttle(1.0, sent_at=1.0, retry_after_s=0.0)  # ceiling 0.5
    aimd.on_success(7.0)
    assert aimd.factor == pytest.approx(0.6)


def test_hints_pause_when_nothing_remains() -> None:
    aimd = Aimd(now=0.0)
    aimd.on_hints(Hints(remaining=3, reset_s=10.0), 0.0)
    assert aimd.paused_until < 0
    aimd.on_hints(Hints(remaining=0, reset_s=10.0), 0.0)
    assert aimd.paused_until == 10.0
    assert aimd.factor == 1.0, "a hint is not a 429: no cut"


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("2", 2.0),
        ("0.25", 0.25),
        ("6m0s", 360.0),
        ("1m30.5s", 90.5),
        ("20ms", 0.02),
        (str(WALL + 30), 30.0),
        (email.utils.formatdate(WALL + 60, usegmt=True), 60.0),
        ("-5", 0.0),
        ("soon", None),
        ("nan", None),
        ("", None),
    ],
)
def test_parse_delay(value: str, seconds: float | None) -> None:
    assert parse_delay(value, WALL) == (None if seconds is None else pytest.approx(seconds))


def test_parse_hints_takes_the_exhausted_family() -> None:
    headers = {
        "Retry-After": "3",
        "X-RateLimit-Remaining-Requests": "0",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-remaining-tokens": "5000",
        "x-ratelimit-reset-tokens": "45s",
    }
    assert parse_hints(headers, WALL) == Hints(retry_after_s=3.0, remaining=0.0, reset_s=1.0)
    assert parse_hints({"x-ratelimit-remaining": "junk"}, WALL) == Hints()


def test_limiter_honours_hints() -> None:
    lim = Limiter(QuotaSpec("q", per_second=100))
    lim.observe(parse_hints({"x-ratelimit-remaining": "0", "x-ratelimit-reset": "2"}, WALL), 1.0)
    assert lim.try_acquire(1, 0, 1.5) == WaitUntil(3.0, "paused")


def test_a_quota_declared_twice_too_high_converges() -> None:
    limiter = Limiter(QuotaSpec("search", per_second=40))
    provider = Provider(limit=20)
    log = closed_loop(limiter, provider, callers=100, latency_s=0.05, duration_s=300.0)
    learned = limiter.learned_rates()["per_second"]
    assert learned == pytest.approx(20, rel=0.10)
    assert log.ok_rate(100.0, 300.0) == pytest.approx(20, rel=0.10)
    assert log.share_429(since=100.0) < 0.02
    assert log.share_429(since=0.0) > 0, "the provider did push back at first"


def test_a_quota_declared_right_never_sees_a_429() -> None:
    limiter = Limiter(QuotaSpec("search", per_second=20))
    log = closed_loop(limiter, Provider(limit=20), callers=100, latency_s=0.05, duration_s=60.0)
    assert log.share_429(since=0.0) == 0
    assert log.ok_rate(0.0, 60.0) >= 0.95 * 20
