"""The execution-backend interface of the node agent, and the types that cross it.

A backend owns the per-trajectory environments of one node and runs actions in them,
pinned to exactly the cores the scheduler granted. The node agent (``service.py``) owns
bookkeeping and messaging; it never touches processes or containers itself. A backend reports
what went wrong in the mesh's one failure vocabulary, ``ErrorKind``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from tangram.contract import ErrorKind


@dataclass(frozen=True, slots=True)
class ExecRequest:
    """One action to run: argv in the env of ``trajectory_id`` on exactly ``cores``."""

    action_id: str
    trajectory_id: str
    argv: tuple[str, ...]
    cores: tuple[int, ...]
    timeout_s: float
    output_cap_bytes: int
    env: dict[str, str] = field(default_factory=dict)
    memory_mb: int = 512
    image: str = ""
    network: bool = False


@dataclass(frozen=True, slots=True)
class ExecOutcome:
    """What happened. ``failure`` set means the infrastructure failed or the action was killed
    (``CANCELLED`` for a kill on request), not that the command failed."""

    exit_code: int | None
    stdout: bytes
    stderr: bytes
    stdout_truncated: bool
    stderr_truncated: bool
    started_at: float
    finished_at: float
    failure: ErrorKind | None = None
    detail: str = ""


def failed_outcome(failure: ErrorKind, detail: str, started: float | None = None) -> ExecOutcome:
    """An outcome without a command result: the infrastructure failed (or killed it) first."""
    now = time.time()
    return ExecOutcome(None, b"", b"", False, False, started or now, now, failure, detail)


class Backend(Protocol):
    """What the node agent needs from an execution backend."""

    name: str
    isolates: bool

    async def start(self) -> None:
        """Prepare the backend (clean leftovers of a previous incarnation)."""

    async def close(self) -> None:
        """Kill running actions and release every environment."""

    async def run(self, req: ExecRequest) -> ExecOutcome:
        """Run one action, creating the trajectory's environment on its first action."""

    async def kill(self, action_id: str) -> bool:
        """Kill a running action; True if it was running."""

    async def drop_env(self, trajectory_id: str) -> None:
        """Remove a trajectory's environment and everything in it."""

    def envs(self) -> dict[str, float]:
        """Live environments: trajectory_id -> monotonic time of last use."""


@runtime_checkable
class Canaried(Protocol):
    """A backend that can run the health detector's canary (see ``tangram.agent.Canaries``)."""

    async def canary(self) -> None:
        """Run a trivial command through the path actions take; return once it completed."""


@runtime_checkable
class Tiered(Protocol):
    """A backend that moves idle environments to disk (the Docker backend)."""

    def envs_on_disk(self) -> tuple[str, ...]:
        """Of ``envs``, those saved to disk, their containers removed."""
