"""Every Prometheus metric of the mesh: names, labels, buckets and help, here and nowhere else.

Two kinds. *Events* (counters, histograms) are recorded where the fact already exists, by the
small functions below (the scheduler's terminal results, the GPU executor's restores, the
quota executor's answers), each a few dictionary lookups and one ``observe``. *State* (queue
length, units allocated and busy, quota use) is never kept up to date per action: a service
builds those gauges from its own books when scraped (the ``*_families`` builders below),
on its event loop, so they read the books without a lock.

Names start ``tangram_``. ACT (action completion time, submit to result) is split without
overlap: ``queue`` (submit to start) + ``execution`` (start to end on the node) + ``overhead``
(the rest: dispatch, reporting, recording) = the total in ``tangram_act_seconds``; queue wait
is ``tangram_act_part_seconds{part="queue"}``. Histograms carry the action's trace id as an
exemplar where it has one (shown in the OpenMetrics format).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from tangram.contract import ActionResult, QuotaState, UnifiedAction, kind_of

# One registry per process: the process and platform facts, and the families below. (Not the
# library's default registry, which a test process shares with whatever else it imports.)
REGISTRY = CollectorRegistry()
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# From the 5 ms of an action's overhead to the 10-minute default timeout.
ACT_BUCKETS = (
    *(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, float("inf")),
)
PARTS = ("queue", "execution", "overhead")

ACTIONS = Counter(
    "tangram_actions",
    "Actions ended, by kind and status (counted once, at the scheduler)",
    ["kind", "status"],
    registry=REGISTRY,
)
ACT = Histogram(
    "tangram_act_seconds",
    "Action completion time, submit to result, of ended actions that ran",
    ["kind"],
    buckets=ACT_BUCKETS,
    registry=REGISTRY,
)
ACT_PART = Histogram(
    "tangram_act_part_seconds",
    "ACT split without overlap: queue + execution + overhead = tangram_act_seconds",
    ["kind", "part"],
    buckets=ACT_BUCKETS,
    registry=REGISTRY,
)
GPU_RESTORES = Counter(
    "tangram_gpu_restores",
    "Service copies restored from the host tier onto GPUs, by outcome",
    ["node", "service", "outcome"],
    registry=REGISTRY,
)
GPU_RESTORE_SECONDS = Histogram(
    "tangram_gpu_restore_seconds",
    "Time to restore a service's copy onto its GPUs",
    ["node"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, float("inf")),
    registry=REGISTRY,
)
GPU_EVICTIONS = Counter(
    "tangram_gpu_evictions",
    "Service copies evicted from GPUs to make room (least recently used first)",
    ["node"],
    registry=REGISTRY,
)
QUOTA_CALLS = Counter(
    "tangram_quota_calls",
    "HTTP calls made under a quota, by the upstream's status class (or 'failed')",
    ["quota", "status"],
    registry=REGISTRY,
)
QUOTA_THROTTLED = Counter(
    "tangram_quota_throttled",
    "HTTP 429 (too many requests) answers received under a quota",
    ["quota"],
    registry=REGISTRY,
)
QUOTA_TOKENS = Counter(
    "tangram_quota_tokens_used",
    "Tokens the upstream said its answers spent (usage.total_tokens), by quota",
    ["quota"],
    registry=REGISTRY,
)
HEALTH_TRANSITIONS = Counter(
    "tangram_health_transitions",
    "Health state changes of services and agents, by role",
    ["role", "from", "to"],
    registry=REGISTRY,
)
LOOP_LAG = Gauge(
    "tangram_event_loop_lag_seconds",
    "How late the event loop last ran a timer it was given (measured by the ops server)",
    registry=REGISTRY,
)


# --------------------------------------------------------------------------- events


def action_ended(action: UnifiedAction, result: ActionResult) -> None:
    """Count a terminal result; an action that ran also feeds the ACT histograms."""
    kind = kind_of(action.spec.action)
    _counted(kind, result.status).inc()
    t = result.timings
    if t is None or t.started_at is None:
        return  # never started (cancelled or failed in the queue): no ACT to split
    exemplar = trace_exemplar(action.traceparent)
    total = max(0.0, t.overhead_s + t.exec_s)
    act, parts = _act(kind)
    act.observe(total, exemplar)
    for child, seconds in zip(parts, act_parts(t.queue_s, t.exec_s, total), strict=True):
        child.observe(seconds, exemplar)


# The labelled children of the per-action metrics, looked up once per label values: a
# ``labels()`` call takes a lock and checks its arguments (1-2 us each, five per action).
_ACTIONS_BY: dict[tuple[str, str], Counter] = {}
_ACT_BY: dict[str, tuple[Histogram, tuple[Histogram, ...]]] = {}


def _counted(kind: str, status: str) -> Counter:
    child = _ACTIONS_BY.get((kind, status))
    if child is None:
        child = _ACTIONS_BY[kind, status] = ACTIONS.labels(kind, status)
    return child


def _act(kind: str) -> tuple[Histogram, tuple[Histogram, ...]]:
    found = _ACT_BY.get(kind)
    if found is None:
        parts = tuple(ACT_PART.labels(kind, part) for part in PARTS)
        found = _ACT_BY[kind] = (ACT.labels(kind), parts)
    return found


def act_parts(queue_s: float, exec_s: float, total_s: float) -> tuple[float, float, float]:
    """(queue, execution, overhead): non-negative, summing to ``total_s`` (what the node
    reported may overlap the scheduler's clock by a little; the overhead absorbs it)."""
    queue = min(max(0.0, queue_s), total_s)
    execution = min(max(0.0, exec_s), total_s - queue)
    return queue, execution, total_s - queue - execution


def trace_exemplar(traceparent: str) -> dict[str, str] | None:
    """The exemplar labels naming a W3C ``traceparent``'s trace (None: no valid trace id)."""
    parts = traceparent.split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or parts[1] == "0" * 32:
        return None
    return {"trace_id": parts[1]}


def gpu_pass(node: str, service: str, evicted: int, restored: bool | None, seconds: float) -> None:
    """A GPU pass: ``evicted`` copies dropped to make room, then a restore (``restored``: it
    worked; None: the copy was resident, nothing restored)."""
    if evicted:
        GPU_EVICTIONS.labels(node).inc(evicted)
    if restored is not None:
        GPU_RESTORES.labels(node, service, "ok" if restored else "failed").inc()
        if restored:
            GPU_RESTORE_SECONDS.labels(node).observe(seconds)


def quota_call(quota: str, http_status: int | None, tokens_used: int | None) -> None:
    """An HTTP call's answer (``http_status`` None: no answer, the call failed)."""
    QUOTA_CALLS.labels(quota, status_class(http_status)).inc()
    if http_status == 429:
        QUOTA_THROTTLED.labels(quota).inc()
    if tokens_used:
        QUOTA_TOKENS.labels(quota).inc(tokens_used)


def status_class(http_status: int | None) -> str:
    """``2xx`` .. ``5xx`` (few label values), or ``failed`` for no answer."""
    if http_status is None or not 100 <= http_status <= 599:
        return "failed"
    return f"{http_status // 100}xx"


def health_transition(role: str, was: str, now: str) -> None:
    """A service or agent of ``role`` went from health state ``was`` to ``now``."""
    HEALTH_TRANSITIONS.labels(role, was, now).inc()


# --------------------------------------------------------------------------- state


class Units(NamedTuple):
    """One node's units of one kind (``core`` or ``gpu``): how many, and how many in use."""

    node: str
    unit: str
    total: int
    used: int


def queue_families(queued: dict[str, int], running: dict[str, int]) -> list[Metric]:
    """Actions waiting and running, by queue (``node``: cores and GPUs; ``quota``: HTTP)."""
    q = GaugeMetricFamily("tangram_queue_length", "Actions waiting to be placed", labels=["queue"])
    r = GaugeMetricFamily("tangram_running_actions", "Actions granted, not ended", labels=["queue"])
    for name, n in queued.items():
        q.add_metric([name], n)
    for name, n in running.items():
        r.add_metric([name], n)
    return [q, r]


def unit_families(units: Iterable[Units], used: str) -> list[Metric]:
    """Units per node and how many are in use: ``used`` is ``allocated`` (the scheduler's
    books: granted) or ``busy`` (an agent's: held by actions it runs)."""
    total = GaugeMetricFamily("tangram_units", "Units a node offers", labels=["node", "unit"])
    in_use = GaugeMetricFamily(
        f"tangram_units_{used}", f"Units {used} on a node", labels=["node", "unit"]
    )
    for u in units:
        total.add_metric([u.node, u.unit], u.total)
        in_use.add_metric([u.node, u.unit], u.used)
    return [total, in_use]


def quota_families(states: Iterable[QuotaState]) -> list[Metric]:
    """Each quota's calls in flight and waiting, and the rate its limiter learned."""
    labels = ["quota"]
    in_use = GaugeMetricFamily("tangram_quota_in_use", "Calls in flight", labels=labels)
    queued = GaugeMetricFamily("tangram_quota_queued", "Calls waiting", labels=labels)
    rate = GaugeMetricFamily(
        "tangram_quota_learned_rate", "Calls per second the limiter allows now", labels=labels
    )
    for s in states:
        in_use.add_metric([s.spec.name], s.in_use)
        queued.add_metric([s.spec.name], s.queued)
        if s.learned_per_s is not None:
            rate.add_metric([s.spec.name], s.learned_per_s)
    return [in_use, queued, rate]
