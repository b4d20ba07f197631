"""The client API: what a client submits, what it asks the gateway, and what it gets back."""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

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
from tangram.contract.resources import QuotaName, QuotaSpec, ServiceName, ServiceSpec

TrajectoryId = Annotated[str, Meta(max_length=128, pattern=r"^([A-Za-z0-9][A-Za-z0-9._:@/-]*)?$")]
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


class InferAction(_Msg, tag_field="kind", tag="infer"):
    """One call to a registered model service: ``payload`` goes to its handler and the
    handler's output comes back as ``ActionResult.output`` (any msgpack value)."""

    service: ServiceName
    payload: Any = None


HttpMethod = Literal["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
MAX_HTTP_BODY: Final = 256 * 1024


class HttpAction(_Msg, tag_field="kind", tag="http"):
    """An HTTP call the quota_manager makes under ``quota`` (only to the quota's hosts);
    ``tokens`` are reserved up front from the quota's token window and trued up after."""

    method: HttpMethod
    url: Annotated[str, Meta(min_length=1, max_length=8192)]
    quota: QuotaName
    headers: Annotated[
        dict[Annotated[str, Meta(max_length=256)], Annotated[str, Meta(max_length=8192)]],
        Meta(max_length=64),
    ] = {}
    body: Annotated[bytes, Meta(max_length=MAX_HTTP_BODY)] = b""
    tokens: Annotated[int, Meta(ge=0, le=10**9)] = 0
    max_retries: Annotated[int, Meta(ge=0, le=10)] = 2
    response_cap_bytes: Annotated[int, Meta(ge=0, le=MAX_OUTPUT_CAP)] = 64 * 1024


class LeaseAction(_Msg, tag_field="kind", tag="lease"):
    """A permit under ``quota`` for a call the client makes itself; it succeeds when granted
    (``ActionResult.lease``) and holds its units until released or ``ttl_s`` runs out."""

    quota: QuotaName
    units: Annotated[int, Meta(ge=1, le=1_000_000)] = 1
    tokens: Annotated[int, Meta(ge=0, le=10**9)] = 0
    ttl_s: Annotated[float, Meta(gt=0, le=24 * 3600)] = 60.0


# The one union of action kinds, tagged by ``kind``.
ActionKind = ExecAction | InferAction | HttpAction | LeaseAction


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
    trajectory_id: TrajectoryId  # "" only for actions that need no environment (infer, http)
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
    """Where an action ran: its node and the units it was granted there (cores on a CPU node,
    GPU indices on a GPU node; the quota it spent for HTTP calls and leases)."""

    node_id: str
    cores: tuple[int, ...] = ()
    gpus: tuple[int, ...] = ()
    quota: str = ""


class HttpResponse(_Msg):
    """What the upstream answered (the last try), the body capped."""

    status: int
    headers: dict[str, str] = {}
    body: bytes = b""
    body_truncated: bool = False
    tries: int = 1


class LeaseGrant(_Msg):
    """A granted lease: hold it until :class:`ReleaseLease` or ``expires_at`` (wall clock)."""

    lease_id: str
    quota: str
    units: int
    expires_at: float
    tokens: int = 0


class Timings(_Msg):
    submitted_at: float
    started_at: float | None = None
    finished_at: float | None = None
    queue_s: float = 0.0
    exec_s: float = 0.0
    overhead_s: float = 0.0
    restore_s: float = 0.0  # of exec_s: bringing a model service onto its GPUs
    # Of queue_s: the time an http or lease action waited for its quota's limiter (or the
    # calls ahead of it in the quota's fair queue) to admit it, until the limiter could, not
    # until the scheduling pass that dispatched it; summed over a retried call's tries (each
    # waits again); up to its end for one cancelled or timed out while waiting. Not counted:
    # a wait before a scheduler restart. 0 for other kinds.
    wait_s: float = 0.0


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
    output: Any = None  # an infer action's handler output
    http: HttpResponse | None = None  # an http action's response
    lease: LeaseGrant | None = None  # a lease action's grant

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


class RegisterService(_Msg, tag="register_service"):
    """Register (or update) a model service; answered once the GPU agents prepared it."""

    spec: ServiceSpec


class ListServices(_Msg, tag="list_services"):
    pass


class SetQuota(_Msg, tag="set_quota"):
    """Declare (or change) a quota for the whole mesh; durable once answered."""

    spec: QuotaSpec


class ListQuotas(_Msg, tag="list_quotas"):
    pass


class ReleaseLease(_Msg, tag="release_lease"):
    """End a lease, with what the client saw of its call (feeds the quota's limiter)."""

    lease_id: Id
    tokens_used: Annotated[int, Meta(ge=0, le=10**9)] | None = None
    status: Annotated[int, Meta(ge=100, le=599)] | None = None
    retry_after_s: Annotated[float, Meta(ge=0, le=24 * 3600)] | None = None


MAX_SUBMITS: Final = 256  # submits in one SubmitMany


class SubmitMany(_Msg, tag="submit_many"):
    """Submits of one client that left together (answered by ``Submitted``, item by item)."""

    items: Annotated[tuple[Submit, ...], Meta(max_length=MAX_SUBMITS)]


GatewayRequest = (
    Submit
    | SubmitMany
    | GetResult
    | CloseEnv
    | Cancel
    | RegisterService
    | ListServices
    | SetQuota
    | ListQuotas
    | ReleaseLease
)


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


class ServiceState(_Msg):
    """A registered service as the mesh sees it: where it is prepared, resident, or failed."""

    spec: ServiceSpec
    footprint_mb: int = 0  # device memory of one copy, measured by the agents
    prepared_on: tuple[str, ...] = ()  # nodes
    resident_on: tuple[str, ...] = ()  # "node:gpu" entries
    error: str = ""  # why preparing it failed, if it did
    # over the live GPU nodes since their agents started: calls run, and the batches (forward
    # passes) concurrent calls were coalesced into, up to ``spec.max_batch`` each
    calls: int = 0
    batches: int = 0
    # of those calls, how many found the service on their device already / all in host
    # memory (the rest waited for it to come up from disk): what prefetch hints improve
    device_hits: int = 0
    host_hits: int = 0


class Services(_Msg, tag="services"):
    services: tuple[ServiceState, ...] = ()


class QuotaState(_Msg):
    """A quota with what its limiter learned: the rate it now allows, its use and queue."""

    spec: QuotaSpec
    learned_per_s: float | None = None
    in_use: int = 0
    queued: int = 0
    paused_until: float | None = None
    calls: int = 0
    throttled: int = 0  # 429s seen


class Quotas(_Msg, tag="quotas"):
    quotas: tuple[QuotaState, ...] = ()


class Submitted(_Msg, tag="submitted"):
    """The answer to ``SubmitMany``: one per item, in order (an item refused alone says why)."""

    items: Annotated[tuple[Accepted | ActionResult | ErrorReply, ...], Meta(max_length=MAX_SUBMITS)]


GatewayReply = Accepted | ActionResult | Pending | Done | Services | Quotas | Submitted | ErrorReply
