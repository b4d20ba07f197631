"""The scheduler's state gauges, read from its cores' books when ``/metrics`` is scraped.

Nothing here runs per action: queue lengths, units granted per node and each quota's use are
counted from the books at scrape time, on the event loop (names in ``tangram.metrics``).
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric

from services.scheduler.core.books import Node
from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.scheduler import SchedulerCore
from tangram import metrics


def families(core: SchedulerCore, quotas: QuotaCore, now: float) -> list[Metric]:
    """Queue lengths, units allocated per node, and quota use."""
    q = quotas.snapshot()
    return [
        *metrics.queue_families(
            queued={"node": len(core.queue), "quota": q["quota_waiting"]},
            running={"node": len(core.running), "quota": q["quota_calls"]},
        ),
        *metrics.unit_families((units(n) for n in core.nodes.values()), "allocated"),
        *metrics.quota_families(quotas.states(now)),
    ]


def units(node: Node) -> metrics.Units:
    """A node's units (cores, or GPUs of a GPU node) and how many are granted now."""
    if node.gpu is not None:
        total = len(node.gpu.gpus)
        return metrics.Units(node.node_id, "gpu", total, max(0, total - len(node.free)))
    return metrics.Units(node.node_id, "core", node.capacity, node.capacity - len(node.free))
