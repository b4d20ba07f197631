"""The simulator: deterministic per seed, and the same decisions as the live core on replay."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.scheduler.policy import make_policy
from services.scheduler.simpools import CoreEngine, SimAction
from services.scheduler.simulator import Cluster, SimResult, build_trace, main, simulate
from services.scheduler.traces import CodingConfig, ai_coding, dump, load

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
    events = sorted([(r.started_at, r.units) for r in result.records]
                    + [(r.finished_at, -r.units) for r in result.records])  # fmt: skip
    in_use, peak = 0, 0
    for _, delta in events:
        in_use += delta
        peak = max(peak, in_use)
    assert peak <= SMALL.nodes * SMALL.cores_per_node


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trace = ai_coding(CodingConfig(batch=5), seed=3)
    dump(trace, tmp_path / "t.jsonl")
    assert load(tmp_path / "t.jsonl") == trace


def replay(result: SimResult, policy: str) -> list[tuple[float, str, int]]:
    """Feed the recorded submits and completions to a fresh core, as the live shell does."""
    trace = {t.trajectory_id: t for t in build_trace("coding", 30, seed=5)}
    events: list[tuple[float, int, str]] = []
    for r in result.records:
        events += [(r.submitted_at, 0, r.action_id), (r.finished_at, 1, r.action_id)]
    engine = CoreEngine(make_policy(policy), SMALL.nodes, SMALL.cores_per_node)
    decisions: list[tuple[float, str, int]] = []
    by_time: dict[float, list[tuple[int, str]]] = {}
    for t, kind, aid in events:
        by_time.setdefault(t, []).append((kind, aid))
    for t in sorted(by_time):
        for kind, aid in sorted(by_time[t], key=lambda e: -e[0]):  # completions first
            tid, _, idx = aid.rpartition("#")
            if kind == 0:
                engine.submit(SimAction(aid, tid, trace[tid].steps[int(idx)], t), t)
            else:
                engine.complete(aid, t)
                if int(idx) == len(trace[tid].steps) - 1:
                    engine.close(tid, t)
        decisions += [(t, aid, units) for aid, units in engine.schedule(t)]
    return decisions


@pytest.mark.parametrize("policy", ["min", "elastic", "fixed-dop:4"])
def test_replay_through_the_core_makes_the_same_decisions(policy: str) -> None:
    result = simulate(build_trace("coding", 30, seed=5), policy, SMALL)
    assert replay(result, policy) == result.decisions


def test_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--batch", "8", "--nodes", "1", "--cores", "16", "--policy", "min",
                 "--policy", "elastic", "--json"]) == 0  # fmt: skip
    assert capsys.readouterr().out.count("mean_act_per_trajectory_s") == 2
