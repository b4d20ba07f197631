"""The scheduler core's side of node failure: an unreported dispatch is queued again only when
the node's read mark shows it read (and refused) it, otherwise the same dispatch is sent once
more; a node declared failed is fenced, its possibly started work ends ``node_died`` and what
was granted after its lease ran out goes back to the queue; the enqueue checks."""

from __future__ import annotations

import msgspec

from services.scheduler.core.effects import Effect, EnvChanged, Finish, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.core.validate import problem
from tangram.contract import Demand

from .core_kit import action, report


def starts(effects: list[Effect]) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def finished(effects: list[Effect]) -> dict[str, str]:
    return {
        e.result.action_id: e.result.error.kind
        for e in effects
        if isinstance(e, Finish) and e.result.error
    }


def core_with_one(aid: str = "a", now: float = 0.0) -> tuple[SchedulerCore, StartOnNode]:
    core = SchedulerCore(cfg=CoreConfig(dispatch_grace_s=1.0, node_timeouts=False))
    core.epoch = 3
    core.node_report(report(cores=2), now)
    core.enqueue(action(aid, f"t-{aid}"), now)
    (start,) = starts(core.schedule(now))
    return core, start


def test_an_unread_dispatch_is_sent_again_not_queued_again() -> None:
    core, start = core_with_one()
    assert start.issued == 1
    again = starts(core.node_report(report(cores=2), 2.0))  # paused: it never read it
    assert again == [start]  # the same attempt: the agent runs it once however often it comes
    assert "a" in core.running
    assert starts(core.node_report(report(cores=2), 2.5)) == []  # once per grace


def test_a_read_and_unlisted_dispatch_is_queued_again() -> None:
    core, _ = core_with_one()
    r = msgspec.structs.replace(report(cores=2, seen=1), seen_epoch=3)
    core.node_report(r, 2.0)
    assert "a" in core.queue  # it read it and does not list it: refused, never ran
    stale = msgspec.structs.replace(report(cores=2, seen=1), seen_epoch=2)
    core2, _ = core_with_one()
    core2.node_report(stale, 2.0)  # a mark of another epoch proves nothing
    assert "a" not in core2.queue


def test_a_failed_node_is_fenced_and_only_what_cannot_have_started_is_queued_again() -> None:
    core, _ = core_with_one("a", 0.0)  # granted at 0, the node's last report read at 0
    core.enqueue(action("b", "t-b"), 3.5)
    (late,) = starts(core.schedule(3.5))  # granted after its lease (3 s) had run out
    effects = core.node_failed("n0", "i0", 5.0, "declared failed", lease_s=3.0)
    assert finished(effects) == {"a": "node_died"}
    assert late.action.spec.action_id in core.queue
    assert core.fenced("n0", "i0")
    assert core.node_report(report(cores=2), 6.0) == []  # a ghost does not come back
    assert "n0" not in core.nodes
    ended = {e.trajectory_id: e.status for e in effects if isinstance(e, EnvChanged)}
    assert ended == {"t-a": "lost", "t-b": "closed"}  # t-b's was never created: not lost
    assert "t-b" not in core.gone_envs  # its next action is not told environment_lost


def test_the_core_itself_declares_silent_nodes_lost_only_when_told_to() -> None:
    core, _ = core_with_one()
    core.tick(100.0)
    assert "n0" in core.nodes  # the live scheduler's detector decides
    sim = SchedulerCore(cfg=CoreConfig(node_timeout_s=5.0))
    sim.node_report(report(cores=2), 0.0)
    sim.tick(6.0)
    assert "n0" not in sim.nodes
    assert sim.fenced("n0", "i0")


def test_actions_the_core_could_not_read_are_refused() -> None:
    good = action("a", "t")
    assert problem(good) is None
    bad = {
        "no demands": msgspec.structs.replace(good, demands=()),
        "offers no choices": msgspec.structs.replace(
            good, demands=(Demand(resource="cpu", choices=()),)
        ),
        "sorted and unique": msgspec.structs.replace(
            good, demands=(Demand(resource="cpu", choices=(4, 2)),)
        ),
        "0 cores": msgspec.structs.replace(good, demands=(Demand(resource="cpu", choices=(0,)),)),
        "key resource": msgspec.structs.replace(good, key_resource="gpu"),
        "negative": msgspec.structs.replace(good, env_memory_mb=-1),
    }
    for why, act in bad.items():
        assert why in (problem(act) or ""), why
