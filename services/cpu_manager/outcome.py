"""Turn a backend's ExecOutcome into the facts the node agent reports (pure)."""

from __future__ import annotations

from services.cpu_manager.backend import EnvFailure, ExecOutcome
from tangram.contract import ErrorKind, Outcome

_KINDS = {
    EnvFailure.ENVIRONMENT_LOST: ErrorKind.ENVIRONMENT_LOST,
    EnvFailure.EXEC_TIMEOUT: ErrorKind.EXEC_TIMEOUT,
    EnvFailure.OOM_KILLED: ErrorKind.OOM_KILLED,
    EnvFailure.BACKEND_DOWN: ErrorKind.BACKEND_UNAVAILABLE,
    EnvFailure.IMAGE_MISSING: ErrorKind.IMAGE_MISSING,
    EnvFailure.KILLED: ErrorKind.CANCELLED,
    EnvFailure.INTERNAL: ErrorKind.INTERNAL,
}


def to_outcome(outcome: ExecOutcome, kill_reason: ErrorKind | None) -> Outcome:
    """The facts the scheduler gets: a kill on request wins over the killed exit code."""
    failure = _KINDS[outcome.failure] if outcome.failure is not None else None
    detail = outcome.detail
    if kill_reason is not None and outcome.failure in (EnvFailure.KILLED, None):
        failure, detail = kill_reason, outcome.detail or "killed on request"
    return Outcome(
        failure=failure,
        detail=detail,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout.decode("utf-8", "replace"),
        stderr=outcome.stderr.decode("utf-8", "replace"),
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        started_at=outcome.started_at,
        finished_at=outcome.finished_at,
    )
