"""Scheduler ↔ node agent: commands to an agent, and the facts an agent reports back.

An agent reports facts only (``Outcome``: exit code or failure kind, output, timings); the
scheduler alone turns them into the user's ``ActionResult``.
"""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta

from tangram.contract.base import MAX_BATCH_ITEMS, NodeId, Timestamp, _Msg
from tangram.contract.client import HttpResponse
from tangram.contract.errors import ErrorKind
from tangram.contract.resources import QuotaSpec, ServiceSpec
from tangram.contract.scheduler import UnifiedAction

# What a GPU agent reports is priced by the scheduler (a restore's seconds): bounded so that no
# report makes a price negative, NaN or infinite (NaN and inf fail the bounds).
GbPerS = Annotated[float, Meta(ge=0, le=1e6)]
MAX_LINK = 1 << 16


class NumaCores(_Msg):
    numa_node: int
    cores: tuple[int, ...]


class GpuDevice(_Msg):
    """One GPU of a GPU node (on a machine without GPUs: a CPU "device" with a budget)."""

    index: int
    memory_mb: int
    name: str = ""
    # the host -> device link this device restores through: devices with one id share it
    # (CPU stand-ins: all one memory system); -1, not reported: the chunk restores through
    # one link (an older agent copies a variant through its first device)
    link: Annotated[int, Meta(ge=-1, le=MAX_LINK)] = -1


class Inventory(_Msg):
    """What an agent offers. ``kind`` says which actions it runs: ``cpu`` (exec: ``numa``
    cores), ``gpu`` (infer: ``gpus``, buddy chunks of them), ``quota`` (http calls)."""

    numa: tuple[NumaCores, ...] = ()
    memory_mb: int = 0
    backend: str = ""
    isolates: bool = False
    # False: an environment holds node memory only while an action runs in it (the process
    # backend's is a directory); an idle one books none and is never reclaimed for memory
    idle_envs_hold_memory: bool = True
    kind: str = "cpu"
    gpus: tuple[GpuDevice, ...] = ()
    restore_gb_per_s: GbPerS = 0.0  # host -> device copy bandwidth the agent measured, per link
    # device -> device bandwidth of the gather that follows a restore of slices through several
    # devices' links onto the device the model runs on (0: none: the slices land there directly)
    gather_gb_per_s: GbPerS = 0.0


class PreparedService(_Msg):
    """A service on a GPU node: ready (built, host copy kept, ``footprint_mb`` measured) or
    ``error`` (the factory failed to import or build); ``resident`` GPU indices hold it now."""

    name: str
    dop: int = 1
    footprint_mb: Annotated[int, Meta(ge=0, le=16 * 1024 * 1024)] = 0  # a restore's bytes
    resident: tuple[int, ...] = ()
    error: str = ""
    # since the agent started: calls of this variant run, and the batches (forward passes)
    # they were coalesced into
    calls: int = 0
    batches: int = 0
    # of those calls, how many found the service on their device already / all in host
    # memory (the rest were promoted from disk first)
    device_hits: int = 0
    host_hits: int = 0


class RunningAction(_Msg):
    action_id: str
    attempt: int
    trajectory_id: str
    cores: tuple[int, ...]
    # a pipelined dispatch that has not started (see ``Dispatch.after``); a report lists the
    # waiting ones in the order they will start, which lets a restarted scheduler rebuild
    # who holds each core and who is next
    waiting: bool = False


class Outcome(_Msg):
    """What a node agent saw of one attempt: facts, never conclusions.

    ``failure`` set means the infrastructure failed or the attempt was killed, and says why
    (``cancelled`` for a kill on request); unset, the command ran to ``exit_code``. Output is
    already capped by the agent so that the whole completion fits one message.
    """

    failure: ErrorKind | None = None
    detail: str = ""
    exit_code: int | None = None
    stdout: str = ""
    stderr: str = ""
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    started_at: float | None = None
    finished_at: float | None = None
    output: Any = None  # infer: the handler's output for this payload
    http: HttpResponse | None = None  # http: the upstream's last answer
    restore_s: float = 0.0  # infer: time spent restoring the service onto its GPUs
    tokens_used: int | None = None  # http: tokens the call really spent (from the response)


class Completion(_Msg, tag="completion"):
    """A node agent's report that an attempt ended. Re-sent until the scheduler acks it."""

    node_id: NodeId
    incarnation: str
    action_id: str
    attempt: int
    outcome: Outcome


class Progress(_Msg):
    """Facts for a health detector: how many dispatches this incarnation started and how many
    of those ended, and when either last happened (the agent's wall clock, seconds).

    The start phase (see ``tangram.agent.starts``): ``spawned`` counts the launches its
    executor ended (a process spawned, a request handed to a container, model calls entered
    the runner, an HTTP call handed to the client; or failed at that step), ``spawning`` how
    many are under way now, each holding what it needs (never one waiting for a core, a chunk
    or a slot another action holds). Both additive: an older agent reports 0, 0."""

    started: int = 0
    finished: int = 0
    last_progress_at: Timestamp | None = None
    spawned: Annotated[int, Meta(ge=0)] = 0
    spawning: Annotated[int, Meta(ge=0)] = 0


class NodeReport(_Msg, tag="node_report"):
    """Registration and heartbeat of a node agent: who it is, what runs there, what it holds."""

    node_id: NodeId
    incarnation: str
    inventory: Inventory
    running: tuple[RunningAction, ...] = ()
    envs: tuple[str, ...] = ()
    seq: int = 0
    full: bool = False
    progress: Progress | None = None
    services: tuple[PreparedService, ...] = ()  # GPU nodes
    # The newest dispatch this incarnation has taken in (accepted, held or refused): the
    # highest ``Dispatch.issued`` of scheduler epoch ``seen_epoch``. A dispatch issued at or
    # before it that the report does not list never ran, so it may be queued again; one
    # issued after it may still sit unread in the agent's socket (a paused agent).
    seen_epoch: int = 0
    seen: int = 0
    # of ``envs``, those holding no memory now (saved to disk, their containers removed)
    envs_on_disk: tuple[str, ...] = ()


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


class Completions(_Msg, tag="completions"):
    """Completions that ended together, in one message (acked together, once every terminal
    record is committed)."""

    items: Annotated[tuple[Completion, ...], Meta(max_length=MAX_BATCH_ITEMS)]


NodeMessage = Completion | Completions | NodeReport | EnvExpired | NodeLeaving


class Ack(_Msg, tag="ack"):
    """A receipt. Answering a node agent's report it also carries the answering scheduler's
    ``epoch`` (the only way an agent raises its fencing floor) and the ``lease_s`` for which
    the agent may start dispatches, counted from when it sent that report."""

    epoch: int = 0
    lease_s: float = 0.0


# --------------------------------------------------------------------------- node agent


class Dispatch(_Msg, tag="dispatch"):
    """Run an admitted action with exactly its grant: ``cores`` on a CPU node, ``gpus`` (one
    buddy chunk, as a ``dop`` variant of ``service``) on a GPU node; an http action carries its
    ``quota`` (hosts, key name) and the ``tokens`` reserved for it."""

    action: UnifiedAction
    cores: tuple[int, ...] = ()
    epoch: int = 0
    incarnation: str = ""  # the node agent incarnation it is meant for
    gpus: tuple[int, ...] = ()
    service: ServiceSpec | None = None
    quota: QuotaSpec | None = None
    tokens: int = 0
    # Pipelining: cores granted while these actions (dispatched here earlier) still hold them;
    # the agent starts this one the moment they are free, without a round trip.
    after: tuple[str, ...] = ()
    # The scheduler's running count of dispatches in this epoch, echoed back as
    # ``NodeReport.seen``: it proves which dispatches the agent has read.
    issued: Annotated[int, Meta(ge=0)] = 0


class Kill(_Msg, tag="kill"):
    action_id: str
    epoch: int
    reason: ErrorKind = ErrorKind.CANCELLED


class DropEnv(_Msg, tag="drop_env"):
    trajectory_id: str
    epoch: int


class Prepare(_Msg, tag="prepare"):
    """Prepare these services (build, keep a host copy, measure); report them in NodeReport."""

    services: tuple[ServiceSpec, ...]
    epoch: int


class Ping(_Msg, tag="ping"):
    """A health probe on the agent's own command subject, answered with ``Ack`` (an agent
    whose command path is stuck does not answer, even while its heartbeats still go out).

    ``incarnation`` (set by the detector) is the incarnation probed: another one refuses it
    (``invalid_request``), so its answer never counts for the probed one; empty: any.
    ``canary``: answered only once the agent ran a trivial action through its real execution
    path (see ``tangram.agent.shell.Canaries``): a wedged executor under a live bus loop does
    not answer. Both fields are additive: an older agent answers at once, as to a ping."""

    epoch: int = 0
    canary: bool = False
    incarnation: str = ""


class Reconcile(_Msg, tag="reconcile"):
    """A scheduler (re)started with ``epoch``: report everything; ignore older epochs."""

    epoch: int


NodeOrder = Dispatch | Kill | DropEnv | Prepare  # what a Commands batch may carry


class Commands(_Msg, tag="commands"):
    """Several commands for one node, in the order the scheduler decided them: every grant of
    one scheduling pass travels in one message."""

    items: Annotated[
        tuple[Dispatch | Kill | DropEnv | Prepare, ...], Meta(max_length=MAX_BATCH_ITEMS)
    ]
    epoch: int


NodeCommand = Dispatch | Kill | DropEnv | Prepare | Reconcile | Commands | Ping
