"""Service heartbeats (``tangram.beats``): the book's judgement, the loop that sends them, the
listener that refuses bad ones and keeps serving, and who may send them."""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import pytest

from services.dashboard import pages
from services.dashboard.queries import Live
from tangram import auth, beats, subjects
from tangram.auth import GATEWAY, SCHEDULER, Principal, grant
from tangram.bus import Bus, decode_request
from tangram.contract import (
    ErrorReply,
    ResourcesQuery,
    SchedulerRequest,
    SchedulerStatus,
    StatusQuery,
    encode,
)
from tangram.contract.beats import ServiceBeat
from tangram.errors import InvalidRequest, Unavailable
from tangram.membus import MemoryBroker, MemoryBus

from ..support import eventually

WHO = beats.Identity("gateway", "g1", 7, "h", 100.0)


def beat(phase: str = "serving", busy: bool = False, n: int = 0, **kw: object) -> ServiceBeat:
    b = beats.beat(WHO, beats.Phase(phase, busy=busy, counters={"requests": n}), 0.0)
    return msgspec.structs.replace(b, **kw)


def book() -> beats.Book:
    return beats.Book(silent_s=3.0, stalled_s=3.0, forget_s=60.0)


def health(b: beats.Book, now: float) -> dict[str, str]:
    return {r.instance: r.health for r in b.rows(now)}


def test_a_service_is_healthy_while_it_beats_and_silent_after_the_bound() -> None:
    b = book()
    b.heard(beat(), "gateway", 0.0)
    b.heard(beat(), "gateway", 1.0)
    row = b.rows(3.9)[0]
    assert (row.health, row.phase, row.heard_s, row.last_progress_s) == (
        "healthy",
        "serving",
        2.9,
        3.9,
    )
    assert health(b, 4.1) == {"g1": "silent"}
    b.heard(beat(), "gateway", 4.2)  # back (a pause, a broker outage): healthy again
    assert health(b, 4.3) == {"g1": "healthy"}


def test_an_idle_member_is_never_stalled_a_busy_one_is_once_its_counters_stand_still() -> None:
    b = book()
    for t in range(10):
        b.heard(beat(n=5), "gateway", float(t))  # idle, nothing moves: healthy
    assert health(b, 9.5) == {"g1": "healthy"}
    b.heard(beat(busy=True, n=5), "gateway", 10.0)  # busy now: its window starts here
    b.heard(beat(busy=True, n=5), "gateway", 12.0)
    assert health(b, 12.5) == {"g1": "healthy"}
    b.heard(beat(busy=True, n=5), "gateway", 13.5)
    assert health(b, 13.5) == {"g1": "stalled"}
    b.heard(beat(busy=True, n=6), "gateway", 14.0)  # progress
    assert health(b, 14.0) == {"g1": "healthy"}


def test_a_phase_change_is_progress_and_a_stopped_one_says_so_until_forgotten() -> None:
    b = book()
    b.heard(beat("standby", epoch=0), "gateway", 0.0)
    b.heard(beat("leading", epoch=3), "gateway", 5.0)
    assert b.rows(5.0)[0].last_progress_s == 0.0
    assert b.rows(5.0)[0].epoch == 3
    b.heard(beat("stopped"), "gateway", 6.0)
    assert health(b, 30.0) == {"g1": "stopped"}
    assert b.rows(67.0) == []  # forgotten after forget_s


def test_a_beat_for_another_role_is_refused_and_instances_are_bounded() -> None:
    b = book()
    with pytest.raises(InvalidRequest, match="'scheduler' on the gateway subject"):
        b.heard(beat(service="scheduler"), "gateway", 0.0)
    assert b.rows(0.0) == []
    for i in range(beats.MAX_INSTANCES + 10):  # a forger inventing instances
        b.heard(beat(instance=f"x{i}"), "gateway", float(i) / 1000)
    assert len(b.members) == beats.MAX_INSTANCES
    assert ("gateway", "x0") not in b.members  # the longest silent went first


def test_only_each_role_may_beat_on_its_own_subject_and_the_scheduler_hears_both() -> None:
    gw, sched = grant(Principal(GATEWAY)), grant(Principal(SCHEDULER))
    assert subjects.GATEWAY_BEATS.subject in gw.publish
    assert subjects.SCHEDULER_BEATS.subject not in gw.publish
    assert subjects.SCHEDULER_BEATS.subject in sched.publish
    assert {subjects.GATEWAY_BEATS.subject, subjects.SCHEDULER_BEATS.subject} <= set(
        sched.subscribe
    )
    for role in auth.ROLES:
        if role not in (GATEWAY, SCHEDULER):
            who = Principal(role, "x" if role in auth.OWNS_ID else "")
            assert not any("beats" in p for p in grant(who).publish), role


def test_read_only_questions_are_not_scheduler_requests() -> None:
    """The action subject refuses them by type (they are asked on SCHED_STATUS)."""
    for q in (StatusQuery(), ResourcesQuery()):
        refused = decode_request(encode(q), SchedulerRequest)
        assert isinstance(refused, ErrorReply)
        assert refused.code == "invalid_request"
        assert isinstance(decode_request(encode(q), subjects.SCHED_STATUS.request), type(q))


class Flaky(MemoryBus):
    """A bus whose publishes fail while ``away`` (a broker outage)."""

    away = False

    async def _send(self, subject: str, data: bytes, headers: dict[str, str] | None) -> None:
        if self.away:
            raise Unavailable("broker away")
        await super()._send(subject, data, headers)


async def test_the_loop_beats_rides_out_an_outage_and_says_stopped_last() -> None:
    broker = MemoryBroker()
    listener = beats.Listener(book())
    heard = broker.connect("listener")
    listener.serve(heard)
    await heard.start()
    sender = Flaky(broker, "sender")
    n = [0]

    def state() -> beats.Phase:
        n[0] += 1
        return beats.Phase("serving", counters={"requests": n[0]})

    task = asyncio.ensure_future(beats.beating(sender, WHO, 0.01, state))
    await eventually(lambda: listener.rows(), what="a first beat")
    sender.away = True
    before = n[0]
    await eventually(lambda: n[0] > before + 3, what="beats tried during the outage")
    sender.away = False
    got = await eventually(
        lambda: [r for r in listener.rows() if r.counters["requests"] > before + 3],
        what="beats after the outage",
    )
    assert got[0].health == "healthy"
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()
    assert listener.rows()[0].health == "stopped"


async def test_a_bad_beat_is_dropped_with_a_log_and_the_listener_keeps_serving(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = MemoryBroker()
    listener = beats.Listener(book())
    bus = broker.connect("scheduler")
    listener.serve(bus)
    await bus.start()
    gw = broker.connect("gateway")
    with caplog.at_level(logging.WARNING, logger="tangram.bus"):
        await gw.publish(subjects.GATEWAY_BEATS.subject, {"type": "service_beat", "pid": "x"})
        await eventually(lambda: "dropped 1 message" in caplog.text, what="the malformed one")
    assert "malformed message" in caplog.text
    caplog.clear()
    forged = beat(service="scheduler", instance="s9")  # a gateway posing as a scheduler
    with caplog.at_level(logging.WARNING, logger="tangram.bus"):
        await gw.publish(subjects.GATEWAY_BEATS, forged)
        await eventually(lambda: "on the gateway subject" in caplog.text, what="the forgery")
    await gw.publish(subjects.GATEWAY_BEATS, beat())
    rows = await eventually(lambda: listener.rows(), what="a good beat after the bad ones")
    assert [(r.service, r.instance) for r in rows] == [("gateway", "g1")]


async def test_a_standby_beats_on_its_own_connection_and_lets_go_at_once(
    raw_bus: Bus, nats_url: str
) -> None:
    listener = beats.Listener(book())
    listener.serve(raw_bus)
    await raw_bus.start()
    who = beats.Identity("scheduler", "s1", 8, "h", 100.0)
    async with beats.standby(nats_url, who, 0.05):
        rows = await eventually(lambda: listener.rows(), what="a standby beat")
        left = time.monotonic()
    assert time.monotonic() - left < 0.2  # on the way of a takeover: no more than that
    assert (rows[0].service, rows[0].phase, rows[0].health) == ("scheduler", "standby", "healthy")
    assert not beats._closing  # nothing left behind


async def test_a_standby_without_a_broker_waits_and_still_lets_go_at_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(beats, "STANDBY_AFTER_S", 0.0)
    monkeypatch.setattr(beats, "CONNECT_S", 0.2)
    who = beats.Identity("scheduler", "s1", 8, "h", 100.0)
    with caplog.at_level(logging.WARNING, logger="tangram.beats"):
        async with beats.standby("nats://127.0.0.1:9", who, 0.05):
            await eventually(lambda: "standby heartbeats" in caplog.text, what="a failed try")
            left = time.monotonic()
    assert time.monotonic() - left < 0.1  # the lead is taken at once, not after a connect
    await eventually(lambda: not beats._closing, what="an attempt under way closed aside")


def test_status_and_the_dashboard_show_the_same_cells_of_each_service() -> None:
    b = book()
    b.heard(beat(n=3, host="<h>"), "gateway", 0.0)
    (row,) = b.rows(1.0)
    cells = beats.cells(row)
    assert len(cells) == len(beats.COLUMNS)
    assert cells[2:] == ["<h>:7", "healthy", "serving", "1.0s ago", "1.0s ago", "requests=3"]
    st = SchedulerStatus(
        epoch=1, policy="p", queued=0, running=0, nodes=0, envs=0, free_cores=0, service_rows=[row]
    )
    html = pages.live_page(Live(status=st))
    assert "<td>&lt;h&gt;:7</td>" in html  # escaped
    assert "".join(f"<th>{c}</th>" for c in beats.COLUMNS) in html


async def test_standby_heartbeats_that_die_say_so_at_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(url: str, name: str) -> Bus:
        raise RuntimeError("a bug")

    monkeypatch.setattr(beats, "STANDBY_AFTER_S", 0.0)
    monkeypatch.setattr(beats, "_connect", broken)
    who = beats.Identity("scheduler", "s1", 8, "h", 100.0)
    with caplog.at_level(logging.ERROR, logger="tangram.beats"):
        async with beats.standby("nats://127.0.0.1:9", who, 0.05):
            await eventually(lambda: "standby heartbeats stopped" in caplog.text, what="the log")
