"""The client API: what a client submits, what it asks the gateway, and what it gets back."""

from __future__ import annotations

from typing import Annotated, Final, Literal

from msgspec import Meta

from tangram.contract.base import (
    MAX_ARGS,
    MAX_COMMAND_BYTES,
    MAX_ENV_VARS,
    MAX_OUTPUT_CAP,
    Cores,
    Id,
    MemoryMb,
    PosSeconds,
    Subject,
    _Msg,
)
from tangram.contract.errors import ActionError, ErrorReply

ActionStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL: Final = frozenset({"succeeded", "failed", "cancelled"})


class ExecAction(_Msg, tag_field="kind", tag="exec"):
    """A shell command in the trajectory's environment. A ``str`` runs under ``sh -c``."""

    command: (
        Annotated[str, Meta(max_length=MAX_COMMAND_BYTES)]
        | Annotated[
            list[Annotated[str, Meta(max_length=MAX_COMMAND_BYTES)]], Meta(max_length=MAX_ARGS)
        ]
    )
    env: Annotated[
        dict[str, Annotated[str, Meta(max_length=8192)]], Meta(max_length=MAX_ENV_VARS)
    ] = {}
    output_cap_bytes: Annotated[int, Meta(ge=0, le=MAX_OUTPUT_CAP)] = 64 * 1024


# The one union of action kinds; new kinds (gpu, http) join it with their own tag.
ActionKind = ExecAction


def kind_of(action: ActionKind) -> str:
    """The wire tag of an action kind (``exec``, ...)."""
    return str(action.__struct_config__.tag)


class DurationHint(_Msg):
    """What the client knows of the action's duration (§4.1 Eq. 1): T_ori on one unit and E(m)."""

    t_ori_s: Annotated[float, Meta(gt=0, le=7 * 24 * 3600)] | None = None
    parallel_fraction: Annotated[float, Meta(ge=0, le=1)] | None = None


class ActionSpec(_Msg):
    """What a client submits: one action of one trajectory of one RL job."""

    action_id: Id
    job_id: Id
    trajectory_id: Id
    action: ActionKind
    # An inclusive [min, max] range is a list: msgspec 0.22 crashes (GC segfault) decoding a
    # union of a constrained int with a tuple, so the range is a length-2 list on the wire.
    cpus: Cores | Annotated[list[Cores], Meta(min_length=2, max_length=2)] = 1
    memory_mb: MemoryMb = 512
    timeout_s: PosSeconds = 600.0
    queue_timeout_s: PosSeconds | None = None
    profile: Annotated[str, Meta(max_length=128)] = ""
    duration: DurationHint | None = None
    # Environment settings, applied when the trajectory's environment is created.
    image: Annotated[str, Meta(max_length=256, pattern=r"^[A-Za-z0-9._/:@-]*$")] = ""
    network: bool = False


class Allocation(_Msg):
    node_id: str
    cores: tuple[int, ...]


class Timings(_Msg):
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0


class ActionResult(_Msg, tag="result"):
    """The terminal outcome of an action, delivered to the client and kept in Postgres."""

    action_id: str
    status: ActionStatus
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    error: ActionError | None = None
    allocation: Allocation | None = None
    timings: Timings | None = None
    attempt: int = 0
    job_id: str = ""
    trajectory_id: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    @property
    def infrastructure_failure(self) -> bool:
        """True when a trainer should mask this sample rather than learn from it."""
        return self.error is not None and self.error.infrastructure


# --------------------------------------------------------------------------- gateway


class Submit(_Msg, tag="submit"):
    spec: ActionSpec
    reply_subject: Subject | None = None


class GetResult(_Msg, tag="get_result"):
    action_id: Id


class CloseEnv(_Msg, tag="close_env"):
    trajectory_id: Id


class Cancel(_Msg, tag="cancel"):
    action_id: Id


GatewayRequest = Submit | GetResult | CloseEnv | Cancel


class Accepted(_Msg, tag="accepted"):
    action_id: str
    duplicate: bool = False
    status: ActionStatus = "queued"


class Pending(_Msg, tag="pending"):
    action_id: str
    status: ActionStatus


class Done(_Msg, tag="done"):
    """Generic success reply for commands that return nothing else."""

    detail: str = ""


GatewayReply = Accepted | ActionResult | Pending | Done | ErrorReply
