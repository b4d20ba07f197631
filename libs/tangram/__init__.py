"""Tangram: pooled, elastic external resources for agentic RL, one action at a time.

The public surface is what ``__all__`` lists; everything else is private to the package.
"""

from tangram.client import Client, SyncClient
from tangram.contract import (
    Accepted,
    ActionError,
    ActionResult,
    ActionSpec,
    Allocation,
    DurationHint,
    ErrorKind,
    ExecAction,
    QuotaSpec,
    ServiceSpec,
    ServiceState,
    Timings,
)
from tangram.errors import (
    Busy,
    CallerError,
    InternalError,
    InvalidRequest,
    NotFound,
    RemoteError,
    ResultTimeout,
    ServiceDead,
    TangramError,
    Unavailable,
)

__version__ = "0.1.0"

__all__ = [
    "Accepted",
    "ActionError",
    "ActionResult",
    "ActionSpec",
    "Allocation",
    "Busy",
    "CallerError",
    "Client",
    "DurationHint",
    "ErrorKind",
    "ExecAction",
    "InternalError",
    "InvalidRequest",
    "NotFound",
    "QuotaSpec",
    "RemoteError",
    "ResultTimeout",
    "ServiceDead",
    "ServiceSpec",
    "ServiceState",
    "SyncClient",
    "TangramError",
    "Timings",
    "Unavailable",
    "__version__",
]
