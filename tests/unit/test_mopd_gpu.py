"""Figure 8(b)'s MOPD simulation: its baselines are the paper's, and the pooled runs through
the scheduler core keep the GPU invariants."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from services.scheduler.core.effects import StartOnNode
from services.scheduler.sim import mopd_gpu as m
from services.scheduler.sim import mopd_workload as w

SMALL = m.Config(batch=24, rollout_s=20.0, gpus=12, restore_gb_per_s=10.0)


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


@pytest.mark.parametrize("order", ["fcfs", "hrrs"])
def test_pooled_never_two_calls_on_one_gpu_and_serves_all(
    order: str, monkeypatch: pytest.MonkeyPatch
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
    out = m.run(SMALL, "elastic", order)
    assert out.served == out.calls
    assert math.isfinite(out.mean_act())
    assert 0.0 < out.restore_share() < 1.0
    assert not held


@pytest.mark.parametrize("order", ["fcfs", "hrrs"])
def test_a_simulated_gpu_holds_weights_in_its_weights_share_only(
    order: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``WEIGHTS_SHARE`` of a GPU holds weights, the rest the running prefill's activations and
    KV: the simulated agents cache copies within ``WEIGHTS_MB`` and report that as the GPU's
    memory. Four GPUs and ten teachers: copies are evicted to make room."""
    assert m.WEIGHTS_MB == m.GPU_MEMORY_MB * w.WEIGHTS_SHARE
    cfg = m.Config(batch=60, rollout_s=20.0, gpus=4, restore_gb_per_s=10.0, warmup=False)
    peak = 0
    restore = m._Node.restore

    def spy(self: m._Node, variant: tuple[str, int], gpus: tuple[int, ...], mb: int) -> bool:
        nonlocal peak
        cold = restore(self, variant, gpus, mb)
        peak = max(peak, *(sum(held.values()) for held in self.lru))
        return cold

    monkeypatch.setattr(m._Node, "restore", spy)
    pooled = m.Pooled(cfg, "elastic", order)
    out = pooled.run(m.workload(cfg))
    assert out.served == out.calls
    assert m.WEIGHTS_MB - 4096 < peak <= m.WEIGHTS_MB  # full at times, never past its share
    report = pooled._report(pooled.nodes["g0"])
    assert {d.memory_mb for d in report.inventory.gpus} == {m.WEIGHTS_MB}


@pytest.mark.parametrize("policy", ["elastic", "maas"])
def test_a_call_no_node_can_hold_makes_the_act_infinite(policy: str) -> None:
    """One GPU cannot hold a 60B teacher (it needs two): its calls are never served."""
    cfg = m.Config(batch=40, gpus=1, sizes_b=(60.0,) * 10, restore_gb_per_s=10.0)
    assert all(t.dops[0] == 2 for t in m.teachers(cfg))
    out = m.run(cfg, policy)
    assert out.served < out.calls
    assert out.mean_act() == math.inf


def test_one_call_per_trajectory_within_its_task_window() -> None:
    """§6.1: a trajectory's log-probabilities against its task's teacher, once; each task's
    trajectories finish within ``task_window`` of the rollout."""
    cfg = m.Config(batch=500, rollout_s=60.0)
    calls = m.workload(cfg)
    assert sorted(c.trajectory for c in calls) == list(range(cfg.batch))
    for t in m.teachers(cfg):
        at = [c.at for c in calls if c.teacher == t]
        assert min(at) >= 0.0
        assert max(at) <= cfg.rollout_s
        assert max(at) - min(at) <= cfg.task_window * cfg.rollout_s


def test_a_call_on_one_gpu_is_its_prefill_compute() -> None:
    cfg = m.Config(tokens=8192, gpu_tflops=400.0)
    t = w.teacher("x", 32.8, cfg)
    assert t.t1_s == pytest.approx(2 * 32.8e9 * 8192 / 400e12)
    assert t.dops == (1, 2, 4, 8)  # 61 GiB fit in 80% of an 80 GB GPU
    assert w.teacher("y", 60.0, cfg).dops == (2, 4, 8)  # 112 GiB: two GPUs at least


def test_calibration_gives_the_papers_sglang_act_at_2048() -> None:
    """§6.3 and Table 1: SGLang's ACT at batch 2048 is 18.1 x Tangram's 0.903 s."""
    cfg = m.calibrated(m.Config())
    assert cfg.rollout_s == pytest.approx(m.Config().rollout_s, abs=0.1)
    act = m.run(replace(cfg, batch=w.SGLANG_BATCH), "dedicated").mean_act()
    assert act == pytest.approx(w.SGLANG_ACT_S, rel=0.01)
    assert w.SGLANG_ACT_S == pytest.approx(18.1 * (0.621 + 0.081 + 0.201))


def test_the_measured_step_starts_with_what_the_step_before_left_resident() -> None:
    """§5.3: a restored service stays cached until evicted, and the paper measures while
    training proceeds: with the step before served first (``warmup``), a teacher it used is
    no restore in the measured step; from empty GPUs it is one. Only the measured step counts."""
    cfg = m.Config(batch=1, gpus=8, restore_gb_per_s=10.0)
    t = m.TEACHERS[0]
    call = [m.Call("c0", 0, t, 1.0)]
    cold = m.Pooled(cfg, "elastic").run(call)
    warm = m.Pooled(cfg, "elastic").run(call, before=[m.Call("c0", 0, t, 0.5)])
    assert cold.restores == 1
    assert warm.restores == 0
    assert warm.served == warm.calls == 1
    assert warm.act_s == pytest.approx({0: t.duration(8, cfg.parallel)})


def test_the_policy_sees_a_restoring_chunk_busy_until_its_restore_and_call_end() -> None:
    """A call dispatched cold holds its chunk for the restore and then its execution: the
    elastic policy's view of that chunk ends there (the core's prediction at dispatch), not
    after the execution alone."""
    cfg = m.Config(batch=1, gpus=8, restore_gb_per_s=10.0)
    pooled = m.Pooled(cfg, "elastic")
    t = m.TEACHERS[6]
    pooled.core.enqueue(m._unified(m.Call("c0", 0, t, 0.0), cfg.parallel), 0.0)
    (start,) = [e for e in pooled.core.schedule(0.0) if isinstance(e, StartOnNode)]
    dop = len(start.gpus)
    (view,) = pooled.core.gpu._running_views(pooled.core.nodes[start.node_id])
    restore = t.footprint_mb(dop) * 2**20 / 1e9 / cfg.restore_gb_per_s / dop  # a slice a link
    assert view.expected_end == pytest.approx(restore + t.duration(dop, cfg.parallel))


@pytest.mark.parametrize(("per_link", "links"), [(1, 8), (2, 4), (8, 1)])
def test_a_simulated_restore_is_the_cores_price_for_the_chunks_links(
    per_link: int, links: int
) -> None:
    """The simulated nodes report a host link per ``gpus_per_link`` GPUs; a restore onto 8 GPUs
    loads 8 slices over min(8, links) links, priced by the core's one function."""
    cfg = m.Config(batch=1, gpus=8, restore_gb_per_s=10.0, gpus_per_link=per_link)
    pooled = m.Pooled(cfg, "elastic")
    t = m.TEACHERS[6]
    assert pooled.restore_s(t, tuple(range(8))) == pytest.approx(
        t.footprint_mb(8) * 2**20 / 1e9 / (links * cfg.restore_gb_per_s)  # MiB at GB/s
    )
    facts = pooled.core.nodes["g0"].gpu
    assert facts is not None
    assert len(set(facts.links)) == links


def test_the_ideal_pool_runs_every_call_at_dop_1_and_never_before_it_arrives() -> None:
    from services.scheduler.sim.mopd_baselines import run_ideal

    cfg = replace(w.Config(), batch=256, gpus=4)
    calls = w.workload(cfg)
    fcfs, sjf = run_ideal(cfg, calls), run_ideal(cfg, calls, shortest_first=True)
    for out in (fcfs, sjf):
        assert out.served == len(calls)
        assert out.restores == 0
        assert set(out.dops) == {1}
        assert all(out.act_s[c.trajectory] >= c.teacher.t1_s - 1e-9 for c in calls)
    assert sjf.mean_act() < fcfs.mean_act()  # loaded: shortest first lowers the mean
    roomy = replace(cfg, gpus=len(calls))  # a GPU each: no call waits
    assert run_ideal(roomy, calls).mean_act() == pytest.approx(
        sum(c.teacher.t1_s for c in calls) / len(calls)
    )
