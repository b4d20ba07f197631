"""The simulator: deterministic per seed, and the same decisions as the live core on replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.core.effects import StartOnNode
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.policies.spec import make_policy
from services.scheduler.sim.engines import SimAction, sim_node, unified
from services.scheduler.sim.simulator import Cluster, SimResult, build_trace, main, simulate
from services.scheduler.sim.traces import CodingConfig, ai_coding, busy_fraction, dump, load
from tangram.contract import Completion, Outcome

SMALL = Cluster(nodes=2, cores_per_node=32)


@pytest.mark.parametrize("workload", ["coding", "mopd", "deepsearch"])
def test_deterministic_for_a_seed(workload: str) -> None:
    a = simulate(build_trace(workload, 24, seed=7), "elastic", SMALL)
    b = simulate(build_trace(workload, 24, seed=7), "elastic", SMALL)
    assert a.decisions == b.decisions
    assert a.records == b.records
    assert len(a.records) == sum(len(t.steps) for t in build_trace(workload, 24, seed=7))


@pytest.mark.parametrize("policy", ["min", "elastic", "fixed-dop:4", "trajectory-static:2"])
def test_every_action_finishes_within_capacity(policy: str) -> None:
    result = simulate(build_trace("coding", 40, seed=1), policy, SMALL)
    events = sorted(
        [(r.started_at, r.units) for r in result.records]
        + [(r.finished_at, -r.units) for r in result.records]
    )
    in_use, peak = 0, 0
    for _, delta in events:
        in_use += delta
        peak = max(peak, in_use)
    assert peak <= SMALL.nodes * SMALL.cores_per_node


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trace = ai_coding(CodingConfig(batch=5), seed=3)
    dump(trace, tmp_path / "t.jsonl")
    assert load(tmp_path / "t.jsonl") == trace


@pytest.mark.parametrize("policy", ["elastic", "fixed-dop:16", "kubernetes"])
def test_no_action_beats_its_duration_on_its_largest_allocation(policy: str) -> None:
    """The floor `bench/figures.py` reports: an action's ACT is at least its duration on the
    most units it allows, and it runs exactly its duration on the units it got."""
    trace = {t.trajectory_id: t for t in build_trace("coding", 40, seed=1)}
    result = simulate(list(trace.values()), policy, SMALL)
    for r in result.records:
        tid, _, idx = r.action_id.rpartition("#")
        step = trace[tid].steps[int(idx)]
        assert r.act_s >= step.duration(step.choices[-1]) * (1 - 1e-9)
        if policy != "kubernetes":  # pods share cores (fluid), so no fixed duration there
            assert r.finished_at - r.started_at == pytest.approx(step.duration(r.units))


def test_the_coding_trace_keeps_environments_busy_about_half_of_their_life() -> None:
    """The paper's AI-coding environments are accessed 47% of their lifetime (§1); the
    default generator is calibrated to it, and a trace of only actions is busy all the time."""
    assert 0.42 <= busy_fraction(ai_coding(CodingConfig(batch=512), seed=0)) <= 0.52
    heavy = ai_coding(CodingConfig(batch=64, gap_median_s=8.0, tool_median_s=8.0), seed=0)
    assert busy_fraction(heavy) > 0.8
    assert busy_fraction([]) == 0.0


def replay(result: SimResult, policy: str) -> list[tuple[float, str, int]]:
    """Feed the recorded submits and completions to a bare core as the live shell does: the
    gateway's action, the node's ``Completion``, ``close_env`` at a trajectory's end, then one
    scheduling pass per instant. The policy's hooks (what it learns from completions, its
    per-pool reservations) are reached only through the core, in both runs."""
    trace = {t.trajectory_id: t for t in build_trace("coding", 30, seed=5)}
    core = SchedulerCore(make_policy(policy))
    for n in range(SMALL.nodes):
        core.node_report(sim_node(f"node-{n}", SMALL.cores_per_node, 2), 0.0)
    events: list[tuple[float, int, str]] = []
    for r in result.records:
        events += [(r.submitted_at, 0, r.action_id), (r.finished_at, 1, r.action_id)]
    by_time: dict[float, list[tuple[int, str]]] = {}
    for t, kind, aid in events:
        by_time.setdefault(t, []).append((kind, aid))
    running: dict[str, tuple[StartOnNode, float]] = {}
    decisions: list[tuple[float, str, int]] = []
    for t in sorted(by_time):
        for kind, aid in sorted(by_time[t], key=lambda e: -e[0]):  # completions first
            tid, _, idx = aid.rpartition("#")
            if kind == 0:
                core.enqueue(unified(SimAction(aid, tid, trace[tid].steps[int(idx)], t)), t)
                continue
            if aid not in running:
                return decisions  # the core did not start it: the runs already differ
            start, t0 = running.pop(aid)
            core.complete(completion(start, t0, t), t)
            if int(idx) == len(trace[tid].steps) - 1:
                core.close_env(tid, t)
        for e in core.schedule(t):
            if isinstance(e, StartOnNode):
                running[e.action.spec.action_id] = (e, t)
                decisions.append((t, e.action.spec.action_id, len(e.cores)))
    return decisions


def completion(start: StartOnNode, t0: float, now: float) -> Completion:
    outcome = Outcome(exit_code=0, started_at=t0, finished_at=now)
    return Completion(
        node_id=start.node_id,
        incarnation=start.incarnation,
        action_id=start.action.spec.action_id,
        attempt=start.action.attempt,
        outcome=outcome,
    )


@pytest.mark.parametrize("policy", ["min", "elastic", "fixed-dop:4", "trajectory-static:2"])
def test_replay_through_the_core_makes_the_same_decisions(policy: str) -> None:
    """The simulator drives the live code: the same decisions from the same messages. Elastic
    covers ``Learns`` (tool durations are learned, not hinted), trajectory-static ``PerPool``
    (reservations per node, released by ``close_env``)."""
    trace = build_trace("coding", 30, seed=5)
    result = simulate(trace, policy, SMALL, pods=False)
    assert len(result.records) == sum(len(t.steps) for t in trace), "not every action ended"
    assert replay(result, policy) == result.decisions


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "--batch",
                "8",
                "--nodes",
                "1",
                "--cores",
                "16",
                "--policy",
                "min",
                "--policy",
                "elastic",
                "--json",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.count("mean_act_per_trajectory_s") == 2


GOOD_LINE = (
    '{"trajectory_id":"t","start_s":0,"steps":[{"gap_s":1,"profile":"p","choices":[1,2],'
    '"t_ori_s":3,"parallel_fraction":0.5}]}'
)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("not json", "malformed"),
        ('{"start_s":0,"steps":[]}', "trajectory_id"),
        (GOOD_LINE.replace('"choices":[1,2]', '"choices":[2,1]'), "ascending"),
        (GOOD_LINE.replace('"choices":[1,2]', '"choices":[]'), "ascending"),
        (GOOD_LINE.replace('"t_ori_s":3', '"t_ori_s":-3'), "t_ori_s"),
        (GOOD_LINE.replace('"parallel_fraction":0.5', '"parallel_fraction":2'), "parallel"),
        (GOOD_LINE.replace('"profile":"p"', '"profile":"p","pool":"tpu"'), "pool"),
        (GOOD_LINE.replace('"t_ori_s":3', '"t_ori_s":"x"'), "t_ori_s"),
    ],
)
def test_a_bad_trace_line_is_refused_by_line_and_reason(
    tmp_path: Path, line: str, says: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(GOOD_LINE + "\n\n" + line + "\n")
    with pytest.raises(ValueError, match=rf"t\.jsonl:3: .*{says}"):
        load(path)
    path.write_text(GOOD_LINE + "\n")
    assert len(load(path)) == 1


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--policy", "nope"], "unknown scheduling policy 'nope'"),
        (["--policy", "kubernetes:x"], "bad kubernetes spec"),
        (["--policy", "fixed-dop:0"], "fixed DoP must be"),
        (["--workload", "nope"], "unknown workload"),
        (["--batch", "0"], "must be ≥ 1"),
        (["--trace", "/nonexistent/trace.jsonl"], "No such file"),
    ],
)
def test_cli_refuses_bad_arguments_with_the_reason(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--nodes", "1", "--cores", "8", "--batch", "2", *argv])
    assert exit_info.value.code == 2
    assert says in capsys.readouterr().err
