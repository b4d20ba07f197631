"""Node failures in the simulator (sim/faults.py): role-only recovery ends the failed node's
started work ``node_died``, re-queues what it was granted after its lease, and leaves the other
nodes alone; restarting everything loses every node's work; the injection is one failure per
tenth of the run, seeded."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.policies.base import MinPolicy
from services.scheduler.sim.fault_pools import CpuPools, GpuPools, Pools
from services.scheduler.sim.faults import (
    RESTART_ALL,
    RESTART_ALL_ROLLBACK,
    ROLE_ONLY,
    Attempt,
    Failure,
    FaultResult,
    mopd,
    plan,
    run,
)
from services.scheduler.sim.mopd_workload import Config
from services.scheduler.sim.traces import Step, Trace, Trajectory

DETECT, JOB = 5.0, 100.0


def cpu() -> Pools:
    return CpuPools(MinPolicy(), nodes=2, cores=2, numa=1)


def traj(tid: str, gap: float, secs: float) -> Trajectory:
    return Trajectory(tid, 0.0, (Step(gap, "tool", (1,), secs),))


# "a" ends at 1 s and the failure strikes then; b, c, d run 10 s; two share each node
BUSY: Trace = [traj("a", 0.0, 1.0), *(traj(t, 0.0, 10.0) for t in "bcd")]


def by_traj(r: FaultResult) -> dict[str, list[Attempt]]:
    out: dict[str, list[Attempt]] = {}
    for a in sorted(r.attempts, key=lambda a: a.submitted_at):
        out.setdefault(a.trajectory_id, []).append(a)
    return out


def node_of_a(trace: Trace) -> int:
    """Where the fault-free run places ``a`` (placement is deterministic)."""
    first = by_traj(run([trace], cpu))["a"][0]
    return int(first.node_id.rpartition("-")[2])


def test_injection_is_one_failure_per_tenth_of_the_run_and_seeded() -> None:
    failures = plan(1000, 10, 5, seed=3)
    assert [f.after // 100 for f in failures] == list(range(10))
    assert all(0 <= f.node < 5 for f in failures)
    assert plan(1000, 10, 5, seed=3) == failures
    assert plan(1000, 10, 5, seed=4) != failures


def test_role_only_fails_the_nodes_started_work_and_leaves_the_rest_alone() -> None:
    node = node_of_a(BUSY)
    r = run([BUSY], cpu, replace(ROLE_ONLY, detect_s=DETECT), [Failure(1, node)])
    assert r.failures == 1
    assert r.actions == 4, "every action completes in the end"
    dead = f"node-{node}"
    first = {tid: attempts[0] for tid, attempts in by_traj(r).items() if tid != "a"}
    victims = [a for a in first.values() if a.node_id == dead]
    others = [a for a in first.values() if a.node_id != dead]
    assert len(victims) == 1
    assert len(others) == 2
    (victim,) = victims
    assert (victim.end, victim.ended_at) == ("node_died", 1.0 + DETECT)
    assert all((a.end, a.ended_at) == ("ok", 10.0) for a in others), "the others kept working"
    retried = by_traj(r)[victim.trajectory_id]
    assert retried[-1].end == "ok"
    assert retried[-1].node_id != dead
    assert r.wasted_unit_s == 1.0  # it had run 1 s on one core


def test_a_grant_after_the_lease_ran_out_is_queued_again_not_failed() -> None:
    trace = [*BUSY, traj("e", 4.5, 10.0)]  # granted to the dead node 3.5 s after it failed
    node = node_of_a(BUSY)
    r = run([trace], cpu, replace(ROLE_ONLY, detect_s=DETECT), [Failure(1, node)])
    (e0,) = e = by_traj(r)["e"]  # one attempt: its environment was never created, not lost
    assert e0.node_id != f"node-{node}"  # queued again off the dead node, ran on another
    assert e0.requeued == 1
    assert e0.end != "node_died", "it never ran there"
    assert r.wasted_unit_s == 1.0
    assert e[-1].end == "ok"
    assert r.actions == 5


def test_restart_all_loses_every_nodes_work() -> None:
    node = node_of_a(BUSY)
    baseline = replace(RESTART_ALL, detect_s=DETECT, job_restart_s=JOB)
    r = run([BUSY], cpu, baseline, [Failure(1, node)])
    runs = by_traj(r)
    for tid in "bcd":
        assert (runs[tid][0].end, runs[tid][0].ended_at) == ("restart", 1.0 + DETECT)
        assert runs[tid][-1].end == "ok"
    assert len(runs["a"]) == 1, "completed work is kept"
    assert r.restarts == 1
    assert r.actions == 4
    assert r.makespan_s == 1.0 + DETECT + JOB + 10.0
    assert r.down_node_s == (DETECT + JOB) + JOB  # the failed node since it failed
    role = run([BUSY], cpu, replace(ROLE_ONLY, detect_s=DETECT), [Failure(1, node)])
    assert role.makespan_s < r.makespan_s


def test_restart_all_with_rollback_redoes_the_iterations_completed_work() -> None:
    node = node_of_a(BUSY)
    baseline = replace(RESTART_ALL_ROLLBACK, detect_s=DETECT, job_restart_s=JOB)
    r = run([BUSY], cpu, baseline, [Failure(1, node)])
    assert [a.end for a in by_traj(r)["a"]] == ["ok", "ok"]
    assert r.actions == 4


def test_a_failed_gpu_nodes_calls_are_retried_and_its_teachers_restored_elsewhere() -> None:
    # one host link per node: every restore costs the whole model, so restore seconds count
    # restores (with a link per GPU a DoP-8 restore is 8x cheaper: the DoP mix moves the sum)
    cfg = Config(batch=60, gpus=16, rollout_s=5.0, gpus_per_link=8)
    iterations = mopd(cfg, 1)

    def pools() -> Pools:
        return GpuPools(cfg)

    free = run(iterations, pools)
    r = run(iterations, pools, ROLE_ONLY, [Failure(10, 0)])
    died = [a for a in r.attempts if a.end == "node_died"]
    assert r.actions == free.actions == 60
    assert died
    assert {a.node_id for a in died} == {"g0"}
    assert r.restore_s > free.restore_s


def test_a_trajectory_whose_environment_died_reruns_its_earlier_commands() -> None:
    two = Trajectory("f", 0.0, (Step(0.0, "tool", (1,), 0.5), Step(0.0, "tool", (1,), 10.0)))
    trace = [traj("a", 0.0, 1.0), two, traj("b", 0.0, 10.0), traj("c", 0.0, 10.0)]
    node = int(by_traj(run([trace], cpu))["f"][-1].node_id.rpartition("-")[2])
    r = run([trace], cpu, replace(ROLE_ONLY, detect_s=DETECT), [Failure(2, node)])
    f = by_traj(r)["f"]
    assert [(a.step, a.end) for a in f if a.end != "environment_lost"] == [
        (0, "ok"),
        (1, "node_died"),
        (0, "ok"),
        (1, "ok"),
    ]
    assert [a.replay for a in f if a.end == "ok"] == [False, True, False]
    assert r.replays() >= 1
