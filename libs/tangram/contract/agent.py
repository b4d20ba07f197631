"""Scheduler ↔ node agent: commands to an agent, and the facts an agent reports back.

An agent reports facts only (``Outcome``: exit code or failure kind, output, timings); the
scheduler alone turns them into the user's ``ActionResult``.
"""

from __future__ import annotations

from tangram.contract.base import NodeId, Timestamp, _Msg
from tangram.contract.errors import ErrorKind
from tangram.contract.scheduler import UnifiedAction


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


class Completion(_Msg, tag="completion"):
    """A node agent's report that an attempt ended. Re-sent until the scheduler acks it."""

    node_id: NodeId
    incarnation: str
    action_id: str
    attempt: int
    outcome: Outcome


class Progress(_Msg):
    """Facts for a health detector: how many dispatches this incarnation started and how many
    of those ended, and when either last happened (the agent's wall clock, seconds)."""

    started: int = 0
    finished: int = 0
    last_progress_at: Timestamp | None = None


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
