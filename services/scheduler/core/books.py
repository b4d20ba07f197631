"""The scheduler core's records: nodes, trajectory environments and dispatched actions."""

from __future__ import annotations

from dataclasses import dataclass

from tangram.contract import UnifiedAction


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

    @property
    def capacity(self) -> int:
        return sum(len(c) for c in self.numa.values())


@dataclass
class EnvPlacement:
    """Where a trajectory's environment lives, and the memory booked for it there."""

    trajectory_id: str
    job_id: str
    node_id: str
    incarnation: str
    memory_mb: int


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
