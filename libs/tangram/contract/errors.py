"""The one failure vocabulary (``ErrorKind``) from backend to client, and the error reply.

Every layer speaks it: a backend reports a kind, the scheduler builds the action's error from
it, the client reads it; every request that cannot be served is answered with an ErrorReply.
"""

from __future__ import annotations

import enum

from tangram.contract.base import _Msg


class ErrorKind(enum.StrEnum):
    """Why an action did not succeed. Only ``command_failed`` is the action's own doing."""

    COMMAND_FAILED = "command_failed"
    INVALID_REQUEST = "invalid_request"
    ENVIRONMENT_LOST = "environment_lost"
    NODE_DIED = "node_died"
    QUEUE_TIMEOUT = "queue_timeout"
    EXEC_TIMEOUT = "exec_timeout"
    OOM_KILLED = "oom_killed"
    BACKEND_UNAVAILABLE = "backend_unavailable"
    IMAGE_MISSING = "image_missing"
    CANCELLED = "cancelled"
    INTERNAL = "internal"
    DEVICE_OOM = "device_oom"  # a GPU ran out of memory (the service is re-measured)
    DEVICE_LOST = "device_lost"  # a GPU stopped answering (no more grants on it)
    RATE_LIMITED = "rate_limited"  # the upstream kept answering 429 past the retries
    UPSTREAM_FAILED = "upstream_failed"  # the upstream was unreachable or kept failing (5xx)

    @property
    def infrastructure(self) -> bool:
        """True when the failure says nothing about the policy's action (mask it in training)."""
        return self is not ErrorKind.COMMAND_FAILED


class ActionError(_Msg):
    kind: ErrorKind
    message: str = ""

    @property
    def infrastructure(self) -> bool:
        return self.kind.infrastructure


class ErrorReply(_Msg, tag="error"):
    """Reply to any request that could not be served. ``code`` is machine-readable."""

    code: str
    message: str
    retryable: bool = False
    retry_after_s: float | None = None
