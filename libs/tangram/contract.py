"""The wire contract: every message that crosses NATS, as versioned msgspec Structs.

Rules (see STYLE.md): messages are ``kw_only`` and ``omit_defaults``; unknown fields are
allowed so that services can be rolled one at a time; a new field always gets a default and
a field never changes type. Values are constrained at decode time, so handlers only ever
see valid objects. One subject carries one union type (see :mod:`tangram.subjects`).
Everything is encoded with MessagePack; encoders and decoders are built once, here.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct

CONTRACT_VERSION: Final = 1

# Bounds that keep one message well under NATS' default 1 MiB max_payload.
MAX_COMMAND_BYTES: Final = 64 * 1024
MAX_ARGS: Final = 4096
MAX_ENV_VARS: Final = 256
MAX_OUTPUT_CAP: Final = 256 * 1024
MAX_MESSAGE_BYTES: Final = 512 * 1024

Id = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$")]
NodeId = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Cores = Annotated[int, Meta(ge=1, le=4096)]
PosSeconds = Annotated[float, Meta(gt=0, le=7 * 24 * 3600)]
Timestamp = Annotated[float, Meta(ge=0)]
MemoryMb = Annotated[int, Meta(ge=1, le=16 * 1024 * 1024)]
Subject = Annotated[str, Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_$.>*-]+$")]


class _Msg(Struct, kw_only=True, omit_defaults=True):
    """Base of every wire message (treat as immutable: change with msgspec.structs.replace)."""


# --------------------------------------------------------------------------- errors


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


# --------------------------------------------------------------------------- actions

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


class Demand(_Msg):
    """One entry of the cost vector: any of ``choices`` units of ``resource`` (sorted, unique)."""

    resource: str
    choices: tuple[int, ...]

    @property
    def min(self) -> int:
        return self.choices[0]

    @property
    def max(self) -> int:
        return self.choices[-1]


class UnifiedAction(_Msg):
    """The formulated action of §4.1 that the gateway hands to the scheduler."""

    spec: ActionSpec
    demands: tuple[Demand, ...]
    key_resource: str
    env_memory_mb: int
    submitted_at: Timestamp
    reply_subject: str = ""
    traceparent: str = ""
    attempt: int = 0


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


# --------------------------------------------------------------------------- scheduler


class Enqueue(_Msg, tag="enqueue"):
    action: UnifiedAction


class CloseEnvCmd(_Msg, tag="close_env"):
    trajectory_id: str


class CancelCmd(_Msg, tag="cancel"):
    action_id: str


class StatusQuery(_Msg, tag="status"):
    pass


SchedulerRequest = Enqueue | CloseEnvCmd | CancelCmd | StatusQuery


class SchedulerStatus(_Msg, tag="scheduler_status"):
    epoch: int
    policy: str
    queued: int
    running: int
    nodes: int
    envs: int
    free_cores: int


class NumaCores(_Msg):
    numa_node: int
    cores: tuple[int, ...]


class Inventory(_Msg):
    numa: tuple[NumaCores, ...]
    memory_mb: int
    backend: str
    isolates: bool


class RunningAction(_Msg):
    action_id: str
    attempt: int
    trajectory_id: str
    cores: tuple[int, ...]


class Completion(_Msg, tag="completion"):
    """A node agent's report that an attempt ended. Re-sent until the scheduler acks it."""

    node_id: NodeId
    incarnation: str
    attempt: int
    result: ActionResult


class NodeReport(_Msg, tag="node_report"):
    """Registration and heartbeat of a node agent: who it is, what runs there, what it holds."""

    node_id: NodeId
    incarnation: str
    inventory: Inventory
    running: tuple[RunningAction, ...] = ()
    envs: tuple[str, ...] = ()
    seq: int = 0
    full: bool = False


class EnvExpired(_Msg, tag="env_expired"):
    node_id: NodeId
    incarnation: str
    trajectory_id: str


class NodeLeaving(_Msg, tag="node_leaving"):
    """A node agent shutting down: ``draining`` first (send no new work; what runs finishes),
    then gone (dispatch nothing more to this incarnation).

    When gone, ``started`` names every action this incarnation took whose completion the
    scheduler has not acknowledged, and ``envs`` the environments it held: any other
    dispatch to it never started (the scheduler queues it again). ``None`` means unknown.
    """

    node_id: NodeId
    incarnation: str
    draining: bool = False
    started: tuple[str, ...] | None = None
    envs: tuple[str, ...] | None = None


NodeMessage = Completion | NodeReport | EnvExpired | NodeLeaving


class Ack(_Msg, tag="ack"):
    pass


# --------------------------------------------------------------------------- node agent


class Dispatch(_Msg, tag="dispatch"):
    action: UnifiedAction
    cores: tuple[int, ...]
    epoch: int
    incarnation: str = ""  # the node agent incarnation it is meant for


class Kill(_Msg, tag="kill"):
    action_id: str
    epoch: int
    reason: ErrorKind = ErrorKind.CANCELLED


class DropEnv(_Msg, tag="drop_env"):
    trajectory_id: str
    epoch: int


class Reconcile(_Msg, tag="reconcile"):
    """A scheduler (re)started with ``epoch``: report everything; ignore older epochs."""

    epoch: int


NodeCommand = Dispatch | Kill | DropEnv | Reconcile


# --------------------------------------------------------------------------- codec

T = TypeVar("T")

_encoder = msgspec.msgpack.Encoder()


def encode(msg: Any) -> bytes:
    """Encode any contract message."""
    return _encoder.encode(msg)


class Codec:
    """Decoders built once per union type."""

    def __init__(self) -> None:
        self._decoders: dict[Any, msgspec.msgpack.Decoder[Any]] = {}

    def decoder(self, typ: Any) -> msgspec.msgpack.Decoder[Any]:
        dec = self._decoders.get(typ)
        if dec is None:
            dec = self._decoders[typ] = msgspec.msgpack.Decoder(typ)
        return dec

    def decode(self, data: bytes, typ: Any) -> Any:
        """Decode ``data`` as ``typ``; raises :class:`msgspec.ValidationError`/``DecodeError``."""
        return self.decoder(typ).decode(data)


codec = Codec()
