"""The pure parts of tangram.metrics: ACT split, trace exemplars, label values, families."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from services.quota_manager.http import Upstream
from services.quota_manager.service import HttpExecutor
from tangram import metrics
from tangram.contract import (
    ActionResult,
    Dispatch,
    ExecAction,
    HttpAction,
    QuotaSpec,
    QuotaState,
    Timings,
    UnifiedAction,
)
from tangram.contract.client import ActionSpec
from tests.ratelimited_server import RateLimitedServer, ServerConfig

seconds = st.floats(min_value=-1.0, max_value=1e4, allow_nan=False)


@given(queue=seconds, execution=seconds, total=st.floats(min_value=0, max_value=1e4))
def test_act_parts_are_non_negative_and_sum_to_the_total(
    queue: float, execution: float, total: float
):
    parts = metrics.act_parts(queue, execution, total)
    assert all(p >= 0 for p in parts)
    assert sum(parts) == pytest.approx(total, abs=1e-6)


def test_act_parts_keep_what_the_node_reported_when_it_fits():
    assert metrics.act_parts(1.0, 2.0, 3.5) == pytest.approx((1.0, 2.0, 0.5))


@pytest.mark.parametrize(
    ("traceparent", "trace_id"),
    [
        (
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "0af7651916cd43dd8448eb211c80319c",
        ),
        ("", None),
        ("garbage", None),
        ("00-short-b7ad6b7169203331-01", None),
        ("00-00000000000000000000000000000000-b7ad6b7169203331-01", None),
    ],
)
def test_trace_exemplar(traceparent: str, trace_id: str | None):
    got = metrics.trace_exemplar(traceparent)
    assert (got["trace_id"] if got else None) == trace_id


@pytest.mark.parametrize(
    ("status", "label"),
    [(200, "2xx"), (429, "4xx"), (503, "5xx"), (None, "failed"), (42, "failed")],
)
def test_status_class(status: int | None, label: str):
    assert metrics.status_class(status) == label


def _ended(uid: str, traceparent: str, started: float | None) -> tuple[UnifiedAction, ActionResult]:
    spec = ActionSpec(action_id=uid, job_id=uid, trajectory_id=uid, action=ExecAction(command="x"))
    action = UnifiedAction(
        spec=spec,
        demands=(),
        key_resource="cpu",
        env_memory_mb=0,
        submitted_at=100.0,
        traceparent=traceparent,
    )
    timings = Timings(
        submitted_at=100.0,
        started_at=started,
        finished_at=103.0,
        queue_s=1.0,
        exec_s=1.5,
        overhead_s=1.5,
    )
    result = ActionResult(action_id=uid, status="succeeded", timings=timings)
    return action, result


def test_an_ended_action_is_counted_and_its_act_split_with_its_trace_id():
    trace_id = uuid.uuid4().hex
    before = metrics.REGISTRY.get_sample_value(
        "tangram_actions_total", {"kind": "exec", "status": "succeeded"}
    )
    metrics.action_ended(*_ended("a1", f"00-{trace_id}-b7ad6b7169203331-01", 101.0))
    after = metrics.REGISTRY.get_sample_value(
        "tangram_actions_total", {"kind": "exec", "status": "succeeded"}
    )
    assert after == (before or 0) + 1
    om = generate_openmetrics(metrics.REGISTRY).decode()
    tagged = [line for line in om.splitlines() if f'# {{trace_id="{trace_id}"}}' in line]
    assert any(line.startswith("tangram_act_seconds_bucket") for line in tagged)
    assert any('part="overhead"' in line and " 0.5" in line for line in tagged)  # 3 - 1 - 1.5
    assert trace_id not in generate_latest(metrics.REGISTRY).decode()


def test_an_action_that_never_started_is_counted_without_act():
    count = {"kind": "exec"}
    before = metrics.REGISTRY.get_sample_value("tangram_act_seconds_count", count) or 0
    metrics.action_ended(*_ended("a2", "", None))
    assert metrics.REGISTRY.get_sample_value("tangram_act_seconds_count", count) == before


def test_quota_calls_count_429s_and_tokens():
    q = f"q-{uuid.uuid4().hex[:6]}"
    metrics.quota_call(q, 429, None)
    metrics.quota_call(q, 200, 120)
    metrics.quota_call(q, None, None)
    value = metrics.REGISTRY.get_sample_value
    assert value("tangram_quota_throttled_total", {"quota": q}) == 1
    assert value("tangram_quota_tokens_used_total", {"quota": q}) == 120
    assert value("tangram_quota_calls_total", {"quota": q, "status": "failed"}) == 1


def test_gpu_passes_count_evictions_and_restores():
    node = f"gpu-{uuid.uuid4().hex[:6]}"
    metrics.gpu_pass(node, "m", evicted=2, restored=True, seconds=0.01)
    metrics.gpu_pass(node, "m", evicted=0, restored=None, seconds=0.0)  # resident: no restore
    metrics.gpu_pass(node, "m", evicted=0, restored=False, seconds=0.0)
    value = metrics.REGISTRY.get_sample_value
    assert value("tangram_gpu_evictions_total", {"node": node}) == 2
    assert value("tangram_gpu_restores_total", {"node": node, "service": "m", "outcome": "ok"}) == 1
    labels = {"node": node, "service": "m", "outcome": "failed"}
    assert value("tangram_gpu_restores_total", labels) == 1
    assert value("tangram_gpu_restore_seconds_count", {"node": node}) == 1


def test_health_transitions_are_counted_by_role_and_states():
    metrics.health_transition("cpu_manager", "healthy", "suspect")
    labels = {"role": "cpu_manager", "from": "healthy", "to": "suspect"}
    assert (metrics.REGISTRY.get_sample_value("tangram_health_transitions_total", labels) or 0) >= 1


def test_state_families():
    units = metrics.unit_families([metrics.Units("n0", "core", 8, 3)], "allocated")
    assert [f.name for f in units] == ["tangram_units", "tangram_units_allocated"]
    assert units[1].samples[0].value == 3
    queues = metrics.queue_families({"node": 4, "quota": 1}, {"node": 2, "quota": 0})
    assert {s.labels["queue"]: s.value for s in queues[0].samples} == {"node": 4, "quota": 1}
    spec = QuotaSpec(name="search", concurrency=4, hosts=("example.com",))
    fams = metrics.quota_families([QuotaState(spec=spec, in_use=2, queued=5)])
    assert [(f.name, len(f.samples)) for f in fams] == [
        ("tangram_quota_in_use", 1),
        ("tangram_quota_queued", 1),
        ("tangram_quota_learned_rate", 0),  # nothing learned yet
    ]


async def test_the_quota_executor_counts_its_calls_and_429s():
    """The wiring in the quota node's executor: a 429 from a real rate-limited upstream."""
    quota = f"q{uuid.uuid4().hex[:6]}"
    executor = HttpExecutor(Upstream())
    await executor.start()
    try:
        async with RateLimitedServer(ServerConfig(per_second=1, concurrency=4)) as server:
            spec = QuotaSpec(quota, concurrency=4, hosts=(server.url.removeprefix("http://"),))
            for k in range(2):
                action = HttpAction(method="GET", url=f"{server.url}/call", quota=quota)
                aspec = ActionSpec(
                    action_id=f"{quota}-{k}", job_id="j", trajectory_id="", action=action
                )
                ua = UnifiedAction(
                    spec=aspec,
                    demands=(),
                    key_resource=f"quota:{quota}",
                    env_memory_mb=0,
                    submitted_at=0.0,
                )
                await executor.run(Dispatch(action=ua, quota=spec))
    finally:
        await executor.close()
    value = metrics.REGISTRY.get_sample_value
    assert value("tangram_quota_calls_total", {"quota": quota, "status": "2xx"}) == 1
    assert value("tangram_quota_throttled_total", {"quota": quota}) == 1
