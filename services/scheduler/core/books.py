"""The scheduler core's records: nodes, trajectory environments and dispatched actions."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tangram.contract import PreparedService, UnifiedAction

if TYPE_CHECKING:
    from services.scheduler.core.effects import StartOnNode


@dataclass
class Node:
    node_id: str
    incarnation: str
    numa: dict[int, tuple[int, ...]]
    memory_mb: int
    free: set[int]
    last_seen: float
    reserved_mb: int = 0
    draining: bool = False  # shutting down: what runs finishes, nothing new starts
    kind: str = "cpu"  # "gpu": ``free`` holds GPU indices and ``gpu`` its GPU facts
    gpu: GpuFacts | None = None
    # pipelining: a busy core -> the actions granted it next, in order, waiting on the node
    next: dict[int, list[str]] = field(default_factory=dict)
    on_disk: set[str] = field(default_factory=set)  # its envs saved to disk (env_tiers)
    idle_envs_hold_memory: bool = True  # False: only envs with an action running are booked
    envs_seen: frozenset[str] = frozenset()  # the environments its last full report held
    # the running mean of its actions' run times (exec_s; inf: none ended yet), which sets
    # how deep it is pipelined (CoreConfig.pipeline_depth_short)
    run_s: float = math.inf

    @property
    def capacity(self) -> int:
        return sum(len(c) for c in self.numa.values())


@dataclass
class GpuFacts:
    """What a GPU node offers besides free GPU indices: the devices in chunk order, those not
    to grant (``down``: reported lost, or ``absent`` from its latest inventory), its restore
    bandwidth, and its latest services report keyed by (service, dop)."""

    gpus: tuple[int, ...]
    restore_gb_per_s: float
    links: tuple[int, ...] = ()  # per position: the host link it restores through (gpu.py)
    gather_gb_per_s: float = 0.0
    down: set[int] = field(default_factory=set)
    absent: set[int] = field(default_factory=set)
    services: dict[tuple[str, int], PreparedService] = field(default_factory=dict)
    asked: dict[str, float] = field(default_factory=dict)  # service -> when Prepare was sent


@dataclass
class EnvPlacement:
    """Where a trajectory's environment lives, and the memory booked for it there."""

    trajectory_id: str
    job_id: str
    node_id: str
    incarnation: str
    memory_mb: int
    last_used: float = 0.0  # when an action last started in it (restored: 0, the oldest)
    on_disk: bool = False  # saved to disk by its node: no memory booked (env_tiers)


@dataclass
class Dispatched:
    """An action sent to (or restored on) a node, with the cores booked for it."""

    action: UnifiedAction
    node_id: str
    incarnation: str
    cores: tuple[int, ...]
    started_at: float
    confirmed: bool = False  # its node has reported it at least once
    restored: bool = False  # rebuilt from Postgres after a restart, not dispatched by us
    kill_by: float | None = None  # cancelled: ends ``cancelled`` at this time if not confirmed
    sent: StartOnNode | None = None  # the dispatch, to send once more if the node never read it
    sent_at: float | None = None  # when it was last sent (None: at ``started_at``)
