"""The scheduler's pure core: allocation bookkeeping, FCFS pools, failures and restarts."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.books import EnvPlacement
from services.scheduler.core.effects import (
    DropEnvOnNode,
    EnvChanged,
    Finish,
    KillOnNode,
    StartOnNode,
)
from services.scheduler.core.placement import pick_cores
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from tangram.contract import (
    ActionResult,
    Completion,
    ErrorKind,
    NodeLeaving,
    NodeReport,
    Outcome,
    RunningAction,
)

from .core_kit import action, done, report


def starts(effects: list) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def finishes(effects: list) -> dict[str, ActionResult]:
    return {e.result.action_id: e.result for e in effects if isinstance(e, Finish)}


def leaving(
    node: str,
    inc: str = "i0",
    draining: bool = False,
    started: tuple[str, ...] | None = None,
    envs: tuple[str, ...] | None = None,
) -> NodeLeaving:
    return NodeLeaving(node_id=node, incarnation=inc, draining=draining, started=started, envs=envs)


def core_with(*reports: NodeReport, **cfg: float) -> SchedulerCore:
    core = SchedulerCore(cfg=CoreConfig(**cfg))  # type: ignore[arg-type]
    for r in reports:
        core.node_report(r, 0.0)
    return core


def test_fcfs_min_grants_and_exact_cores():
    core = core_with(report(cores=2))
    for i in range(3):
        core.enqueue(action(f"a{i}", f"t{i}"), 0.0)
    first = starts(core.schedule(1.0))
    assert [s.action.spec.action_id for s in first] == ["a0", "a1"]
    assert {c for s in first for c in s.cores} == {0, 1}
    assert all(s.action.attempt == 1 for s in first)
    effects = core.complete(done(first[0], "n0", "i0", 1), 2.0)
    assert "a0" in finishes(effects)
    nxt = starts(core.schedule(2.0))
    assert [s.action.spec.action_id for s in nxt] == ["a2"]
    assert nxt[0].cores == first[0].cores


def test_duplicate_enqueue_and_stale_completions_change_nothing():
    core = core_with(report(cores=2))
    core.enqueue(action("a", "t"), 0.0)
    core.enqueue(action("a", "t"), 0.0)
    (run,) = starts(core.schedule(0.0))
    core.enqueue(action("a", "t"), 0.0)  # running: still a duplicate
    assert core.complete(done(run, "n0", "i0", 2), 1.0) == []  # wrong attempt
    assert core.complete(done(run, "n1", "i0", 1), 1.0) == []  # wrong node
    assert "a" in finishes(core.complete(done(run, "n0", "i0", 1), 1.0))
    assert core.complete(done(run, "n0", "i0", 1), 1.0) == []  # duplicate
    core.enqueue(action("a", "t"), 2.0)  # after it finished: remembered, not run again
    assert starts(core.schedule(2.0)) == []


def test_a_trajectory_stays_on_its_node_and_new_ones_balance_memory():
    core = core_with(report("n0", cores=4, mem=1000), report("n1", cores=4, mem=1000))
    core.enqueue(action("a0", "t0", mem=600), 0.0)
    core.enqueue(action("a1", "t1", mem=100), 0.0)
    placed = {s.action.spec.trajectory_id: s.node_id for s in starts(core.schedule(0.0))}
    assert placed["t0"] != placed["t1"]  # the second goes to the emptier node
    for i in range(3):
        core.enqueue(action(f"b{i}", "t0"), 0.0)
    again = starts(core.schedule(0.0))
    assert {s.node_id for s in again} == {placed["t0"]}


def test_env_memory_is_reserved_for_the_trajectory_and_released_on_close():
    core = core_with(report(cores=4, mem=300))
    core.enqueue(action("a", "t1", mem=200), 0.0)
    core.enqueue(action("b", "t2", mem=200), 0.0)
    (run,) = starts(core.schedule(0.0))
    assert run.action.spec.trajectory_id == "t1"
    assert starts(core.schedule(1.0)) == []  # t1 holds its memory while it runs
    assert "waiting for memory" in core.waits["b"]
    effects = core.close_env("t1", 2.0)
    assert DropEnvOnNode("n0", "t1") in effects
    assert any(isinstance(e, EnvChanged) and e.status == "closed" for e in effects)
    assert [s.action.spec.trajectory_id for s in starts(core.schedule(2.0))] == ["t2"]


def test_close_env_cancels_queued_and_kills_running():
    core = core_with(report(cores=1))
    core.enqueue(action("a", "t"), 0.0)
    core.enqueue(action("b", "t"), 0.0)
    starts(core.schedule(0.0))
    effects = core.close_env("t", 1.0)
    assert finishes(effects)["b"].status == "cancelled"
    assert KillOnNode("n0", "a", ErrorKind.CANCELLED) in effects


def test_cancel_queued_and_running():
    core = core_with(report(cores=1))
    core.enqueue(action("a", "t"), 0.0)
    core.enqueue(action("b", "u"), 0.0)
    starts(core.schedule(0.0))
    assert finishes(core.cancel("b", 1.0))["b"].error.kind is ErrorKind.CANCELLED  # type: ignore[union-attr]
    assert core.cancel("a", 1.0) == [KillOnNode("n0", "a", ErrorKind.CANCELLED)]


def test_silent_node_fails_its_actions_and_loses_its_envs():
    core = core_with(report(cores=2), node_timeout_s=5.0)
    core.enqueue(action("a", "t"), 0.0)
    starts(core.schedule(0.0))
    core.enqueue(action("b", "t"), 1.0)
    effects = core.tick(10.0)
    res = finishes(effects)["a"]
    assert res.error is not None
    assert res.error.kind is ErrorKind.NODE_DIED
    assert any(isinstance(e, EnvChanged) and e.status == "lost" for e in effects)
    core.node_report(report(inc="i1"), 11.0)
    lost = finishes(core.schedule(11.0))["b"]
    assert lost.error is not None
    assert lost.error.kind is ErrorKind.ENVIRONMENT_LOST


def test_new_incarnation_means_the_old_one_died():
    core = core_with(report(cores=2))
    core.enqueue(action("a", "t"), 0.0)
    starts(core.schedule(0.0))
    effects = core.node_report(report(inc="i1", cores=2), 1.0)
    assert finishes(effects)["a"].error.kind is ErrorKind.NODE_DIED  # type: ignore[union-attr]
    assert core.nodes["n0"].incarnation == "i1"
    assert len(core.nodes["n0"].free) == 2


def test_queue_timeout_and_impossible_actions_fail_fast():
    core = core_with(report(cores=2, mem=1000))
    core.enqueue(action("big", "t0", cpus=8), 0.0)
    core.enqueue(action("fat", "t1", mem=5000), 0.0)
    failed = finishes(core.schedule(0.0))
    assert failed["big"].error.kind is ErrorKind.INVALID_REQUEST  # type: ignore[union-attr]
    assert "no node can hold it" in failed["fat"].error.message  # type: ignore[union-attr]
    core.enqueue(action("x", "t2", cpus=2), 0.0)
    core.enqueue(action("y", "t3", queue_timeout_s=1.0), 0.0)
    starts(core.schedule(0.0))
    res = finishes(core.tick(2.0))["y"]
    assert res.error.kind is ErrorKind.QUEUE_TIMEOUT  # type: ignore[union-attr]


def test_a_new_trajectory_is_not_starved_by_busy_old_ones():
    core = core_with(report(cores=2, mem=1000))
    core.enqueue(action("a", "old"), 0.0)
    core.enqueue(action("b", "old"), 0.0)
    runs = starts(core.schedule(0.0))
    core.enqueue(action("new", "fresh", cpus=2), 1.0)
    core.enqueue(action("c", "old"), 1.1)
    core.complete(done(runs[0], "n0", "i0", 1), 2.0)
    assert starts(core.schedule(2.0)) == []  # 'c' must not take the core 'new' waits for
    core.complete(done(runs[1], "n0", "i0", 1), 3.0)
    assert [s.action.spec.action_id for s in starts(core.schedule(3.0))] == ["new"]


def test_restart_adopts_what_nodes_report_and_redoes_what_they_never_got():
    core = SchedulerCore()
    a, b = action("a", "t"), action("b", "u")
    core.restore_env(EnvPlacement("t", "j", "n0", "i0", 100))
    core.restore_env(EnvPlacement("u", "j", "n0", "i0", 100))
    core.restore_running(msgspec.structs.replace(a, attempt=1), "n0", "i0", (0,), 0.0)
    core.restore_running(msgspec.structs.replace(b, attempt=1), "n0", "i0", (1,), 0.0)
    core.hold_until(1.0)
    assert core.schedule(0.5) == []
    seen = RunningAction(action_id="a", attempt=1, trajectory_id="t", cores=(0,))
    core.node_report(report(cores=2, running=(seen,)), 0.6)
    assert core.running["a"].confirmed
    assert "b" in core.queue
    (redo,) = starts(core.schedule(1.0))
    assert redo.action.spec.action_id == "b"
    assert redo.action.attempt == 2
    assert redo.cores == (1,)


def test_a_restored_run_is_redone_only_on_a_report_made_under_this_epoch():
    """A report the agent sent before it knew this scheduler's epoch proves nothing: the
    replaced scheduler, still alive, may dispatch the action to it after that report."""
    core = SchedulerCore()
    core.epoch = 2
    a = action("a", "t")
    core.restore_env(EnvPlacement("t", "j", "n0", "i0", 100))
    core.restore_running(msgspec.structs.replace(a, attempt=1), "n0", "i0", (0,), 0.0)
    old = msgspec.structs.replace(report(cores=2), seen_epoch=1)
    core.node_report(old, 0.5)
    assert "a" in core.running  # not redone on an old report
    assert "a" not in core.queue
    core.node_report(msgspec.structs.replace(old, seen_epoch=2), 0.6)
    assert "a" not in core.running  # this epoch's report: it never ran
    assert "a" in core.queue


def test_restored_actions_whose_node_never_returns_end_as_node_died():
    core = SchedulerCore(cfg=CoreConfig(node_timeout_s=2.0))
    core.restore_running(
        msgspec.structs.replace(action("a", "t"), attempt=1), "gone", "i0", (0,), 0.0
    )
    core.hold_until(1.0)
    assert finishes(core.tick(1.5)) == {}
    assert finishes(core.tick(3.5))["a"].error.kind is ErrorKind.NODE_DIED  # type: ignore[union-attr]


def test_a_node_running_an_action_we_only_knew_as_queued_is_adopted():
    core = core_with(report(cores=2))
    core.enqueue(action("a", "t"), 0.0)
    seen = RunningAction(action_id="a", attempt=3, trajectory_id="t", cores=(1,))
    core.node_report(report(cores=2, running=(seen,)), 0.1)
    assert core.running["a"].action.attempt == 3
    assert core.nodes["n0"].free == {0}


def test_numa_local_best_fit():
    numa = {0: (0, 1, 2, 3), 1: (4, 5, 6, 7)}
    assert pick_cores({0, 1, 2, 3, 4, 5}, numa, 2) == (4, 5)  # the tighter NUMA node
    assert pick_cores({0, 1, 2, 3, 4, 5}, numa, 4) == (0, 1, 2, 3)
    assert pick_cores({0, 1, 4, 5, 6}, numa, 4) == (0, 4, 5, 6)  # spans as few as it can
    with pytest.raises(ValueError, match="asked for"):
        pick_cores({0}, numa, 2)


events = st.lists(
    st.tuples(
        st.sampled_from(["submit", "complete", "tick", "cancel", "close"]),
        st.integers(0, 30),
        st.integers(1, 3),
    ),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(events)
def test_cores_are_never_double_allocated_and_every_grant_is_allowed(evs):
    core = core_with(report("n0", cores=4, numa=2, mem=10_000), report("n1", cores=3, mem=10_000))
    running: dict[str, StartOnNode] = {}
    now = 0.0
    for kind, n, cpus in evs:
        now += 0.1
        effects: list = []
        if kind == "submit":
            effects += core.enqueue(action(f"a{n}-{now}", f"t{n % 5}", cpus=[1, cpus]), now)
        elif kind == "complete" and running:
            run = running.pop(sorted(running)[n % len(running)])
            effects += core.complete(done(run), now)
        elif kind == "cancel" and core.queue:
            effects += core.cancel(sorted(core.queue)[n % len(core.queue)], now)
        elif kind == "close":
            effects += core.close_env(f"t{n % 5}", now)
            running = {
                k: v for k, v in running.items() if v.action.spec.trajectory_id != f"t{n % 5}"
            }
            for aid in [
                a for a, r in core.running.items() if r.action.spec.trajectory_id == f"t{n % 5}"
            ]:
                r = core.running[aid]
                core.complete(
                    Completion(
                        node_id=r.node_id,
                        incarnation=r.incarnation,
                        action_id=aid,
                        attempt=r.action.attempt,
                        outcome=Outcome(failure=ErrorKind.CANCELLED),
                    ),
                    now,
                )
        effects += core.schedule(now)
        for s in starts(effects):
            assert len(s.cores) in s.action.demands[0].choices
            running[s.action.spec.action_id] = s
        for node in core.nodes.values():
            held = [c for r in core.running.values() if r.node_id == node.node_id for c in r.cores]
            assert len(held) == len(set(held)), "a core was granted twice"
            assert set(held) | node.free == {c for cs in node.numa.values() for c in cs}
            assert not set(held) & node.free
        envs_by_traj = {tid: env.node_id for tid, env in core.envs.items()}
        for r in core.running.values():
            assert envs_by_traj[r.action.spec.trajectory_id] == r.node_id


def test_a_draining_node_finishes_its_work_but_gets_no_new_work():
    core = core_with(report("n0", cores=2), report("n1", cores=2))
    core.enqueue(action("a", "t"), 0.0)
    (run,) = starts(core.schedule(0.0))
    core.node_leaving(leaving(run.node_id, draining=True), 0.5)
    core.enqueue(action("b", "t"), 1.0)  # bound to the draining node: waits
    core.enqueue(action("c", "fresh"), 1.0)  # new trajectory: goes elsewhere
    placed = starts(core.schedule(1.0))
    assert [(s.action.spec.action_id, s.node_id != run.node_id) for s in placed] == [("c", True)]
    assert "a" in finishes(core.complete(done(run, run.node_id, "i0", 1), 2.0))
    gone = core.node_leaving(leaving(run.node_id), 3.0)
    assert any(isinstance(e, EnvChanged) and e.status == "lost" for e in gone)
    lost = finishes(core.schedule(3.0))["b"]
    assert lost.error is not None
    assert lost.error.kind is ErrorKind.ENVIRONMENT_LOST


def test_a_late_report_from_an_agent_that_left_brings_no_ghost_back():
    core = core_with(report("n0", inc="old", cores=2))
    core.node_leaving(leaving("n0", inc="old"), 1.0)
    assert core.node_report(report("n0", inc="old", cores=2), 1.1) == []  # a last heartbeat
    assert "n0" not in core.nodes
    core.node_report(report("n0", inc="new", cores=2), 2.0)
    core.enqueue(action("a", "t"), 2.0)
    (run,) = starts(core.schedule(2.0))
    assert run.incarnation == "new"
    assert core.node_report(report("n0", inc="old", cores=2), 2.1) == []
    assert core.running["a"].incarnation == "new"


def test_a_replaced_agents_late_report_does_not_kill_the_new_ones_work():
    core = core_with(report("n0", inc="old", cores=2))
    core.node_report(report("n0", inc="new", cores=2), 1.0)  # restarted
    core.enqueue(action("a", "t"), 1.0)
    (run,) = starts(core.schedule(1.0))
    assert core.node_report(report("n0", inc="old", cores=2), 1.2) == []
    assert core.complete(done(run, "n0", "old", 1), 1.3) == []  # not the one that ran it
    assert "a" in finishes(core.complete(done(run, "n0", "new", 1), 1.4))


def test_a_dispatch_the_leaving_agent_never_started_runs_elsewhere():
    core = core_with(report("n0", cores=1), report("n1", inc="i1", cores=1))
    core.enqueue(action("old", "busy"), 0.0)
    core.enqueue(action("new", "fresh"), 0.0)
    placed = {s.action.spec.action_id: s for s in starts(core.schedule(0.0))}
    first, late = placed["old"], placed["new"]
    core.complete(done(first, first.node_id, first.incarnation, 1), 0.5)  # its env stays
    # the agent of `late` stops taking work before the dispatch reaches it, then leaves
    envs = (first.action.spec.trajectory_id,) if first.node_id == late.node_id else ()
    gone = core.node_leaving(leaving(late.node_id, late.incarnation, started=(), envs=envs), 1.0)
    assert "new" not in finishes(gone), "an action that never started was failed"
    released = [e for e in gone if isinstance(e, EnvChanged) and e.trajectory_id == "fresh"]
    assert [e.status for e in released] == ["closed"]
    assert "fresh" not in core.gone_envs
    (again,) = starts(core.schedule(1.0))
    assert again.action.spec.action_id == "new"
    assert again.node_id != late.node_id
    assert again.action.attempt == 2  # a new attempt: word of the first changes nothing


def test_what_the_leaving_agent_started_and_never_reported_done_fails_as_node_died():
    core = core_with(report("n0", cores=2))
    core.enqueue(action("a", "t"), 0.0)
    core.enqueue(action("b", "t"), 0.0)
    core.schedule(0.0)
    gone = core.node_leaving(leaving("n0", started=("a",), envs=("t",)), 1.0)
    died = finishes(gone)
    assert died["a"].error is not None
    assert died["a"].error.kind is ErrorKind.NODE_DIED
    assert "b" not in died
    assert "b" in core.queue  # never started: it waits for a node
    assert [e.status for e in gone if isinstance(e, EnvChanged)] == ["lost"]
    lost = finishes(core.schedule(1.5))["b"]  # its trajectory's environment went with the node
    assert lost.error is not None
    assert lost.error.kind is ErrorKind.ENVIRONMENT_LOST
