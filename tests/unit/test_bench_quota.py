"""bench.quota's overhead: the client's time less the upstream call and the limiter's wait,
nothing else; the old figure (less all of ``queue_s``) kept beside it under its own key."""

from __future__ import annotations

import argparse

import pytest

from bench.quota import Call, Phase, _overheads, summary_right
from tangram.contract import Timings

# Submitted at 100.0 (gateway), held by the limiter 0.497 s, sent by the agent at 100.5,
# answered 20 ms later, the result built at 100.523; the client called 0.5 ms before the
# gateway's stamp and had the result 3.5 ms after it was built.
T = Timings(
    submitted_at=100.0,
    started_at=100.5,
    finished_at=100.52,
    queue_s=0.5,
    exec_s=0.02,
    overhead_s=0.503,
    wait_s=0.497,
)
WALL0, WALL1 = 99.9995, 100.5265


def test_the_overhead_is_all_but_the_upstream_call_and_the_limiters_wait() -> None:
    overhead, old, wait, intake, dispatch, report, push = _overheads(T, WALL1 - WALL0, WALL0, WALL1)
    assert overhead == pytest.approx(0.010)
    assert overhead == pytest.approx(intake + dispatch + report + push)
    assert dispatch == pytest.approx(0.003)  # gateway -> agent's send, less the wait
    assert old == pytest.approx(0.007)  # the old definition left the dispatch out
    assert wait == T.wait_s


def test_no_timings_no_figures() -> None:
    assert all(x != x for x in _overheads(None, 0.5, 0.0, 0.5))


def call(done_at: float, *, first: bool = False, tries: int = 1, overhead: float) -> Call:
    return Call(
        job="j",
        first=first,
        done_at=done_at,
        status=200,
        tries=tries,
        overhead_s=overhead,
        old_overhead_s=overhead / 2,
        wait_s=0.3,
        intake_s=0.0,
        dispatch_s=0.0,
        report_s=0.0,
        push_s=0.0,
    )


def test_the_summary_keeps_both_definitions_and_leaves_retried_calls_out() -> None:
    ph = Phase(
        calls=[
            call(0.5, overhead=0.050),  # warm-up
            call(3.0, first=True, overhead=0.040),  # a caller's first
            call(3.0, overhead=0.002),
            call(4.0, overhead=0.004),
            call(4.0, tries=2, overhead=0.030),  # an earlier try's upstream time is in it
        ]
    )
    args = argparse.Namespace(rate=50, warmup_s=2.0, seconds=6.0)
    doc = summary_right(ph, {"throttled": 0}, args)
    assert doc["overhead_p50_ms"] == pytest.approx(3.0)
    assert doc["overhead_p50_ms_limiter_and_dispatch_excluded"] == pytest.approx(1.5)
    assert doc["overhead_calls"] == 2
    assert doc["retried_calls_left_out"] == 1
    assert doc["limiter_wait_p50_ms"] == pytest.approx(300.0)
    assert doc["overhead_p50_ms_whole_phase"] == pytest.approx(22.0)  # 2, 4, 40, 50
