"""The Kubernetes baseline of the simulator: pods by request, CFS sharing within a node."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.scheduler.sim.engines import SimAction
from services.scheduler.sim.kube import KubeConfig, KubeEngine, water_fill
from services.scheduler.sim.simulator import Cluster, build_trace, simulate
from services.scheduler.sim.traces import Step, Trajectory


@given(st.lists(st.floats(0.0, 64.0), max_size=40), st.floats(0.5, 256.0))
def test_water_fill_is_max_min_fair(demands: list[float], capacity: float) -> None:
    shares = water_fill(demands, capacity)
    assert sum(shares) <= capacity + 1e-6
    assert all(0.0 <= s <= d + 1e-9 for s, d in zip(shares, demands, strict=True))
    short = [s for s, d in zip(shares, demands, strict=True) if s < d - 1e-9]
    if short:  # whoever gets less than it asks gets the largest share: nobody is favoured
        assert min(short) >= max(shares) - 1e-6
        assert sum(shares) == pytest.approx(capacity)


def _trajectory(tid: str, *steps: Step, start: float = 0.0) -> Trajectory:
    return Trajectory(tid, start, steps)


def _reward(t_ori: float, p: float = 1.0, gap: float = 0.0) -> Step:
    return Step(gap, "reward", tuple(range(1, 33)), t_ori, p, hinted=True)


def test_alone_an_action_bursts_to_the_pod_limit() -> None:
    trace = [_trajectory("a", _reward(40.0))]
    result = simulate(trace, "kubernetes", Cluster(nodes=1, cores_per_node=8))
    (rec,) = result.records
    assert rec.units == 4
    assert rec.finished_at == pytest.approx(10.0)  # 40 s of perfectly parallel work on 4 cores


def test_actions_on_a_full_node_share_its_cores() -> None:
    trace = [_trajectory(f"t{i}", _reward(40.0)) for i in range(2)]
    result = simulate(trace, "kubernetes", Cluster(nodes=1, cores_per_node=4))
    assert [r.finished_at for r in result.records] == pytest.approx([20.0, 20.0])


def test_shares_grow_when_a_neighbour_finishes() -> None:
    # 4 cores, two 4-thread actions: 2 cores each until the short one ends at 10 s (20 s of
    # work at 2 cores), then the long one runs alone on 4: 60 - 20 = 40 s of work left -> 10 s.
    trace = [_trajectory("short", _reward(20.0)), _trajectory("long", _reward(60.0))]
    result = simulate(trace, "kubernetes", Cluster(nodes=1, cores_per_node=4))
    ends = {r.trajectory_id: r.finished_at for r in result.records}
    assert ends == pytest.approx({"short": 10.0, "long": 20.0})


def test_pods_wait_pending_until_a_trajectory_ends() -> None:
    # one core, pods request 0.5: the third trajectory's pod binds when the first one ends
    trace = [_trajectory(f"t{i}", Step(0.0, "tool", (1,), 10.0)) for i in range(3)]
    result = simulate(trace, "kubernetes", Cluster(nodes=1, cores_per_node=1))
    starts = sorted(r.started_at for r in result.records)
    assert starts[:2] == [0.0, 0.0]
    assert starts[2] == pytest.approx(20.0)  # two single threads on one core: 20 s each


def test_pod_start_latency_delays_the_first_action_only() -> None:
    cfg = KubeConfig(0.5, 4.0, pod_start_s=3.0)
    assert cfg.pod_start_s == 3.0
    trace = [_trajectory("a", Step(0.0, "tool", (1,), 1.0), Step(1.0, "tool", (1,), 1.0))]
    engine = KubeEngine(cfg, 1, 4)
    engine.submit(SimAction("a#0", "a", trace[0].steps[0], 0.0), 0.0)
    assert engine.schedule(0.0) == []
    assert engine.wake_at() == 3.0
    assert engine.schedule(3.0) == [("a#0", 1)]


def test_kubernetes_runs_are_deterministic_and_complete() -> None:
    trace = build_trace("coding", 30, seed=2)
    a = simulate(trace, "kubernetes:1:2", Cluster(nodes=2, cores_per_node=16))
    b = simulate(trace, "kubernetes:1:2", Cluster(nodes=2, cores_per_node=16))
    assert a.records == b.records
    assert len(a.records) == sum(len(t.steps) for t in trace)
    assert max(r.units for r in a.records) <= 2


@pytest.mark.parametrize("spec", ["kubernetes:0:4", "kubernetes:4:1", "kubernetes:x"])
def test_bad_kubernetes_specs_are_refused(spec: str) -> None:
    with pytest.raises(ValueError, match="kubernetes"):
        KubeConfig.parse(spec)
