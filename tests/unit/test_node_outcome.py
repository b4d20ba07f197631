"""How a backend's outcome becomes the client's result: whose fault, which kind."""

from __future__ import annotations

import pytest

from services.cpu_manager.backend_api import ExecOutcome
from services.cpu_manager.outcome import to_outcome
from services.gateway.formulation import Limits, formulate
from services.scheduler.core.effects import completed
from tangram.contract import ActionResult, ActionSpec, Allocation, ErrorKind, ExecAction

ACTION = formulate(
    ActionSpec(action_id="a", job_id="j", trajectory_id="t", action=ExecAction(command="x")),
    now=1.0,
    limits=Limits(),
)


def to_result(
    outcome: ExecOutcome, kill: ErrorKind | None, node: str, cores: tuple[int, ...]
) -> ActionResult:
    """What the agent reports, as the scheduler turns it into the client's result."""
    return completed(
        ACTION, to_outcome(outcome, kill), Allocation(node_id=node, cores=cores), now=4.0
    )


def outcome(code: int | None, failure: ErrorKind | None = None) -> ExecOutcome:
    return ExecOutcome(code, b"out\xff", b"", True, False, 2.0, 3.5, failure, "why")


def test_success_and_own_failure():
    ok = to_result(outcome(0), None, "n0", (3,))
    assert (ok.status, ok.error, ok.stdout, ok.stdout_truncated) == (
        "succeeded",
        None,
        "out\ufffd",
        True,
    )
    assert ok.allocation is not None
    assert ok.allocation.cores == (3,)
    assert ok.timings is not None
    assert ok.timings.exec_s == pytest.approx(1.5)
    bad = to_result(outcome(2), None, "n0", (3,))
    assert bad.status == "failed"
    assert bad.error is not None
    assert bad.error.kind is ErrorKind.COMMAND_FAILED
    assert not bad.infrastructure_failure


@pytest.mark.parametrize(
    "kind",
    [
        ErrorKind.EXEC_TIMEOUT,
        ErrorKind.OOM_KILLED,
        ErrorKind.ENVIRONMENT_LOST,
        ErrorKind.BACKEND_UNAVAILABLE,
        ErrorKind.IMAGE_MISSING,
        ErrorKind.INTERNAL,
    ],
)
def test_infrastructure_failures_are_masked(kind: ErrorKind):
    res = to_result(outcome(None, kind), None, "n0", (0,))
    assert res.status == "failed"
    assert res.error is not None
    assert res.error.kind is kind
    assert res.infrastructure_failure


def test_a_kill_on_request_reports_its_reason():
    res = to_result(outcome(-9, ErrorKind.CANCELLED), ErrorKind.CANCELLED, "n0", (0,))
    assert res.status == "cancelled"
    died = to_result(outcome(-9, ErrorKind.CANCELLED), ErrorKind.NODE_DIED, "n0", (0,))
    assert died.error is not None
    assert died.error.kind is ErrorKind.NODE_DIED
