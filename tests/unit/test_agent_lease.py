"""The agent core's start lease, read mark, verified epoch floor and memory of acked actions:
a dispatch that sat unread through a pause never runs twice, nor after its node was declared
failed, and a forged epoch cannot wedge the agent."""

from __future__ import annotations

import pytest

from tangram.agent.core import AgentConfig, AgentCore, Canary, Publish, Run
from tangram.contract import Ack, Kill, NodeReport, Outcome, Ping
from tangram.errors import InvalidRequest

from .test_agent_core import INVENTORY, dispatch, ok


def agent(at: float = 0.0) -> AgentCore:
    c = AgentCore(AgentConfig(node_id="n0", incarnation="inc", lease_s=3.0))
    c.register(INVENTORY, (), at, at)
    c.answered(Ack(epoch=1, lease_s=3.0), at, at, at)
    return c


def last_report(c: AgentCore, now: float) -> NodeReport:
    (e,) = c.heartbeat((), now)
    assert isinstance(e, Publish)
    assert isinstance(e.msg, NodeReport)
    return e.msg


def test_a_dispatch_read_after_the_lease_ran_out_waits_for_an_answer() -> None:
    c = agent()
    assert c.command(dispatch("a"), (), 2.0, 2.0) == [Run(dispatch("a"))]
    # paused from 2 s to 6 s: the dispatches that waited in the socket are read at 6 s
    assert c.command(dispatch("b", cores=(1,)), (), 6.0, 6.0) == []
    assert c.held == 1
    assert "b" in c.waiting
    held = last_report(c, 6.0).running[-1]
    assert (held.action_id, held.waiting) == ("b", False)  # listed: it is not unread
    # the report sent at 6.0 is answered: the lease runs again, b starts
    assert c.answered(Ack(epoch=1, lease_s=3.0), 6.0, 6.1, 6.1) == [Run(dispatch("b", cores=(1,)))]


def test_a_pipelined_dispatch_does_not_start_after_the_lease_ran_out() -> None:
    c = agent()
    c.command(dispatch("a"), (), 1.0, 1.0)
    after = dispatch("b")
    after = type(after)(action=after.action, cores=(0,), epoch=1, incarnation="inc", after=("a",))
    assert c.command(after, (), 1.5, 1.5) == []
    assert [e for e in c.finished("a", ok(), 5.0, 5.0) if isinstance(e, Run)] == []
    assert c.answered(Ack(epoch=1), 5.0, 5.0, 5.0) == [Run(after)]


def test_a_dispatch_sent_again_after_its_ack_is_not_run_again() -> None:
    c = agent()
    c.command(dispatch("a"), (), 1.0, 1.0)
    c.finished("a", ok(), 1.5, 1.5)
    c.delivered("a")
    assert c.command(dispatch("a"), (), 2.0, 2.0) == []  # the scheduler sent it once more
    assert c.duplicates == 1


def test_a_huge_epoch_in_a_command_does_not_wedge_the_agent() -> None:
    c = agent()
    c.command(Kill(action_id="nothing", epoch=2**62), (), 1.0, 1.0)
    assert c.epoch == 1
    assert c.command(dispatch("a"), (), 1.0, 1.0) == [Run(dispatch("a"))]


def test_the_read_mark_counts_dispatches_of_the_floors_epoch_even_refused_ones() -> None:
    c = agent()
    d = dispatch("a")
    c.command(type(d)(action=d.action, cores=(0,), epoch=1, incarnation="inc", issued=7), (), 1, 1)
    wrong = type(d)(action=d.action, cores=(1,), epoch=1, incarnation="other", issued=9)
    with pytest.raises(InvalidRequest, match="incarnation"):
        c.command(wrong, (), 1.0, 1.0)
    r = last_report(c, 1.0)
    assert (r.seen_epoch, r.seen) == (1, 9)


def test_a_ping_is_answered_whatever_its_epoch() -> None:
    c = agent()
    assert c.command(Ping(), (), 1.0, 1.0) == []
    assert c.epoch == 1


def test_a_ping_names_its_incarnation_and_may_ask_for_the_canary() -> None:
    c = agent()
    assert c.command(Ping(incarnation="inc"), (), 1.0, 1.0) == []
    assert c.command(Ping(incarnation="inc", canary=True), (), 1.0, 1.0) == [Canary()]
    assert c.command(Ping(canary=True), (), 1.0, 1.0) == [Canary()]  # any incarnation
    with pytest.raises(InvalidRequest, match="ping for incarnation old, this is inc"):
        c.command(Ping(incarnation="old", canary=True), (), 1.0, 1.0)


def test_an_outcome_of_a_held_dispatch_killed_says_it_never_started() -> None:
    c = agent()
    c.command(dispatch("a"), (), 5.0, 5.0)  # held: the lease ran out at 3
    (e,) = c.command(Kill(action_id="a", epoch=1), (), 5.1, 5.1)
    outcome: Outcome = e.completion.outcome  # type: ignore[union-attr]
    assert "before it started" in outcome.detail
