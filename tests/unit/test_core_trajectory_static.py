"""Trajectory-static in the live scheduler core: reservations per node pool, released with the
environment, never a 0-core start; a bad policy name is refused when the config is decoded."""

from __future__ import annotations

import pytest

from services.scheduler.config import load
from services.scheduler.core.effects import Effect, StartOnNode
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.policies.spec import make_policy
from tangram.errors import InvalidRequest

from .core_kit import action, done, report


def core_with(*nodes: str, units: int = 2) -> SchedulerCore:
    core = SchedulerCore(make_policy(f"trajectory-static:{units}"))
    for node in nodes:
        core.node_report(report(node), 0.0)
    return core


def starts(effects: list[Effect]) -> list[StartOnNode]:
    found = [e for e in effects if isinstance(e, StartOnNode)]
    assert all(len(s.cores) > 0 for s in found), "a grant of 0 means 'not now', never a start"
    return found


def started(effects: list[Effect]) -> dict[str, str]:
    """Trajectory -> node of every action started."""
    return {s.action.spec.trajectory_id: s.node_id for s in starts(effects)}


def enqueue(core: SchedulerCore, *tids: str, prefix: str = "a") -> None:
    for tid in tids:
        core.enqueue(action(f"{prefix}-{tid}", tid), 0.0)


def test_reservations_are_per_node_pool() -> None:
    core = core_with("n0", "n1")
    enqueue(core, "t0", "t1", "t2", "t3", "t4")
    placed = started(core.schedule(0.0))
    assert sorted(placed) == ["t0", "t1", "t2", "t3"]  # 2 reservations of 2 cores per node
    assert sorted(placed.values()) == ["n0", "n0", "n1", "n1"]
    assert "a-t4" in core.queue  # both pools are fully reserved though each has 2 free cores
    assert all(len(n.free) == 2 for n in core.nodes.values())
    assert starts(core.schedule(1.0)) == []


def test_no_start_ever_has_zero_cores() -> None:
    core = core_with("n0", units=3)
    enqueue(core, "t0", "t1", prefix="x")  # t1 waits for a reservation ...
    core.enqueue(action("b-t0", "t0"), 0.0)  # ... and behind it t0 runs inside its own
    effects = core.schedule(0.0)
    assert [s.action.spec.action_id for s in starts(effects)] == ["x-t0", "b-t0"]
    assert "x-t1" in core.queue


def test_an_action_inside_its_reservation_passes_a_waiting_new_trajectory() -> None:
    core = core_with("n0")
    enqueue(core, "t0", "t1", "t2")
    first = starts(core.schedule(0.0))
    core.complete(done(first[0], "n0", "i0", 1), 1.0)
    core.enqueue(action("b-t0", "t0"), 1.0)  # queued behind t2, which waits for a reservation
    assert [s.action.spec.action_id for s in starts(core.schedule(1.0))] == ["b-t0"]


def test_closing_an_environment_frees_its_reservation() -> None:
    core = core_with("n0")
    enqueue(core, "t0", "t1", "t2")
    first = starts(core.schedule(0.0))
    for run in first:
        core.complete(done(run, "n0", "i0", 1), 1.0)
    assert starts(core.schedule(1.0)) == []  # t0 and t1 hold their reservations while idle
    core.close_env("t0", 2.0)
    assert started(core.schedule(2.0)) == {"t2": "n0"}


def test_an_expired_environment_frees_its_reservation() -> None:
    core = core_with("n0")
    enqueue(core, "t0", "t1", "t2")
    for run in starts(core.schedule(0.0)):
        core.complete(done(run, "n0", "i0", 1), 1.0)
    core.env_expired("n0", "t1")
    assert started(core.schedule(2.0)) == {"t2": "n0"}


def test_a_restarted_node_starts_with_an_empty_pool() -> None:
    core = core_with("n0")
    enqueue(core, "t0", "t1")
    assert len(starts(core.schedule(0.0))) == 2
    core.node_report(report("n0", inc="i1"), 1.0)  # the old incarnation died with its envs
    enqueue(core, "u0", "u1")
    assert started(core.schedule(2.0)) == {"u0": "n0", "u1": "n0"}


def test_a_reservation_that_started_nothing_is_not_kept() -> None:
    core = core_with("n0")
    core.enqueue(action("big", "t0", cpus=3), 0.0)  # reserves 2 cores, runs on 3
    core.enqueue(action("small", "t1", cpus=[1, 2]), 0.0)  # reserved, but 2 > 1 free core
    (big,) = starts(core.schedule(0.0))
    assert (big.action.spec.action_id, len(big.cores)) == ("big", 3)
    core.cancel("small", 0.5)  # t1 never got an environment, so it must hold nothing
    core.complete(done(big, "n0", "i0", 1), 1.0)
    core.close_env("t0", 1.0)
    enqueue(core, "t2", "t3")
    assert started(core.schedule(2.0)) == {"t2": "n0", "t3": "n0"}


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("nope", "unknown scheduling policy 'nope'"),
        ("trajectory-static:0", "reservation must be ≥ 1"),
        ("fixed-dop:x", "bad scheduling policy 'fixed-dop:x'"),
    ],
)
def test_a_bad_policy_is_refused_at_config_decode(
    monkeypatch: pytest.MonkeyPatch, value: str, says: str
) -> None:
    monkeypatch.setenv("TANGRAM_SCHEDULER_POLICY", value)
    with pytest.raises(InvalidRequest) as err:
        load()
    message = str(err.value)
    assert "TANGRAM_SCHEDULER_POLICY" in message
    assert says in message
    assert "known: min, elastic, elastic:DEPTH, fixed-dop:K, trajectory-static:K" in message


def test_a_good_policy_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_SCHEDULER_POLICY", "trajectory-static:3")
    assert load()[1].policy == "trajectory-static:3"


def test_overrides_reach_the_scheduler_and_the_mesh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_SCHEDULER_POLICY", "min")
    mesh, cfg = load({"policy": "fixed-dop:4", "nats_url": "nats://127.0.0.1:4999"})
    assert (cfg.policy, mesh.nats_url) == ("fixed-dop:4", "nats://127.0.0.1:4999")
    with pytest.raises(InvalidRequest, match="TANGRAM_SCHEDULER_POLICY"):
        load({"policy": "fastest"})
