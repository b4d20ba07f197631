"""Building ExecRequests and checking outcomes in the Docker tests."""

from __future__ import annotations

import uuid
from typing import Any

from services.cpu_manager.backend_api import ExecOutcome, ExecRequest


def request_for(
    trajectory_id: str, command: list[str] | str, cores: tuple[int, ...] = (0,), **fields: Any
) -> ExecRequest:
    """An ExecRequest with test defaults; a string command runs through ``sh -c``."""
    argv = ("sh", "-c", command) if isinstance(command, str) else tuple(command)
    values: dict[str, Any] = {
        "action_id": uuid.uuid4().hex,
        "timeout_s": 30.0,
        "output_cap_bytes": 1 << 16,
        "memory_mb": 256,
    }
    values.update(fields)
    return ExecRequest(trajectory_id=trajectory_id, argv=argv, cores=cores, **values)


def ok(outcome: ExecOutcome) -> str:
    """Assert the command ran and succeeded; return its stdout."""
    assert outcome.failure is None, (outcome.failure, outcome.detail, outcome.stderr)
    assert outcome.exit_code == 0, (outcome.exit_code, outcome.stderr)
    return outcome.stdout.decode()
