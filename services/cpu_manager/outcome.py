"""Turn a backend's ExecOutcome into the ActionResult the client gets (pure)."""

from __future__ import annotations

from services.cpu_manager.backend import EnvFailure, ExecOutcome
from tangram.contract import (
    ActionError,
    ActionResult,
    ActionStatus,
    Allocation,
    ErrorKind,
    Timings,
    UnifiedAction,
)

_KINDS = {
    EnvFailure.ENVIRONMENT_LOST: ErrorKind.ENVIRONMENT_LOST,
    EnvFailure.EXEC_TIMEOUT: ErrorKind.EXEC_TIMEOUT,
    EnvFailure.OOM_KILLED: ErrorKind.OOM_KILLED,
    EnvFailure.BACKEND_DOWN: ErrorKind.BACKEND_UNAVAILABLE,
    EnvFailure.IMAGE_MISSING: ErrorKind.IMAGE_MISSING,
    EnvFailure.KILLED: ErrorKind.CANCELLED,
    EnvFailure.INTERNAL: ErrorKind.INTERNAL,
}


def error_of(outcome: ExecOutcome, kill_reason: ErrorKind | None) -> ActionError | None:
    """The infrastructure error, a kill on request, or the command's own non-zero exit."""
    if kill_reason is not None and outcome.failure in (EnvFailure.KILLED, None):
        return ActionError(kind=kill_reason, message=outcome.detail or "killed on request")
    if outcome.failure is not None:
        return ActionError(kind=_KINDS[outcome.failure], message=outcome.detail)
    if outcome.exit_code != 0:
        return ActionError(
            kind=ErrorKind.COMMAND_FAILED, message=f"exited with status {outcome.exit_code}"
        )
    return None


def status_of(error: ActionError | None) -> ActionStatus:
    if error is None:
        return "succeeded"
    return "cancelled" if error.kind is ErrorKind.CANCELLED else "failed"


def to_result(
    action: UnifiedAction,
    outcome: ExecOutcome,
    kill_reason: ErrorKind | None,
    node_id: str,
    cores: tuple[int, ...],
) -> ActionResult:
    error = error_of(outcome, kill_reason)
    return ActionResult(
        action_id=action.spec.action_id,
        status=status_of(error),
        exit_code=outcome.exit_code,
        stdout=outcome.stdout.decode("utf-8", "replace"),
        stderr=outcome.stderr.decode("utf-8", "replace"),
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        error=error,
        allocation=Allocation(node_id=node_id, cores=cores),
        timings=Timings(
            submitted_at=action.submitted_at,
            started_at=outcome.started_at,
            finished_at=outcome.finished_at,
            exec_s=max(0.0, outcome.finished_at - outcome.started_at),
        ),
        attempt=action.attempt,
        job_id=action.spec.job_id,
        trajectory_id=action.spec.trajectory_id,
    )
