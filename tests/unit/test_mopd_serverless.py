"""The ServerlessLLM baseline of Figure 8(b): its released controller's rules, one at a time."""

from __future__ import annotations

import itertools

import pytest

from services.scheduler.sim import mopd_baselines as b
from services.scheduler.sim import mopd_workload as w

CFG = w.Config(gpus=8, restore_gb_per_s=10.0)
T = w.teachers(CFG)[0]
LOAD_S = T.footprint_mb(1) * 2**20 / 1e9 / CFG.restore_gb_per_s  # MiB at decimal GB/s


def calls(*at: float) -> list[w.Call]:
    return [w.Call(f"c{i}", i, T, a) for i, a in enumerate(at)]


def test_a_cold_call_waits_for_the_scaler_the_load_and_the_balancers_poll() -> None:
    """At 0.5 s: the next tick (1 s) starts an instance, which loads; the load balancer took
    the call at once and looks for a ready instance every second from 1.5 s."""
    out = b.run_maas(CFG, calls(0.5))
    ready = 1.0 + LOAD_S
    polled = 1.5 + max(0, int(-(-(ready - 1.5) // 1.0)))  # the first poll at or after ready
    assert out.act_s[0] == pytest.approx(polled + T.duration(1, CFG.parallel) - 0.5)
    assert out.restores == 1


def test_the_load_balancer_dispatches_one_call_a_second() -> None:
    """Ten calls at once: up to ten instances, yet one dispatch per tick per model."""
    out = b.run_maas(CFG, calls(*[0.0] * 10))
    done = sorted(out.act_s.values())  # every call arrived at 0
    assert all(later - earlier >= 1.0 - 1e-9 for earlier, later in itertools.pairwise(done))


def test_an_idle_instance_stops_so_the_next_burst_reloads() -> None:
    """Keep-alive 0: the instance is stopped once idle; a later call starts a new one."""
    out = b.run_maas(CFG, calls(0.0, 100.0))
    assert out.restores == 2
    assert out.act_s[1] == pytest.approx(out.act_s[0])


def test_instances_never_take_more_gpus_than_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = w.Config(batch=200, gpus=12, rollout_s=5.0, restore_gb_per_s=10.0)
    seen: list[int] = []
    load = b._Serverless._load

    def spy(self: b._Serverless, now: float) -> None:
        load(self, now)
        seen.extend(self.free)

    monkeypatch.setattr(b._Serverless, "_load", spy)
    out = b.run_maas(cfg, w.workload(cfg))
    assert out.served == out.calls
    assert seen
    assert min(seen) >= 0


def test_instances_of_a_fixed_size() -> None:
    """``num_gpus`` is the instance's fixed DoP: its calls run at that DoP."""
    cfg = w.Config(gpus=8, restore_gb_per_s=10.0, maas=w.ServerlessConfig(num_gpus=4))
    out = b.run_maas(cfg, calls(0.5))
    assert out.exec_s - out.restore_s == pytest.approx(T.duration(4, cfg.parallel))
