"""What the scheduler core asks its shell to do, and the pure builders of terminal results."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from tangram.contract import (
    ActionError,
    ActionResult,
    ActionStatus,
    Allocation,
    ErrorKind,
    Timings,
    UnifiedAction,
)


@dataclass(frozen=True, slots=True)
class StartOnNode:
    """Send the action to a node agent with exactly these cores (attempt already bumped)."""

    node_id: str
    action: UnifiedAction
    cores: tuple[int, ...]
    incarnation: str


@dataclass(frozen=True, slots=True)
class Finish:
    """Record the terminal result and deliver it to the client."""

    action: UnifiedAction
    result: ActionResult


@dataclass(frozen=True, slots=True)
class KillOnNode:
    node_id: str
    action_id: str
    reason: ErrorKind


@dataclass(frozen=True, slots=True)
class DropEnvOnNode:
    node_id: str
    trajectory_id: str


@dataclass(frozen=True, slots=True)
class EnvChanged:
    """Record an environment's placement or end (status: active, closed, lost, expired)."""

    trajectory_id: str
    job_id: str
    node_id: str
    incarnation: str
    memory_mb: int
    status: str
    reason: str = ""


Effect = StartOnNode | Finish | KillOnNode | DropEnvOnNode | EnvChanged


def failed(
    action: UnifiedAction,
    kind: ErrorKind,
    message: str,
    *,
    now: float,
    allocation: Allocation | None = None,
    started_at: float | None = None,
) -> ActionResult:
    """An infrastructure (or cancellation) outcome that the scheduler decides itself."""
    status: ActionStatus = "cancelled" if kind is ErrorKind.CANCELLED else "failed"
    submitted = action.submitted_at
    queue_end = started_at if started_at is not None else now
    return ActionResult(
        action_id=action.spec.action_id,
        status=status,
        error=ActionError(kind=kind, message=message),
        allocation=allocation,
        timings=Timings(
            submitted_at=submitted,
            started_at=started_at,
            finished_at=now,
            queue_s=max(0.0, queue_end - submitted),
            overhead_s=max(0.0, now - submitted),
        ),
        attempt=action.attempt,
        job_id=action.spec.job_id,
        trajectory_id=action.spec.trajectory_id,
    )


def completed(action: UnifiedAction, result: ActionResult, *, now: float) -> ActionResult:
    """The node's result, stamped with the action's identity and end-to-end timings."""
    t = result.timings
    started = t.started_at if t and t.started_at is not None else now
    finished = t.finished_at if t and t.finished_at is not None else now
    exec_s = max(0.0, finished - started)
    total = max(0.0, now - action.submitted_at)
    timings = Timings(
        submitted_at=action.submitted_at,
        started_at=started,
        finished_at=finished,
        queue_s=max(0.0, started - action.submitted_at),
        exec_s=exec_s,
        overhead_s=max(0.0, total - exec_s),
    )
    return msgspec.structs.replace(
        result,
        timings=timings,
        attempt=action.attempt,
        job_id=action.spec.job_id,
        trajectory_id=action.spec.trajectory_id,
    )
