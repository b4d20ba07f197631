"""The scheduler books node memory only for running and paused environments (env tiering)."""

from __future__ import annotations

import msgspec

from services.scheduler.core.effects import DropEnvOnNode, EnvChanged, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from tangram.contract import NodeReport

from .core_kit import action, done, report


def starts(effects: list) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def with_disk(r: NodeReport, *on_disk: str) -> NodeReport:
    return msgspec.structs.replace(r, envs=on_disk, envs_on_disk=on_disk)


def one_env_node(mem: int = 300) -> tuple[SchedulerCore, StartOnNode]:
    """A node with room for one 200 MiB environment; t1's first action ran there."""
    core = SchedulerCore(cfg=CoreConfig())
    core.node_report(report(cores=4, mem=mem), 0.0)
    core.enqueue(action("a", "t1", mem=200), 0.0)
    (run,) = starts(core.schedule(0.0))
    core.complete(done(run), 1.0)
    return core, run


def test_an_environment_on_disk_frees_its_memory_for_another_trajectory() -> None:
    core, _ = one_env_node()
    assert core.nodes["n0"].reserved_mb == 200
    assert core.node_report(with_disk(report(cores=4, mem=300), "t1"), 2.0) == []
    assert core.nodes["n0"].reserved_mb == 0
    core.enqueue(action("b", "t2", mem=200), 3.0)
    effects = core.schedule(3.0)
    assert [s.action.spec.trajectory_id for s in starts(effects)] == ["t2"]
    assert not [e for e in effects if isinstance(e, EnvChanged) and e.trajectory_id == "t1"]
    assert "t1" in core.envs  # kept on disk, not reclaimed
    assert core.nodes["n0"].reserved_mb == 200


def test_the_next_action_of_an_environment_on_disk_books_its_memory_again() -> None:
    core, _ = one_env_node()
    core.node_report(with_disk(report(cores=4, mem=300), "t1"), 2.0)
    core.enqueue(action("c", "t1", mem=200), 3.0)
    (run,) = starts(core.schedule(3.0))
    assert run.node_id == "n0"
    assert core.nodes["n0"].reserved_mb == 200
    # a report sent before the restore still says on disk: the running action wins
    core.node_report(with_disk(report(cores=4, mem=300), "t1"), 3.1)
    assert core.nodes["n0"].reserved_mb == 200
    core.complete(done(run), 4.0)
    core.node_report(report(cores=4, mem=300), 4.1)  # restored: resident
    assert core.nodes["n0"].reserved_mb == 200


def test_a_restarted_node_agent_keeps_its_environments_on_disk() -> None:
    core, _ = one_env_node()
    core.node_report(with_disk(report(cores=4, mem=300), "t1"), 2.0)
    effects = core.node_report(with_disk(report(inc="i1", cores=4, mem=300), "t1"), 3.0)
    assert not [e for e in effects if isinstance(e, EnvChanged) and e.status == "lost"]
    assert core.envs["t1"].incarnation == "i1"
    assert core.nodes["n0"].reserved_mb == 0
    core.enqueue(action("d", "t1", mem=200), 4.0)
    (run,) = starts(core.schedule(4.0))
    assert (run.node_id, run.incarnation) == ("n0", "i1")


def test_a_restart_still_loses_environments_that_were_not_on_disk() -> None:
    core, _ = one_env_node()
    effects = core.node_report(report(inc="i1", cores=4, mem=300), 2.0)
    assert [e.status for e in effects if isinstance(e, EnvChanged)] == ["lost"]
    assert core.nodes["n0"].reserved_mb == 0


def test_an_environment_on_disk_the_scheduler_does_not_know_is_dropped() -> None:
    core, _ = one_env_node()
    effects = core.node_report(with_disk(report(cores=4, mem=300), "ghost"), 2.0)
    assert DropEnvOnNode("n0", "ghost") in effects


def test_closing_an_environment_on_disk_releases_no_memory_twice() -> None:
    core, _ = one_env_node()
    core.node_report(with_disk(report(cores=4, mem=300), "t1"), 2.0)
    core.close_env("t1", 3.0)
    assert core.nodes["n0"].reserved_mb == 0


def test_an_environment_on_disk_is_restored_only_into_free_memory() -> None:
    """t1 went to disk and t2 took its memory: t1's next action must not book the node past
    its memory. While t2 works it waits, saying why; once t2 is idle, t2 is reclaimed."""
    core, _ = one_env_node()
    core.node_report(with_disk(report(cores=4, mem=300), "t1"), 2.0)
    core.enqueue(action("b", "t2", mem=200), 3.0)
    (b,) = starts(core.schedule(3.0))
    core.enqueue(action("c", "t1", mem=200), 3.5)
    assert starts(core.schedule(3.5)) == []  # t2 is busy: nothing to reclaim
    assert core.nodes["n0"].reserved_mb == 200
    assert "on disk" in core.waits["c"]
    core.complete(done(b), 4.0)
    effects = core.schedule(4.0)
    (c,) = starts(effects)
    assert c.action.spec.trajectory_id == "t1"
    lost = [e.trajectory_id for e in effects if isinstance(e, EnvChanged) and e.status == "lost"]
    assert lost == ["t2"]  # the idle resident one made room
    assert core.nodes["n0"].reserved_mb == 200
