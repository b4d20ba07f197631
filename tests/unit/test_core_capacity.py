"""Issue 10, items 4 and 5 in the scheduler's core: impossible requests fail at once and never
block the queue; memory waits are visible, idle environments are reclaimed oldest first, every
queued action has a bounded wait; a lost environment is reported once, then made afresh."""

from __future__ import annotations

from services.scheduler.core.books import EnvPlacement
from services.scheduler.core.effects import DropEnvOnNode, EnvChanged, Finish, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from tangram.contract import ActionResult, ErrorKind, RunningAction

from .core_kit import action, done, report


def starts(effects: list) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def finishes(effects: list) -> dict[str, ActionResult]:
    return {e.result.action_id: e.result for e in effects if isinstance(e, Finish)}


def two_core_core(**cfg: float) -> SchedulerCore:
    core = SchedulerCore(cfg=CoreConfig(**cfg))  # type: ignore[arg-type]
    core.node_report(report("n0", cores=2, mem=1000), 0.0)
    return core


def test_more_cores_than_any_node_fails_at_once_naming_the_largest_node():
    core = two_core_core()
    for i, cpus in enumerate((3, [3, 100], 100)):
        core.enqueue(action(f"big{i}", f"t{i}", cpus=cpus), 0.0)
    core.enqueue(action("fits", "t-fits", cpus=[2, 100]), 0.0)
    core.enqueue(action("small", "t-small"), 0.0)
    effects = core.schedule(0.0)
    failed = finishes(effects)
    assert set(failed) == {"big0", "big1", "big2"}
    for res in failed.values():
        assert res.error is not None
        assert res.error.kind is ErrorKind.INVALID_REQUEST
        assert "the largest live node, n0, has 2" in res.error.message
    assert [s.action.spec.action_id for s in starts(effects)] == ["fits"]
    assert "small" in core.queue  # behind "fits" (FCFS), not behind the impossible ones


def test_an_action_larger_than_its_environments_node_fails_even_when_another_node_is_big():
    core = two_core_core()
    core.node_report(report("n1", cores=8, mem=10), 0.0)  # no memory for new environments
    core.enqueue(action("a", "t"), 0.0)
    (run,) = starts(core.schedule(0.0))
    assert run.node_id == "n0"
    core.complete(done(run, "n0", "i0", 1), 1.0)
    core.enqueue(action("b", "t", cpus=4), 1.0)
    res = finishes(core.schedule(1.0))["b"]
    assert res.error is not None
    assert res.error.kind is ErrorKind.INVALID_REQUEST
    assert "environment is on node n0, which has 2" in res.error.message


def test_a_queued_action_becomes_impossible_when_the_big_node_leaves():
    core = two_core_core(node_timeout_s=5.0)
    core.node_report(report("n1", cores=8), 0.0)
    core.enqueue(action("hog", "t0", cpus=8), 0.0)
    core.enqueue(action("wide", "t1", cpus=6), 0.0)
    assert [s.action.spec.action_id for s in starts(core.schedule(0.0))] == ["hog"]
    core.node_report(report("n0", cores=2), 4.0)  # n0 keeps beating, n1 goes silent
    effects = core.tick(6.0) + core.schedule(6.0)
    res = finishes(effects)["wide"]
    assert res.error is not None
    assert res.error.kind is ErrorKind.INVALID_REQUEST
    assert "n0, has 2" in res.error.message


def test_a_memory_wait_is_visible_and_idle_environments_are_reclaimed_oldest_first():
    core = two_core_core()
    for i, t in enumerate(("old", "young")):
        core.enqueue(action(f"a{i}", t, mem=400), float(i))
        (run,) = starts(core.schedule(float(i)))
        core.complete(done(run, "n0", "i0", 1), float(i) + 0.5)
    core.enqueue(action("busy", "busy", mem=150), 2.0)
    (busy,) = starts(core.schedule(2.0))  # 950 of 1000 MiB booked; "busy" is not idle
    core.enqueue(action("new", "new", mem=400), 3.0)
    effects = core.schedule(3.0)
    assert DropEnvOnNode("n0", "old") in effects  # the oldest idle one, and only it
    assert DropEnvOnNode("n0", "young") not in effects
    assert [s.action.spec.trajectory_id for s in starts(effects)] == ["new"]
    core.enqueue(action("back", "old"), 4.0)
    lost = finishes(core.schedule(4.0))["back"]
    assert lost.error is not None
    assert lost.error.kind is ErrorKind.ENVIRONMENT_LOST
    assert "memory pressure" in lost.error.message
    assert busy.action.spec.trajectory_id in core.envs


def test_a_placement_blocked_on_memory_says_so_and_ends_at_the_default_queue_timeout():
    core = two_core_core(queue_timeout_s=60.0)
    core.enqueue(action("a", "t1", mem=800), 0.0)
    starts(core.schedule(0.0))  # running: its environment cannot be reclaimed
    core.enqueue(action("b", "t2", mem=800), 0.0)
    assert starts(core.schedule(1.0)) == []
    assert core.waits["b"].startswith("waiting for memory: its environment needs 800 MiB")
    core.node_report(report("n0", cores=2, mem=1000), 30.0)
    assert finishes(core.tick(30.0)) == {}
    core.node_report(report("n0", cores=2, mem=1000), 59.0)
    res = finishes(core.tick(61.0))["b"]
    assert res.error is not None
    assert res.error.kind is ErrorKind.QUEUE_TIMEOUT
    assert "waiting for memory" in res.error.message
    assert "b" not in core.waits


def test_the_default_queue_timeout_is_bounded_and_an_own_one_wins():
    assert CoreConfig().queue_timeout_s is not None
    core = two_core_core(queue_timeout_s=1000.0)
    core.enqueue(action("hog", "t0", cpus=2), 0.0)
    starts(core.schedule(0.0))
    core.enqueue(action("mine", "t1", queue_timeout_s=5.0), 0.0)
    core.node_report(report("n0", cores=2), 5.0)
    res = finishes(core.tick(6.0))["mine"]
    assert res.error is not None
    assert res.error.kind is ErrorKind.QUEUE_TIMEOUT


def test_a_lost_environment_is_reported_once_and_survives_no_restart():
    """A restarted mesh: the scheduler restores an environment of the node's old incarnation
    (and the loss it recorded); the first action says environment_lost, the next runs."""
    core = two_core_core()
    core.restore_env(EnvPlacement("t", "j", "n1", "old", 100))
    core.node_report(report("n1", inc="new", cores=2), 0.0)
    core.enqueue(action("first", "t"), 1.0)
    effects = core.schedule(1.0)
    lost = finishes(effects)["first"]
    assert lost.error is not None
    assert lost.error.kind is ErrorKind.ENVIRONMENT_LOST
    reported = [e for e in effects if isinstance(e, EnvChanged) and e.trajectory_id == "t"]
    assert [e.status for e in reported] == ["closed"]  # recorded: a restart does not repeat it
    core.enqueue(action("second", "t"), 2.0)
    assert [s.action.spec.action_id for s in starts(core.schedule(2.0))] == ["second"]


def test_idle_environments_that_hold_no_memory_are_never_reclaimed_for_it():
    """The process backend's environments are directories: booked while an action runs in
    them, never ended "under memory pressure" when idle (they would free nothing but their
    files). A node whose idle environments hold memory keeps reclaiming (above)."""
    core = SchedulerCore(cfg=CoreConfig())
    core.node_report(report("n0", cores=2, mem=1000, idle_envs_hold_memory=False), 0.0)
    node = core.nodes["n0"]
    for i, t in enumerate(("t1", "t2", "t3", "t4", "t1")):  # 5 x 400 MiB > 1000 MiB
        core.enqueue(action(f"a{i}", t, mem=400), float(i))
        effects = core.schedule(float(i))
        assert not [e for e in effects if isinstance(e, DropEnvOnNode)]
        (run,) = starts(effects)
        assert node.reserved_mb == 400
        core.complete(done(run, "n0", "i0", 1), float(i) + 0.5)
        assert node.reserved_mb == 0
    assert set(core.envs) == {"t1", "t2", "t3", "t4"}  # t1 kept its environment
    for i, t in enumerate(("t1", "t2", "t3")):  # running ones are booked: the third waits
        core.enqueue(action(f"b{i}", t, mem=400), 10.0)
    assert len(starts(core.schedule(10.0))) == 2
    assert node.reserved_mb == 800
    assert core.waits["b2"].startswith("waiting for memory: its environment needs 400 MiB")


def test_a_restarted_scheduler_books_only_the_running_environments_of_such_a_node():
    core = SchedulerCore(cfg=CoreConfig())
    for t in ("idle", "busy"):
        core.restore_env(EnvPlacement(t, "j", "n0", "i0", 400))
    core.restore_running(action("r", "busy", mem=400), "n0", "i0", (0,), 0.0)
    r = RunningAction(action_id="r", attempt=0, trajectory_id="busy", cores=(0,))
    core.node_report(
        report("n0", cores=2, mem=1000, running=(r,), idle_envs_hold_memory=False), 0.0
    )
    assert "r" in core.running
    assert core.nodes["n0"].reserved_mb == 400  # "busy" alone
    assert core.envs["idle"].on_disk
    core.node_report(report("n0", cores=2, mem=1000, idle_envs_hold_memory=False), 1.0)
    assert "r" not in core.running  # ended (node_died: lost track of it): nothing booked
    assert core.nodes["n0"].reserved_mb == 0
