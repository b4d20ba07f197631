"""A cancel of a running action ends it within ``kill_grace_s`` whatever becomes of its
completion; its cores stay booked until the node shows the process is over (issue 17)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.scheduler.config import load
from services.scheduler.core.effects import Effect, Finish, KillOnNode, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from tangram.contract import ActionResult, Completion, ErrorKind, Outcome, RunningAction

from .core_kit import action, done, report

GRACE = 2.0


def finishes(effects: list[Effect]) -> dict[str, ActionResult]:
    return {e.result.action_id: e.result for e in effects if isinstance(e, Finish)}


def started_one(core: SchedulerCore, aid: str, tid: str, now: float) -> StartOnNode:
    core.enqueue(action(aid, tid, cpus=2), now)
    (start,) = [e for e in core.schedule(now) if isinstance(e, StartOnNode)]
    return start


def listing(start: StartOnNode, *, cores: bool = True) -> RunningAction:
    """How the node lists the action: running on its cores, or only its completion pending."""
    return RunningAction(
        action_id=start.action.spec.action_id,
        attempt=start.action.attempt,
        trajectory_id=start.action.spec.trajectory_id,
        cores=start.cores if cores else (),
    )


@pytest.fixture
def core() -> SchedulerCore:
    core = SchedulerCore(cfg=CoreConfig(kill_grace_s=GRACE, node_timeout_s=100.0))
    core.node_report(report(cores=2), 0.0)
    return core


def test_a_cancelled_running_action_ends_cancelled_at_the_deadline_without_a_completion(
    core: SchedulerCore,
) -> None:
    start = started_one(core, "a", "t", 0.0)
    assert core.cancel("a", 1.0) == [KillOnNode("n0", "a", ErrorKind.CANCELLED)]
    assert finishes(core.tick(1.0 + GRACE - 0.1)) == {}
    assert core.cancel("a", 2.0) == [KillOnNode("n0", "a", ErrorKind.CANCELLED)]  # no new bound
    result = finishes(core.tick(1.0 + GRACE))["a"]
    assert result.status == "cancelled"
    assert result.error is not None
    assert "did not confirm the kill" in result.error.message
    assert result.allocation is not None
    assert result.allocation.cores == start.cores
    assert "a" not in core.running
    assert core.cancel("a", 5.0) == []


def test_its_cores_stay_booked_while_the_node_still_runs_it(core: SchedulerCore) -> None:
    start = started_one(core, "a", "t", 0.0)
    core.cancel("a", 0.0)
    core.tick(GRACE)
    core.enqueue(action("b", "t", cpus=2), GRACE)
    assert core.schedule(GRACE) == []  # the process may linger on those cores
    again = core.node_report(report(cores=2, running=(listing(start),)), GRACE + 1)
    assert again == [KillOnNode("n0", "a", ErrorKind.CANCELLED)]
    assert core.schedule(GRACE + 1) == []
    assert core.node_report(report(cores=2), GRACE + 2) == []  # no longer listed: over
    (b,) = [e for e in core.schedule(GRACE + 2) if isinstance(e, StartOnNode)]
    assert b.cores == start.cores


def test_a_node_holding_only_its_completion_frees_its_cores(core: SchedulerCore) -> None:
    start = started_one(core, "a", "t", 0.0)
    core.cancel("a", 0.0)
    core.tick(GRACE)
    pending = core.node_report(report(cores=2, running=(listing(start, cores=False),)), GRACE)
    assert pending == []  # neither adopted nor killed again: its process has ended
    core.enqueue(action("b", "t", cpus=2), GRACE)
    assert [e for e in core.schedule(GRACE) if isinstance(e, StartOnNode)]


def test_a_late_completion_changes_nothing_but_frees_its_cores(core: SchedulerCore) -> None:
    start = started_one(core, "a", "t", 0.0)
    core.close_env("t", 0.0)
    assert finishes(core.tick(GRACE))["a"].status == "cancelled"
    late = Completion(
        node_id="n0",
        incarnation="i0",
        action_id="a",
        attempt=start.action.attempt,
        outcome=Outcome(failure=ErrorKind.CANCELLED, started_at=0.0, finished_at=GRACE + 1),
    )
    assert core.complete(late, GRACE + 1) == []
    assert core.complete(late, GRACE + 2) == []  # and so does its duplicate
    assert core.snapshot()["free_cores"] == 2


def test_a_kill_confirmed_in_time_ends_once_from_the_nodes_report(core: SchedulerCore) -> None:
    start = started_one(core, "a", "t", 0.0)
    core.cancel("a", 0.0)
    killed = Completion(
        node_id="n0",
        incarnation="i0",
        action_id="a",
        attempt=start.action.attempt,
        outcome=Outcome(failure=ErrorKind.CANCELLED, detail="killed", started_at=0.0),
    )
    result = finishes(core.complete(killed, 1.0))["a"]
    assert result.status == "cancelled"
    assert result.error is not None
    assert result.error.message == "killed"
    assert core.tick(GRACE + 1) == []
    assert core.snapshot()["free_cores"] == 2


def test_a_killed_actions_node_lost_takes_its_cores_with_it(core: SchedulerCore) -> None:
    start = started_one(core, "a", "t", 0.0)
    core.cancel("a", 0.0)
    core.tick(GRACE)
    core.node_report(report(cores=2, inc="i1"), GRACE + 1)  # the agent restarted
    assert core.killed == {}
    assert core.complete(done(start), GRACE + 2) == []
    assert core.snapshot()["free_cores"] == 2


def test_kill_grace_and_the_core_settings_keep_their_flat_env_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANGRAM_SCHEDULER_KILL_GRACE_S", "0.5")
    monkeypatch.setenv("TANGRAM_SCHEDULER_NODE_TIMEOUT_S", "3")
    _, cfg = load({"dispatch_grace_s": 7.0})
    assert (cfg.core.kill_grace_s, cfg.core.node_timeout_s) == (0.5, 3.0)
    assert cfg.core.dispatch_grace_s == 7.0
    monkeypatch.setenv("TANGRAM_SCHEDULER_KILL_GRACE_S", "0")
    with pytest.raises(Exception, match="kill_grace_s"):
        load()


def test_checking_a_policy_name_builds_nothing() -> None:
    """The config refuses a bad policy without importing the elastic kernels (~0.8 s)."""
    code = (
        "import sys; from services.scheduler.config import load; "
        "load({'policy': 'elastic:3'}); "
        "assert 'services.scheduler.policies.elastic' not in sys.modules; "
        "assert 'numba' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_cancelled_dispatch_the_node_never_got_ends_instead_of_running_again() -> None:
    core = SchedulerCore(cfg=CoreConfig(kill_grace_s=10.0, dispatch_grace_s=1.0))
    core.node_report(report(cores=2), 0.0)
    started_one(core, "a", "t", 0.0)
    core.cancel("a", 0.5)
    # the node read dispatch 1 (seen) and does not list it: it refused it, so it never ran
    result = finishes(core.node_report(report(cores=2, seen=1), 2.0))["a"]
    assert result.status == "cancelled"
    assert "a" not in core.queue
    assert core.snapshot()["free_cores"] == 2
