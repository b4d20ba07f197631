"""Messages for driving ``SchedulerCore`` directly: an action as the gateway formulates it, a
node's full report, a node's completion of a started attempt."""

from __future__ import annotations

from services.gateway.formulation import Limits, formulate
from services.scheduler.core.effects import StartOnNode
from tangram.contract import (
    ActionSpec,
    Completion,
    ExecAction,
    Inventory,
    NodeReport,
    NumaCores,
    Outcome,
    RunningAction,
    UnifiedAction,
)


def action(
    aid: str,
    tid: str,
    cpus: int | list[int] = 1,
    mem: int = 100,
    now: float = 0.0,
    queue_timeout_s: float | None = None,
) -> UnifiedAction:
    spec = ActionSpec(
        action_id=aid,
        job_id="j",
        trajectory_id=tid,
        cpus=cpus,
        memory_mb=mem,
        action=ExecAction(command="true"),
        queue_timeout_s=queue_timeout_s,
    )
    return formulate(spec, now=now, limits=Limits())


def report(
    node: str = "n0",
    inc: str = "i0",
    cores: int = 4,
    numa: int = 1,
    mem: int = 1000,
    running: tuple[RunningAction, ...] = (),
    seen: int = 0,
    idle_envs_hold_memory: bool = True,
) -> NodeReport:
    per = cores // numa
    layout = tuple(
        NumaCores(numa_node=k, cores=tuple(range(k * per, (k + 1) * per))) for k in range(numa)
    )
    inv = Inventory(
        numa=layout,
        memory_mb=mem,
        backend="process",
        isolates=False,
        idle_envs_hold_memory=idle_envs_hold_memory,
    )
    return NodeReport(
        node_id=node, incarnation=inc, inventory=inv, running=running, full=True, seen=seen
    )


def done(
    run: StartOnNode,
    node_id: str | None = None,
    incarnation: str | None = None,
    attempt: int | None = None,
    code: int = 0,
) -> Completion:
    """A node's report that ``run`` ended with ``code`` (by default from the node it went to)."""
    return Completion(
        node_id=run.node_id if node_id is None else node_id,
        incarnation=run.incarnation if incarnation is None else incarnation,
        action_id=run.action.spec.action_id,
        attempt=run.action.attempt if attempt is None else attempt,
        outcome=Outcome(exit_code=code, started_at=1.0, finished_at=2.0),
    )
