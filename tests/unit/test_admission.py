"""Admission control, the pure parts: the gateway's decision (backlog, drain rate -> admit or
busy with a retry-after), the scheduler's measure of its drain rate, the pressure message's
bounds, and the client's pause on ``busy``."""

from __future__ import annotations

import math

import msgspec
import pytest

from services.gateway.admission import (
    RETRY_COLD_S,
    RETRY_MAX_S,
    RETRY_MIN_S,
    Admission,
    Admitted,
    Bounds,
    limit,
    retry_after,
)
from services.gateway.config import load as load_gateway_config
from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.pressure import DrainRate, Gauge
from tangram.bus import decode_request
from tangram.client import BUSY_JITTER, BUSY_MAX_S, _pause
from tangram.contract import ActionResult, ErrorReply, Pressure, codec, encode
from tangram.errors import Busy, RemoteError, Unavailable

from .core_kit import action as kit_action

BOUNDS = Bounds(backlog_s=5.0, floor=100, ceiling=10_000)


def refusal(backlog: int, rate_per_s: float, bounds: Bounds) -> Busy | None:
    """The gateway's decision on one more submit after a report of ``backlog`` draining at
    ``rate_per_s`` (measured at capacity)."""
    admission = Admission(bounds)
    admission.observe(Pressure(queued=backlog, finished_per_s=rate_per_s, at_capacity=True))
    return admission.admit()


# ----------------------------------------------------------------------------- the decision


def test_the_limit_is_seconds_of_work_within_floor_and_ceiling() -> None:
    assert limit(0.0, BOUNDS) == 100  # cold mesh: the floor takes a burst
    assert limit(10.0, BOUNDS) == 100  # 50 actions of work: still the floor
    assert limit(220.0, BOUNDS) == 1100  # 5 s at the rate measured in issue 13
    assert limit(1e6, BOUNDS) == 10_000  # the ceiling, whatever the rate


def test_below_the_limit_is_admitted() -> None:
    assert refusal(0, 220.0, BOUNDS) is None
    assert refusal(1099, 220.0, BOUNDS) is None


def test_at_the_limit_busy_names_backlog_limit_and_when_to_retry() -> None:
    busy = refusal(2200, 220.0, BOUNDS)
    assert isinstance(busy, Busy)
    assert busy.code == "busy"
    assert busy.retryable
    assert "2200 accepted actions are not finished" in busy.message
    assert "the limit is 1100" in busy.message
    # back when the backlog has drained to half the limit: (2200 - 550) / 220 = 7.5 s, capped
    assert busy.retry_after_s == RETRY_MAX_S
    reply = busy.to_reply()
    assert reply.code == "busy"
    assert reply.retry_after_s == RETRY_MAX_S


def test_retry_after_is_the_drain_time_to_half_the_limit() -> None:
    assert retry_after(1100, 1100, 220.0) == pytest.approx(2.5)
    assert retry_after(1650, 1100, 220.0) == pytest.approx(5.0)
    assert retry_after(100, 100, 1e5) == RETRY_MIN_S  # tiny drain time: the floor
    assert retry_after(100, 100, 0.0) == RETRY_COLD_S  # no rate to divide by


def test_a_disabled_gateway_admits_anything() -> None:
    off = Bounds(backlog_s=1.0, floor=1, ceiling=1, enabled=False)
    assert refusal(10**9, 0.0, off) is None
    admission = Admission(off)
    assert all(admission.admit() is None for _ in range(1000))


def test_admission_counts_what_it_admitted_since_the_report_before_the_last() -> None:
    admission = Admission(Bounds(backlog_s=1.0, floor=3, ceiling=1000))
    assert [admission.admit() is None for _ in range(4)] == [True, True, True, False]
    assert admission.refused == 1
    # a report with a rate: room again. The 3 admitted just before it may not be in it yet
    # (their Enqueue on its way to the scheduler), so they still count for one interval.
    admission.observe(Pressure(queued=1, running=1, finished_per_s=10.0, window_s=5.0))
    assert admission.bound == 10
    assert sum(admission.admit() is None for _ in range(20)) == 5
    assert admission.backlog == 10
    # the next report has them: only what was admitted since the last report still counts
    admission.observe(Pressure(queued=6, running=2, finished_per_s=10.0, window_s=5.0))
    assert admission.backlog == 8 + 5
    admission.observe(Pressure(queued=6, running=2, finished_per_s=10.0, window_s=5.0))
    assert admission.backlog == 8
    assert sum(admission.admit() is None for _ in range(20)) == 2


def test_the_config_gives_the_bounds_and_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, cfg = load_gateway_config()
    assert cfg.bounds() == Bounds(backlog_s=5.0, floor=512, ceiling=100_000, enabled=True)
    monkeypatch.setenv("TANGRAM_GATEWAY_MIN_BACKLOG", "4")
    monkeypatch.setenv("TANGRAM_GATEWAY_ADMISSION", "false")
    _, cfg = load_gateway_config()
    assert cfg.bounds().floor == 4
    assert not cfg.bounds().enabled


# ----------------------------------------------------------------------------- the message


@pytest.mark.parametrize(
    "raw",
    [
        {"type": "pressure", "queued": -1},
        {"type": "pressure", "running": 10**12},
        {"type": "pressure", "finished_per_s": math.nan},
        {"type": "pressure", "finished_per_s": math.inf},
        {"type": "pressure", "queued": "many"},
        {"type": "pressure", "received_up_to": math.nan},  # would keep every admission counted
        {"type": "pressure", "received_up_to": math.inf},  # would forget every admission
        {"type": "pressure", "received_up_to": -1.0},
        {"type": "pressure", "at_capacity": "yes"},  # would lift the 1 s cap on retries
        {"type": "pressure", "at_capacity": 1},
        {"type": "something-else"},
    ],
)
def test_a_hostile_pressure_report_is_refused_by_the_codec(raw: dict[str, object]) -> None:
    assert isinstance(decode_request(msgspec.msgpack.encode(raw), Pressure), ErrorReply)


def test_garbage_is_refused_and_a_valid_report_round_trips() -> None:
    assert isinstance(decode_request(b"\xc1\xff garbage", Pressure), ErrorReply)
    p = Pressure(
        epoch=3,
        queued=5,
        running=2,
        finished_per_s=1.5,
        window_s=5.0,
        received_up_to=9.5,
        at_capacity=True,
    )
    assert codec.decode(encode(p), Pressure) == p
    assert p.backlog == 7


# ----------------------------------------------------------------------------- the scheduler


def test_the_core_counts_each_finished_action_once() -> None:
    core = SchedulerCore()
    act = kit_action("a", "t")
    result = ActionResult(action_id="a", status="succeeded")
    core.finish(act, result)
    core.finish(act, result)  # a duplicate ending (a resent completion) is not a new finish
    core.finish(kit_action("b", "t"), ActionResult(action_id="b", status="failed"))
    assert core.finished == 2


def test_drain_rate_is_finishes_per_second_over_the_window() -> None:
    rate = DrainRate(window_s=5.0)
    assert rate.per_s() == 0.0
    for i in range(21):
        rate.add(0 if i == 0 else 50, now=100.0 + i * 0.25)  # 200/s for 5 s
    assert rate.per_s() == pytest.approx(200.0)
    for i in range(1, 41):
        rate.add(0, now=105.0 + i * 0.25)  # then nothing for 10 s
    assert rate.per_s() == 0.0
    assert rate.span_s() == pytest.approx(5.0, abs=0.25)


def test_a_burst_after_a_quiet_spell_is_measured_at_capacity() -> None:
    """Over wall time, a burst after a quiet spell measures the spell: the capacity is the rate
    of the intervals that began with actions queued."""
    rate = DrainRate(window_s=5.0)
    for i in range(41):  # 10 s at 20/s, nothing queued
        rate.add(0 if i == 0 else 5, now=100.0 + i * 0.25)
    assert (rate.per_s(), rate.at_capacity()) == (pytest.approx(20.0), False)
    rate.add(250, now=110.25, queued_before=False)  # the burst's first tick: none waited yet
    assert not rate.at_capacity()
    for i in range(1, 3):  # then 0.5 s with actions queued, 1,000/s finished
        rate.add(250, now=110.25 + i * 0.25, queued_before=True)
    assert rate.at_capacity()
    assert rate.per_s() == pytest.approx(1000.0)  # over wall time, 5 s: 167/s
    for i in range(1, 41):  # quiet again for 10 s: the capacity stays known ...
        rate.add(0, now=110.75 + i * 0.25)
    assert rate.per_s() == pytest.approx(1000.0)
    rate.add(0, now=110.75 + 61.0)  # ... for a minute
    assert (rate.per_s(), rate.at_capacity()) == (0.0, False)


def test_capacity_is_the_last_window_of_saturated_time() -> None:
    rate = DrainRate(window_s=2.0)
    rate.add(0, now=0.0)
    for i in range(1, 9):  # 2 s at 1,000/s, then 2 s at 100/s, all queued
        rate.add(500 if i <= 4 else 50, now=i * 0.5, queued_before=True)
    assert rate.per_s() == pytest.approx(100.0)


def test_a_rate_not_at_capacity_never_asks_for_a_long_retry() -> None:
    adm = Admission(Bounds(backlog_s=5.0, floor=100, ceiling=100_000))
    adm.observe(Pressure(queued=400, finished_per_s=20.0))  # what arrived, not what it can
    busy = adm.take()
    assert isinstance(busy, Busy)
    assert busy.retry_after_s == RETRY_COLD_S  # (400 - 50) / 20 = 17.5 s otherwise
    adm.observe(Pressure(queued=400, finished_per_s=20.0, at_capacity=True))
    busy = adm.take()
    assert isinstance(busy, Busy)
    assert busy.retry_after_s == RETRY_MAX_S


def test_gauge_measures_backlog_of_both_cores() -> None:
    core, quotas = SchedulerCore(), QuotaCore()
    gauge = Gauge(bus=None, epoch=7)  # type: ignore[arg-type]  # measure() never sends
    core.finished = 1  # before the first look: history
    assert gauge.measure(core, quotas, now=0.0) == Pressure(epoch=7)
    core.finished += 10
    quotas.finished += 2
    p = gauge.measure(core, quotas, now=1.0)
    assert p.finished_per_s == pytest.approx(12.0)
    assert p.backlog == 0
    assert p.window_s == 1.0
    assert gauge.measure(core, quotas, now=2.0, received_up_to=123.5).received_up_to == 123.5


def test_the_gauge_says_when_its_rate_was_measured_with_actions_queued() -> None:
    core, quotas = SchedulerCore(), QuotaCore()  # no node: what is enqueued stays queued
    gauge = Gauge(bus=None, epoch=7)  # type: ignore[arg-type]  # measure() never sends
    assert not gauge.measure(core, quotas, now=0.0).at_capacity
    core.enqueue(kit_action("a", "t"), now=0.0)
    assert not gauge.measure(core, quotas, now=1.0).at_capacity  # queued from here on
    core.finished += 50
    p = gauge.measure(core, quotas, now=2.0)
    assert (p.queued, p.at_capacity, p.finished_per_s) == (1, True, pytest.approx(50.0))


# ----------------------------------------------------------------------------- the client


def test_the_client_waits_what_busy_asks_with_jitter_never_sooner() -> None:
    pauses = [_pause(Busy("b", retry_after_s=2.0), 0.05) for _ in range(200)]
    assert all(2.0 <= p <= 2.0 * (1 + BUSY_JITTER) for p in pauses)
    assert len({round(p, 3) for p in pauses}) > 50  # spread, not one instant


def test_the_client_caps_and_sanitises_what_a_server_asks() -> None:
    assert _pause(Busy("b", retry_after_s=1e9), 0.05) == BUSY_MAX_S
    assert _pause(Busy("b", retry_after_s=math.nan), 0.05) == 0.05
    assert _pause(RemoteError("x", "m", retryable=True, retry_after_s=-1.0), 0.2) == 0.2
    assert _pause(Unavailable("gone"), 0.4) == 0.4


def test_admissions_the_scheduler_received_are_not_counted_again() -> None:
    """A report naming the newest submission it received forgets the admissions up to it:
    fast actions admitted (and finished) between reports do not pile up as a backlog."""
    admission = Admission(Bounds(backlog_s=1.0, floor=3, ceiling=1000))
    assert [admission.admit(float(t)) is None for t in (1, 2, 3, 4)] == [True, True, True, False]
    # the scheduler received up to 2 and finished them: 3 is still on its way
    admission.observe(Pressure(queued=0, running=0, finished_per_s=0.0, received_up_to=2.0))
    assert admission.backlog == 1
    assert [admission.admit(float(t)) is None for t in (5, 6, 7)] == [True, True, False]
    # received everything; two still running
    admission.observe(Pressure(queued=0, running=2, finished_per_s=0.0, received_up_to=6.0))
    assert admission.backlog == 2
    assert admission.admit(8.0) is None


def test_a_report_receiving_nothing_new_keeps_the_count() -> None:
    admission = Admission(Bounds(backlog_s=1.0, floor=10, ceiling=1000))
    for t in (5.0, 6.0):
        assert admission.admit(t) is None
    admission.observe(Pressure(queued=3, running=0, received_up_to=4.0))
    assert admission.backlog == 5


def test_an_admission_the_scheduler_will_never_receive_is_voided() -> None:
    """A duplicate (or refused, or uncommitted) submit hands the scheduler nothing, so no
    report forgets it: voided, it no longer counts; a report later passing it counts it once."""
    admission = Admission(Bounds(backlog_s=1.0, floor=2, ceiling=1000))
    taken = [admission.take(float(t)) for t in (1, 2)]
    assert isinstance(admission.take(3.0), Busy)
    for one in taken:
        assert isinstance(one, Admitted)
        admission.void(one)
        admission.void(one)  # twice is once
    assert admission.backlog == 0
    kept = admission.take(4.0)
    assert isinstance(kept, Admitted)
    admission.observe(Pressure(queued=1, received_up_to=4.0))
    admission.void(kept)  # counted by the report now: not twice
    assert admission.backlog == 1
    # an older scheduler's report (no received_up_to) moves the uncounted to the next one
    assert isinstance(admission.take(5.0), Admitted)
    admission.observe(Pressure(queued=1))
    assert admission.backlog == 2
