"""Figure 8(b)'s MOPD simulation: its baselines are the paper's, and the pooled runs through
the scheduler core keep the GPU invariants."""

from __future__ import annotations

import math

import pytest

from services.scheduler.core.effects import StartOnNode
from services.scheduler.sim import mopd_gpu as m

SMALL = m.Config(batch=24, bursts=2, burst_period_s=20.0, gpus=12, restore_gb_per_s=10.0)


def test_nodes_are_eight_gpus_and_the_rest() -> None:
    assert m.node_sizes(40) == [8] * 5
    assert m.node_sizes(12) == [8, 4]
    assert m.node_sizes(3) == [3]


def test_dedicated_is_one_tp4_server_per_service() -> None:
    """§6.1: four GPUs with TP per model, 10 services on 40 GPUs; one server per service
    serves its calls one after another in arrival order."""
    assert m.dedicated_gpus(m.Config()) == 40
    calls = m.workload(SMALL)
    out = m.run_dedicated(SMALL, calls)
    assert out.served == len(calls)
    t = m.TEACHERS[0]
    two = [m.Call("a", 0, t, 0.0), m.Call("b", 1, t, 0.0)]
    done = m.run_dedicated(SMALL, two)
    one = t.duration(4, SMALL.parallel)
    assert done.act_s == pytest.approx({0: one, 1: 2 * one})


def test_every_teacher_offers_the_levels_its_memory_allows() -> None:
    for t in m.TEACHERS:
        smallest = 1 if t.weights_gb * 1024 <= m.GPU_MEMORY_MB * 0.8 else 2
        assert t.dops == tuple(d for d in (1, 2, 4, 8) if d >= smallest)


@pytest.mark.parametrize("policy", ["elastic", "maas"])
def test_pooled_never_two_calls_on_one_gpu_and_serves_all(
    policy: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: dict[tuple[str, int], str] = {}
    start, complete = m.Pooled._start, m.Pooled._complete

    def on_start(self: m.Pooled, e: StartOnNode, now: float) -> tuple[float, float]:
        for g in e.gpus:
            assert (e.node_id, g) not in held
            held[e.node_id, g] = e.action.spec.action_id
        return start(self, e, now)

    def on_complete(self: m.Pooled, e: StartOnNode, now: float, x: float, r: float) -> None:
        for g in e.gpus:
            assert held.pop((e.node_id, g)) == e.action.spec.action_id
        complete(self, e, now, x, r)

    monkeypatch.setattr(m.Pooled, "_start", on_start)
    monkeypatch.setattr(m.Pooled, "_complete", on_complete)
    out = m.run(SMALL, policy)
    assert out.served == out.calls
    assert math.isfinite(out.mean_act())
    assert 0.0 < out.restore_share() < 1.0
    assert not held


def test_a_call_no_node_can_hold_makes_the_act_infinite() -> None:
    """One GPU cannot hold a 70 GB teacher (it needs two): its calls are never served."""
    cfg = m.Config(batch=40, bursts=1, gpus=1, restore_gb_per_s=10.0)
    out = m.run(cfg, "maas")
    assert any(c.teacher.dops[0] > 1 for c in m.workload(cfg))
    assert out.served < out.calls
    assert out.mean_act() == math.inf
