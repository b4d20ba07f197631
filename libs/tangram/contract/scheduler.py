"""Gateway → scheduler: the unified action of §4.1 and the scheduler's own requests."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from tangram.contract.base import MAX_BATCH_ITEMS, Timestamp, _Msg
from tangram.contract.beats import ServiceRow
from tangram.contract.client import ActionSpec, QuotaState, ServiceState
from tangram.contract.resources import QuotaSpec, ServiceSpec


class Demand(_Msg):
    """One entry of the cost vector: any of ``choices`` units of ``resource`` (sorted, unique)."""

    resource: Annotated[str, Meta(min_length=1, max_length=128)]
    # empty only for a GPU call (the scheduler picks its chunk); see the scheduler's checks
    choices: Annotated[tuple[Annotated[int, Meta(ge=0)], ...], Meta(max_length=MAX_BATCH_ITEMS)]

    @property
    def min(self) -> int:
        return self.choices[0]

    @property
    def max(self) -> int:
        return self.choices[-1]


class UnifiedAction(_Msg):
    """The formulated action of §4.1 that the gateway hands to the scheduler."""

    spec: ActionSpec
    # non-empty in an action the scheduler queues (it refuses one without: core/validate.py)
    demands: Annotated[tuple[Demand, ...], Meta(max_length=16)]
    key_resource: str
    env_memory_mb: int
    submitted_at: Timestamp
    reply_subject: str = ""
    traceparent: str = ""
    attempt: int = 0


# --------------------------------------------------------------------------- scheduler


class Enqueue(_Msg, tag="enqueue"):
    action: UnifiedAction


class EnqueueMany(_Msg, tag="enqueue_many"):
    """Actions made durable together, handed to the scheduler in one message."""

    actions: Annotated[tuple[UnifiedAction, ...], Meta(max_length=MAX_BATCH_ITEMS)]


class CloseEnvCmd(_Msg, tag="close_env"):
    trajectory_id: str


class CancelCmd(_Msg, tag="cancel"):
    action_id: str


class StatusQuery(_Msg, tag="status"):
    pass


class ServiceCmd(_Msg, tag="service"):
    """Register or update a service: the scheduler has the GPU agents prepare it and answers
    ``Services`` with its state (or an error naming why no agent could prepare it)."""

    spec: ServiceSpec


class QuotaCmd(_Msg, tag="quota"):
    """A quota declared or changed (already durable); the scheduler's limiter takes it."""

    spec: QuotaSpec


class LeaseEnd(_Msg, tag="lease_end"):
    """A client released a lease, with what it saw of its call."""

    lease_id: str
    tokens_used: int | None = None
    status: int | None = None
    retry_after_s: float | None = None


class ResourcesQuery(_Msg, tag="resources"):
    """Services and quotas as the scheduler sees them now (answered with ``Resources``)."""


class Resources(_Msg, tag="resources_state"):
    services: tuple[ServiceState, ...] = ()
    quotas: tuple[QuotaState, ...] = ()


# What changes the scheduler's books (its action subject, the gateway's alone). The read-only
# questions (StatusQuery, ResourcesQuery) are not among them: they go to its status subject.
SchedulerRequest = (
    Enqueue | EnqueueMany | CloseEnvCmd | CancelCmd | ServiceCmd | QuotaCmd | LeaseEnd
)


class NodeRow(_Msg):
    """One node in a status reply: cores and memory, and how much of each is unbooked."""

    node_id: str
    cores: int
    free_cores: int
    memory_mb: int
    free_memory_mb: int
    envs: int
    draining: bool = False
    # from the health detector: healthy / suspect / fenced; idle / busy / draining; seconds
    # since its progress counters last moved (or its no-progress window last restarted)
    health: str = ""
    phase: str = ""
    last_progress_s: float | None = None
    # a GPU node: its GPUs that may be granted (not lost), and how many of those are free
    gpus: int = 0
    free_gpus: int = 0


class QueuedRow(_Msg):
    """One queued action in a status reply; ``reason`` says what it waits for, when known."""

    action_id: str
    trajectory_id: str
    cpus: int
    waited_s: float
    reason: str = ""


class RunningRow(_Msg):
    action_id: str
    trajectory_id: str
    node_id: str
    cores: int
    running_s: float


class SchedulerStatus(_Msg, tag="scheduler_status"):
    epoch: int
    policy: str
    queued: int
    running: int
    nodes: int
    envs: int
    free_cores: int
    # the tables `tangram status` prints (the queue's head and the running actions, bounded)
    node_rows: list[NodeRow] = []
    queue_rows: list[QueuedRow] = []
    running_rows: list[RunningRow] = []
    # the gateways and schedulers heard on their heartbeats (contract/beats.py)
    service_rows: list[ServiceRow] = []
