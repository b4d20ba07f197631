"""What the scheduler core asks its shell to do, and the pure builders of terminal results:
the only place an ``ActionResult`` is made (from a node's ``Outcome`` or the scheduler's own
verdict)."""

from __future__ import annotations

from dataclasses import dataclass

from tangram.contract import (
    ActionError,
    ActionResult,
    ActionStatus,
    Allocation,
    ErrorKind,
    Outcome,
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


def verdict(
    action: UnifiedAction,
    kind: ErrorKind,
    message: str,
    *,
    now: float,
    allocation: Allocation | None = None,
    started_at: float | None = None,
) -> ActionResult:
    """A result the scheduler decides itself: an infrastructure failure or a cancellation."""
    submitted = action.submitted_at
    queue_end = started_at if started_at is not None else now
    return ActionResult(
        action_id=action.spec.action_id,
        status=status_of(ActionError(kind=kind)),
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


def completed(
    action: UnifiedAction, outcome: Outcome, allocation: Allocation, *, now: float
) -> ActionResult:
    """The user's result from what the node saw: status and error from the one vocabulary,
    end-to-end timings from the action's submission to ``now``."""
    started = outcome.started_at if outcome.started_at is not None else now
    finished = outcome.finished_at if outcome.finished_at is not None else now
    exec_s = max(0.0, finished - started)
    total = max(0.0, now - action.submitted_at)
    error = error_of(outcome)
    return ActionResult(
        action_id=action.spec.action_id,
        status=status_of(error),
        exit_code=outcome.exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        error=error,
        allocation=allocation,
        timings=Timings(
            submitted_at=action.submitted_at,
            started_at=started,
            finished_at=finished,
            queue_s=max(0.0, started - action.submitted_at),
            exec_s=exec_s,
            overhead_s=max(0.0, total - exec_s),
        ),
        attempt=action.attempt,
        job_id=action.spec.job_id,
        trajectory_id=action.spec.trajectory_id,
    )


def error_of(outcome: Outcome) -> ActionError | None:
    """The infrastructure failure or kill, else the command's own non-zero exit, else none."""
    if outcome.failure is not None:
        return ActionError(kind=outcome.failure, message=outcome.detail)
    if outcome.exit_code != 0:
        return ActionError(
            kind=ErrorKind.COMMAND_FAILED, message=f"exited with status {outcome.exit_code}"
        )
    return None


def status_of(error: ActionError | None) -> ActionStatus:
    """``succeeded`` without an error, ``cancelled`` for a cancellation, else ``failed``."""
    if error is None:
        return "succeeded"
    return "cancelled" if error.kind is ErrorKind.CANCELLED else "failed"
