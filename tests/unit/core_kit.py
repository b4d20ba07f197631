"""Messages for driving ``SchedulerCore`` directly: an action as the gateway formulates it, a
node's full report, a node's completion of a started attempt."""

from __future__ import annotations

from services.gateway.formulation import Limits, formulate
from services.scheduler.effects import StartOnNode
from tangram.contract import (
    ActionResult,
    ActionSpec,
    ExecAction,
    Inventory,
    NodeReport,
    NumaCores,
    RunningAction,
    Timings,
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
) -> NodeReport:
    per = cores // numa
    layout = tuple(
        NumaCores(numa_node=k, cores=tuple(range(k * per, (k + 1) * per))) for k in range(numa)
    )
    inv = Inventory(numa=layout, memory_mb=mem, backend="process", isolates=False)
    return NodeReport(node_id=node, incarnation=inc, inventory=inv, running=running, full=True)


def done(run: StartOnNode, code: int = 0) -> ActionResult:
    return ActionResult(
        action_id=run.action.spec.action_id,
        status="succeeded" if code == 0 else "failed",
        exit_code=code,
        timings=Timings(submitted_at=0.0, started_at=1.0, finished_at=2.0),
    )
