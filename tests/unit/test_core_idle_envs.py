"""Environments that hold no memory when idle (the process backend: ``idle_envs_hold_memory``
False): the booking follows the processes (running or killed-but-unconfirmed actions of the
trajectory on that node), on every path that frees cores, and such an environment is never
reclaimed for memory."""

from __future__ import annotations

import msgspec

from services.scheduler.core.books import EnvPlacement
from services.scheduler.core.effects import EnvChanged, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from tangram.contract import RunningAction

from .core_kit import action, done, report
from .test_scheduler_gpu import JUDGE, gpu_report, infer, prepared
from .test_scheduler_gpu import done as gpu_done


def rep(node: str = "n0", **kw: object) -> object:
    return report(node, cores=4, mem=1000, idle_envs_hold_memory=False, **kw)  # type: ignore[arg-type]


def starts(effects: list) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def lost(effects: list) -> list[str]:
    return [e.trajectory_id for e in effects if isinstance(e, EnvChanged) and e.status == "lost"]


def listing(s: StartOnNode) -> RunningAction:
    a = s.action
    return RunningAction(
        action_id=a.spec.action_id,
        attempt=a.attempt,
        trajectory_id=a.spec.trajectory_id,
        cores=s.cores,
    )


def test_two_actions_of_one_trajectory_keep_it_booked_until_the_last_ends():
    core = SchedulerCore()
    core.node_report(rep(), 0.0)
    core.enqueue(action("a", "t", mem=600), 0.0)
    core.enqueue(action("b", "t", mem=600), 0.0)
    a, b = starts(core.schedule(0.0))
    core.complete(done(a), 1.0)
    assert core.nodes["n0"].reserved_mb == 600  # b still runs in it
    core.complete(done(b), 2.0)
    assert core.nodes["n0"].reserved_mb == 0


def test_an_env_on_disk_is_counted_once_in_a_pass_however_many_actions_it_has():
    core = SchedulerCore()
    core.node_report(rep(), 0.0)
    for t in ("t1", "t2"):
        core.enqueue(action(f"{t}-0", t, mem=400), 0.0)
        (s,) = starts(core.schedule(0.0))
        core.complete(done(s), 0.5)
    for aid in ("t1-a", "t1-b", "t2-a"):
        core.enqueue(action(aid, aid[:2], mem=400), 1.0)
    assert len(starts(core.schedule(1.0))) == 3  # 800 of 1000 MiB
    assert core.waits == {}


def test_a_dispatch_redone_or_lost_track_of_unbooks_and_nothing_is_reclaimed():
    core = SchedulerCore(cfg=CoreConfig(kill_grace_s=10.0, dispatch_grace_s=1.0))
    core.node_report(rep(), 0.0)
    core.enqueue(action("a", "t", mem=600), 0.0)
    core.schedule(0.0)
    core.cancel("a", 0.5)
    core.node_report(rep(seen=1), 2.0)  # read, unlisted: it never ran (cancelled)
    assert core.nodes["n0"].reserved_mb == 0
    core.enqueue(action("b", "u", mem=600), 3.0)
    (s,) = starts(core.schedule(3.0))
    core.node_report(rep(running=(listing(s),), seen=2), 4.0)
    core.node_report(rep(seen=2), 5.0)  # vanished without a completion
    assert core.nodes["n0"].reserved_mb == 0
    core.enqueue(action("c", "new", mem=600), 6.0)
    assert lost(core.schedule(6.0)) == []


def test_an_adopted_run_books_its_environment():
    core = SchedulerCore()
    core.restore_env(EnvPlacement("t", "j", "n0", "i0", 600))
    core.enqueue(action("a", "t", mem=600), 0.0)
    ra = RunningAction(action_id="a", attempt=1, trajectory_id="t", cores=(0,))
    core.node_report(rep(running=(ra,)), 0.0)
    assert "a" in core.running
    assert core.nodes["n0"].reserved_mb == 600


def test_a_killed_process_keeps_its_env_booked_and_unreclaimed():
    core = SchedulerCore(cfg=CoreConfig(kill_grace_s=1.0))
    core.node_report(rep(), 0.0)
    core.enqueue(action("a", "t", mem=600), 0.0)
    (sa,) = starts(core.schedule(0.0))
    core.cancel("a", 0.1)
    core.tick(2.0)  # a ends cancelled; its process may still run
    core.node_report(rep(running=(listing(sa),)), 2.0)
    core.enqueue(action("b", "t", mem=600), 2.5)
    (sb,) = starts(core.schedule(2.5))
    core.complete(done(sb), 3.0)
    assert core.nodes["n0"].reserved_mb == 600
    core.enqueue(action("c", "t2", mem=600), 3.5)
    effects = core.schedule(3.5)
    assert starts(effects) == []
    assert lost(effects) == []


def test_a_gpu_call_of_the_trajectory_does_not_keep_its_cpu_env_booked():
    core = SchedulerCore()
    core.restore_services([JUDGE])
    core.node_report(rep(), 0.0)
    core.node_report(gpu_report(services=prepared()), 0.0)
    core.enqueue(action("cpu", "t", mem=600), 0.0)
    (c,) = starts(core.schedule(0.0))
    g = infer("g")
    core.enqueue(
        msgspec.structs.replace(g, spec=msgspec.structs.replace(g.spec, trajectory_id="t")), 0.1
    )
    (gs,) = starts(core.schedule(0.1))
    core.complete(done(c), 1.0)
    assert core.nodes["n0"].reserved_mb == 0
    core.complete(gpu_done(gs), 2.0)
    core.enqueue(action("n", "t2", mem=600), 3.0)
    assert lost(core.schedule(3.0)) == []
