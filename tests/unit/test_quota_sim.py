"""The DeepSearch comparison: Tangram quotas hold every provider's limit and lose no
trajectory; per-process limiters and blind retries see 429s and fail trajectories."""

from __future__ import annotations

from services.scheduler.sim.deepsearch import Provider, Workload, compare


def test_provider_counts_accepted_calls_in_a_sliding_window() -> None:
    provider = Provider(limit=2)
    assert [provider.call(t)[0] for t in (0.0, 0.1, 0.5)] == [200, 200, 429]
    assert provider.call(0.5)[1] == 0.5
    assert provider.call(1.0)[0] == 200


def test_policies_compared_on_one_seeded_workload() -> None:
    workload = Workload(trajectories=90, seed=7)
    reports = {r.policy: r for r in compare(workload)}
    tangram, per_process, retry = reports["tangram"], reports["per_process"], reports["retry"]
    assert tangram.throttled == 0
    assert tangram.failed == 0
    assert tangram.completed == 90
    assert per_process.throttled > 0
    assert retry.throttled > 0
    assert per_process.failed > 0
    assert retry.failed > 0
    assert compare(workload) == list(reports.values()), "seeded: the same run twice"
