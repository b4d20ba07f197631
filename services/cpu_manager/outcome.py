"""Turn a backend's ExecOutcome into the facts the node agent reports (pure).

Output is decoded here (an invalid byte becomes U+FFFD); the agent runtime then cuts the
decoded text so that the whole completion fits one message (``tangram.agent.fit``).
"""

from __future__ import annotations

from services.cpu_manager.backend_api import ExecOutcome
from tangram.agent import with_kill_reason
from tangram.contract import ErrorKind, Outcome


def to_outcome(outcome: ExecOutcome, kill_reason: ErrorKind | None = None) -> Outcome:
    """The facts the scheduler gets; with ``kill_reason`` (the agent runtime's bookkeeping),
    a kill on request reports its reason rather than the killed exit code."""
    facts = Outcome(
        failure=outcome.failure,
        detail=outcome.detail,
        exit_code=outcome.exit_code,
        stdout=outcome.stdout.decode("utf-8", "replace"),
        stderr=outcome.stderr.decode("utf-8", "replace"),
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        started_at=outcome.started_at,
        finished_at=outcome.finished_at,
    )
    return with_kill_reason(facts, kill_reason)
