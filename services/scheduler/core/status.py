"""The rows of a status reply, read from the core's books (what ``tangram status`` prints)."""

from __future__ import annotations

from itertools import islice

from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.scheduler import SchedulerCore
from tangram.contract import NodeRow, QueuedRow, RunningRow, SchedulerStatus

ROWS_LIMIT = 50  # queued and running actions listed (the counts say how many there are)


def status_reply(
    core: SchedulerCore, epoch: int, now: float, quotas: QuotaCore | None = None
) -> SchedulerStatus:
    """The counters and the tables: nodes, the queue's head, running actions. The counters
    include the quota core's agents, waiting calls and calls in flight."""
    n = core.snapshot()
    q = quotas.snapshot() if quotas is not None else {}
    return SchedulerStatus(
        epoch=epoch,
        policy=core.policy.name,
        queued=n["queued"] + q.get("quota_waiting", 0),
        running=n["running"] + q.get("quota_calls", 0),
        nodes=n["nodes"] + q.get("quota_agents", 0),
        envs=n["envs"],
        free_cores=n["free_cores"],
        node_rows=[_node(core, n) for n in sorted(core.nodes)],
        queue_rows=[
            QueuedRow(
                action_id=aid,
                trajectory_id=act.spec.trajectory_id,
                cpus=act.demands[0].min if act.demands[0].choices else 0,  # infer: chosen later
                waited_s=round(max(0.0, now - act.submitted_at), 3),
                reason=core.waits.get(aid, ""),
            )
            for aid, act in islice(core.queue.items(), ROWS_LIMIT)
        ],
        running_rows=[
            RunningRow(
                action_id=aid,
                trajectory_id=run.action.spec.trajectory_id,
                node_id=run.node_id,
                cores=len(run.cores),
                running_s=round(max(0.0, now - run.started_at), 3),
            )
            for aid, run in islice(core.running.items(), ROWS_LIMIT)
        ],
    )


def _node(core: SchedulerCore, node_id: str) -> NodeRow:
    node = core.nodes[node_id]
    usable = set(node.gpu.gpus) - node.gpu.down - node.gpu.absent if node.gpu else set()
    return NodeRow(
        node_id=node_id,
        cores=node.capacity,
        free_cores=len(node.free),
        memory_mb=node.memory_mb,
        free_memory_mb=node.memory_mb - node.reserved_mb,
        envs=sum(1 for e in core.envs.values() if e.node_id == node_id),
        draining=node.draining,
        gpus=len(usable),
        free_gpus=len(usable & node.free),
    )
