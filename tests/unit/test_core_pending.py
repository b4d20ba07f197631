"""Issue 13: a scheduling pass costs what it can place, not the queue's length (the core's
``Pending`` index), with the same decisions as a scan of the whole queue."""

from __future__ import annotations

import pytest

from services.scheduler.core.effects import Finish, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.elastic import ElasticPolicy

from .core_kit import action, done, report


def starts(effects: list) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def count_visits(core: SchedulerCore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    visit = core._visit

    def counted(act, p, now):  # type: ignore[no-untyped-def]
        seen.append(act.spec.action_id)
        return visit(act, p, now)

    monkeypatch.setattr(core, "_visit", counted)
    return seen


@pytest.mark.parametrize("fresh", [True, False])
def test_a_pass_behind_full_nodes_visits_a_bounded_part_of_the_queue(
    fresh: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = SchedulerCore(ElasticPolicy(), CoreConfig(lookahead=8))
    core.node_report(report("n0", cores=2, mem=100_000), 0.0)
    for i in range(3_000):
        # fresh: each its own trajectory (the queue waits for a placement); else the two
        # trajectories placed at once (it waits in their node's pool)
        core.enqueue(action(f"a{i}", f"t{i}" if fresh else f"t{i % 2}", mem=10), 0.0)
    running = starts(core.schedule(0.0))  # the first pass checks every action once
    assert len(running) == 2
    for n in range(1, 6):
        seen = count_visits(core, monkeypatch)
        core.complete(done(running.pop(0)), float(n))
        core.enqueue(action(f"b{n}", f"t{n % 2}", mem=10), float(n))
        running += starts(core.schedule(float(n)))
        assert len(running) == 2
        assert len(seen) <= 2 + 8 + 4  # what fits, the lookahead, the newly queued
        monkeypatch.undo()
    assert len(core.queue) == 3_000 - 2


def test_queue_timeouts_end_in_fcfs_order_whatever_their_deadline() -> None:
    core = SchedulerCore(cfg=CoreConfig(queue_timeout_s=5.0))
    core.enqueue(action("late", "t0", queue_timeout_s=3.0, now=0.0), 0.0)
    core.enqueue(action("early", "t1", queue_timeout_s=1.0, now=0.0), 0.0)
    core.enqueue(action("default", "t2", now=0.0), 0.0)
    assert core.tick(0.5) == []
    ended = [e.result.action_id for e in core.tick(4.0) if isinstance(e, Finish)]
    assert ended == ["late", "early"]
    assert list(core.queue) == ["default"]
    assert [e.result.action_id for e in core.tick(5.5) if isinstance(e, Finish)] == ["default"]


def test_an_environment_made_for_a_trajectory_takes_its_older_actions_into_its_pool() -> None:
    core = SchedulerCore()
    core.node_report(report("n0", cores=1, mem=1000), 0.0)
    core.enqueue(action("x", "tx"), 0.0)
    core.enqueue(action("a1", "ta"), 0.0)
    core.enqueue(action("a2", "ta"), 0.0)
    (x,) = starts(core.schedule(0.0))
    (a1,) = starts(core.schedule(1.0) + core.complete(done(x), 1.0) + core.schedule(1.0))
    assert a1.action.spec.action_id == "a1"
    core.node_report(report("n1", cores=1, mem=1000), 1.5)  # a2 must stay with ta's env
    core.complete(done(a1), 2.0)
    (a2,) = starts(core.schedule(2.0))
    assert (a2.action.spec.action_id, a2.node_id) == ("a2", "n0")
