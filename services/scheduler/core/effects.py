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
    QuotaSpec,
    ServiceSpec,
    ServiceState,
    Timings,
    UnifiedAction,
)


@dataclass(frozen=True, slots=True)
class StartOnNode:
    """Send the action to a node agent with exactly these cores (attempt already bumped); an
    infer action gets ``gpus`` (one buddy chunk) and the ``service`` variant to run there."""

    node_id: str
    action: UnifiedAction
    cores: tuple[int, ...]
    incarnation: str
    gpus: tuple[int, ...] = ()
    service: ServiceSpec | None = None
    quota: QuotaSpec | None = None  # an http call: its quota (hosts, key name) ...
    tokens: int = 0  # ... and the tokens reserved for it
    after: tuple[str, ...] = ()  # pipelined: the node starts it once these end (see pipeline)
    issued: int = 0  # the core's count of dispatches when it was granted (see Dispatch.issued)

    @property
    def units(self) -> tuple[int, ...]:
        """What the grant books on its node: cores, or GPU indices."""
        return self.gpus or self.cores


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


@dataclass(frozen=True, slots=True)
class PrepareOnNode:
    """Ask a GPU node agent to prepare these services (build, host copy, measure)."""

    node_id: str
    services: tuple[ServiceSpec, ...]


@dataclass(frozen=True, slots=True)
class ServiceSettled:
    """A registration's wait is over: every GPU node it waited on reported the service (or
    left, or the wait ran out). ``error`` says why no node could prepare it, if none could."""

    name: str
    state: ServiceState
    error: str = ""


Effect = (
    StartOnNode | Finish | KillOnNode | DropEnvOnNode | EnvChanged | PrepareOnNode | ServiceSettled
)


def verdict(
    action: UnifiedAction,
    kind: ErrorKind,
    message: str,
    *,
    now: float,
    allocation: Allocation | None = None,
    started_at: float | None = None,
    wait_s: float = 0.0,
) -> ActionResult:
    """A result the scheduler decides itself: an infrastructure failure or a cancellation
    (``wait_s``: a quota action's limiter wait, see ``Timings``)."""
    submitted = action.submitted_at
    queue_end = started_at if started_at is not None else now
    queue_s = max(0.0, queue_end - submitted)
    return ActionResult(
        action_id=action.spec.action_id,
        status=status_of(ActionError(kind=kind)),
        error=ActionError(kind=kind, message=message),
        allocation=allocation,
        timings=Timings(
            submitted_at=submitted,
            started_at=started_at,
            finished_at=now,
            queue_s=queue_s,
            overhead_s=max(0.0, now - submitted),
            wait_s=_part(wait_s, queue_s),
        ),
        attempt=action.attempt,
        job_id=action.spec.job_id,
        trajectory_id=action.spec.trajectory_id,
    )


def completed(
    action: UnifiedAction,
    outcome: Outcome,
    allocation: Allocation,
    *,
    now: float,
    wait_s: float = 0.0,
) -> ActionResult:
    """The user's result from what the node saw: status and error from the one vocabulary,
    end-to-end timings from the action's submission to ``now`` (``wait_s``: a quota action's
    limiter wait, see ``Timings``)."""
    started = outcome.started_at if outcome.started_at is not None else now
    finished = outcome.finished_at if outcome.finished_at is not None else now
    exec_s = max(0.0, finished - started)
    queue_s = max(0.0, started - action.submitted_at)
    total = max(0.0, now - action.submitted_at)
    error = None if _answered(action, outcome) else error_of(outcome)
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
            queue_s=queue_s,
            exec_s=exec_s,
            overhead_s=max(0.0, total - exec_s),
            restore_s=outcome.restore_s,
            wait_s=_part(wait_s, queue_s),
        ),
        attempt=action.attempt,
        job_id=action.spec.job_id,
        trajectory_id=action.spec.trajectory_id,
        output=outcome.output,
        http=outcome.http,
    )


def _part(wait_s: float, queue_s: float) -> float:
    """The limiter wait as a part of ``queue_s``: the scheduler's clock timed the one, the
    gateway's and the agent's the other (another machine's may differ a little)."""
    return min(max(0.0, wait_s), queue_s)


def _answered(action: UnifiedAction, outcome: Outcome) -> bool:
    """An infer call has no exit code: with no failure, its handler answered."""
    return action.key_resource == "gpu" and outcome.failure is None and not outcome.exit_code


def error_of(outcome: Outcome) -> ActionError | None:
    """The infrastructure failure or kill, else the command's own non-zero exit, else none."""
    if outcome.failure is not None:
        return ActionError(kind=outcome.failure, message=outcome.detail)
    if outcome.http is not None:
        return None  # an http call has no exit code: a response received is its success
    if outcome.exit_code != 0:
        why = outcome.detail or f"exited with status {outcome.exit_code}"
        return ActionError(kind=ErrorKind.COMMAND_FAILED, message=why)
    return None


def status_of(error: ActionError | None) -> ActionStatus:
    """``succeeded`` without an error, ``cancelled`` for a cancellation, else ``failed``."""
    if error is None:
        return "succeeded"
    return "cancelled" if error.kind is ErrorKind.CANCELLED else "failed"
