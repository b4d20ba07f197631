"""Every NATS subject of the mesh, each paired with the request and reply types it carries.

An :class:`Endpoint` is the one place a subject meets its types: ``bus.serve(endpoint, handler)``
type-checks the handler against them and ``bus.request(endpoint, msg)`` returns the reply type.
One subject carries one union type (STYLE.md); an :class:`~tangram.contract.ErrorReply` can
answer any request and is raised by the bus as its error, so it is not part of a reply type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from tangram.contract import (
    Accepted,
    Ack,
    ActionResult,
    Done,
    GatewayRequest,
    NodeCommand,
    NodeMessage,
    Pending,
    Pressure,
    Quotas,
    Resources,
    ResourcesQuery,
    SchedulerRequest,
    SchedulerStatus,
    Services,
    StatusQuery,
    Submitted,
)
from tangram.contract.beats import ServiceBeat
from tangram.contract.spans import SpanBatch
from tangram.contract.state import Prefetch

Req = TypeVar("Req")
Rep = TypeVar("Rep")

PREFIX: Final = "tangram.v1"
RESULTS_PREFIX: Final = f"{PREFIX}.results"
SCHED_NODES_PREFIX: Final = f"{PREFIX}.sched.nodes"
GATEWAY_PREFIX: Final = f"{PREFIX}.gateway"
# an admin client asks here (see admin_of): mesh-wide registrations too
ADMIN_PREFIX: Final = f"{PREFIX}.admin"

GATEWAY_QUEUE: Final = "gateway"
SCHEDULER_QUEUE: Final = "scheduler"

# What the gateway answers (besides ErrorReply); what the scheduler answers on its action subject.
GatewayAnswer = Accepted | ActionResult | Pending | Done | Services | Quotas | Submitted
SchedulerAnswer = Ack | Services
# The read-only questions the scheduler answers on its status subject, and its answers.
StatusRequest = StatusQuery | ResourcesQuery
StatusAnswer = SchedulerStatus | Resources


@dataclass(frozen=True)
class Endpoint(Generic[Req, Rep]):
    """A subject with the request type it accepts and the reply type it answers.

    ``request``/``reply`` are the runtime types (often unions, which ``type[...]`` cannot
    express), so the type parameters are given explicitly: ``Endpoint[Req, Rep](...)``.
    ``queue`` is the queue group its servers join ("" = every server gets every message).
    """

    subject: str
    request: Any
    reply: Any
    queue: str = ""


# The operator's door (and, on a mesh without auth, every client's): its requests have no owner.
GATEWAY: Final = Endpoint[GatewayRequest, GatewayAnswer](
    GATEWAY_PREFIX, GatewayRequest, GatewayAnswer, GATEWAY_QUEUE
)
# What the gateway serves of the clients: each client's own subject (see gateway_of).
GATEWAY_CLIENTS: Final = Endpoint[GatewayRequest, GatewayAnswer](
    f"{GATEWAY_PREFIX}.*", GatewayRequest, GatewayAnswer, GATEWAY_QUEUE
)
# ... and each admin client's own admin subject (see admin_of).
GATEWAY_ADMINS: Final = Endpoint[GatewayRequest, GatewayAnswer](
    f"{ADMIN_PREFIX}.*", GatewayRequest, GatewayAnswer, GATEWAY_QUEUE
)
SCHED_ACTIONS: Final = Endpoint[SchedulerRequest, SchedulerAnswer](
    f"{PREFIX}.sched.actions", SchedulerRequest, SchedulerAnswer, SCHEDULER_QUEUE
)
# What the scheduler serves of the node agents: every node's own subject (see sched_node).
SCHED_NODES: Final = Endpoint[NodeMessage, Ack](
    f"{SCHED_NODES_PREFIX}.>", NodeMessage, Ack, SCHEDULER_QUEUE
)
# Read-only questions (status, resources): what the dashboard and the operator may ask.
SCHED_STATUS: Final = Endpoint[StatusRequest, StatusAnswer](
    f"{PREFIX}.sched.status", StatusRequest, StatusAnswer, SCHEDULER_QUEUE
)
# The scheduler's load, every tick, to every gateway (no queue group): admission control.
SCHED_PRESSURE: Final = Endpoint[Pressure, None](f"{PREFIX}.sched.pressure", Pressure, None)
# Finished spans from every service, fire-and-forget, to the dashboard that stores them.
SPANS: Final = Endpoint[SpanBatch, None](f"{PREFIX}.spans", SpanBatch, None, "dashboard")
# A command (Reconcile) to every node agent: no queue group, so each agent gets it.
NODES_BROADCAST: Final = Endpoint[NodeCommand, Ack](f"{PREFIX}.nodes.all", NodeCommand, Ack)
# Heartbeats of the gateways and the schedulers (leader and standbys), fire-and-forget, to
# every scheduler that listens (the leader): one subject per role, so the broker lets a role's
# credential beat for that role alone (see auth.ROUTES).
GATEWAY_BEATS: Final = Endpoint[ServiceBeat, None](f"{PREFIX}.beats.gateway", ServiceBeat, None)
SCHEDULER_BEATS: Final = Endpoint[ServiceBeat, None](f"{PREFIX}.beats.scheduler", ServiceBeat, None)


def sched_node(node_id: str) -> Endpoint[NodeMessage, Ack]:
    """Where node agent ``node_id`` sends its reports, completions and goodbyes: a subject of
    its own, so the broker lets a node's credential speak for that node alone."""
    return Endpoint[NodeMessage, Ack](
        f"{SCHED_NODES_PREFIX}.{node_id}", NodeMessage, Ack, SCHEDULER_QUEUE
    )


def gateway_of(client_id: str) -> Endpoint[GatewayRequest, GatewayAnswer]:
    """Where the client credential ``client_id`` asks the gateway: a subject of its own, so
    the broker lets a client speak for itself alone and the gateway knows who asks (the
    owner of what it submits) without trusting the message."""
    return Endpoint[GatewayRequest, GatewayAnswer](
        f"{GATEWAY_PREFIX}.{client_id}", GatewayRequest, GatewayAnswer, GATEWAY_QUEUE
    )


def admin_of(client_id: str) -> Endpoint[GatewayRequest, GatewayAnswer]:
    """Where the admin client ``client_id`` asks the gateway: as :func:`gateway_of`, and the
    broker lets only admin credentials publish here, so a request heard here may change the
    whole mesh (register a model service, set a quota)."""
    return Endpoint[GatewayRequest, GatewayAnswer](
        f"{ADMIN_PREFIX}.{client_id}", GatewayRequest, GatewayAnswer, GATEWAY_QUEUE
    )


def prefetch(node_id: str) -> Endpoint[Prefetch, Ack]:
    """Prefetch hints to one GPU node (fire-and-forget; a request gets Ack or an error)."""
    return Endpoint[Prefetch, Ack](f"{PREFIX}.node.{node_id}.prefetch", Prefetch, Ack)


def node(node_id: str) -> Endpoint[NodeCommand, Ack]:
    """The command endpoint of one node agent."""
    return Endpoint[NodeCommand, Ack](f"{PREFIX}.node.{node_id}", NodeCommand, Ack)


def results(client_id: str) -> str:
    """The subject where the results of one client's actions are pushed."""
    return f"{RESULTS_PREFIX}.{client_id}"


def result_push(reply_subject: str) -> Endpoint[ActionResult | list[ActionResult], None]:
    """Where to push finished actions' results: the ``reply_subject`` their submitter named;
    one result, or the results of one client that ended together (a list)."""
    return Endpoint[ActionResult | list[ActionResult], None](
        reply_subject, ActionResult | list[ActionResult], None
    )
