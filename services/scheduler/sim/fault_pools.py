"""The pools a fault run (``faults.py``) drives, each through its own ``SchedulerCore``: CPU nodes
for the AI-coding trace (``CpuPools``), GPU nodes holding MOPD's teachers (``GpuPools``, over
``mopd_gpu.Pooled``: LRU residency per GPU, restores at the host tier's bandwidth).

A pool can lose a node: its last heartbeat reaches the core (what it was running is confirmed
there), then everything on it stops and its GPU memory is gone. The core is not told the node
failed: that is the detector's verdict, which the driver delivers after the detection delay.
A node that comes back registers as a new incarnation, empty.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import msgspec

from services.scheduler.core.effects import StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.base import Policy
from services.scheduler.sim.engines import SimAction, sim_node, unified
from services.scheduler.sim.mopd_gpu import Pooled
from services.scheduler.sim.mopd_workload import Config
from services.scheduler.sim.traces import Step
from tangram.contract import (
    ActionSpec,
    Completion,
    Demand,
    DurationHint,
    InferAction,
    NodeReport,
    Outcome,
    RunningAction,
    UnifiedAction,
)


class Pools(Protocol):
    """What the fault driver needs of a set of nodes scheduled by one core."""

    core: SchedulerCore
    restore_s: float  # GPU state restored from the host tier so far (0 on CPU)

    def node_ids(self) -> list[str]: ...

    def action(self, key: str, trajectory_id: str, step: Step, now: float) -> UnifiedAction:
        """The message the gateway would hand the scheduler for this attempt."""
        ...

    def start(self, e: StartOnNode, step: Step, now: float) -> float:
        """The node starts a grant; returns how long it runs (restores included)."""
        ...

    def end(self, e: StartOnNode, now: float) -> None:
        """The node reports the grant succeeded."""
        ...

    def die(self, node_id: str, now: float) -> str:
        """The node sends its last heartbeat and dies; returns its incarnation."""
        ...

    def revive(self, node_id: str, incarnation: str, now: float) -> None:
        """The node is back, empty, as ``incarnation``."""
        ...

    def close(self, trajectory_id: str, now: float) -> None: ...

    def full(self) -> bool:
        """A scheduling pass could start nothing now (every unit is taken)."""
        ...


def _done(e: StartOnNode, started: float, now: float, restore_s: float = 0.0) -> Completion:
    outcome = Outcome(exit_code=0, started_at=started, finished_at=now, restore_s=restore_s)
    return Completion(
        node_id=e.node_id,
        incarnation=e.incarnation,
        action_id=e.action.spec.action_id,
        attempt=e.action.attempt,
        outcome=outcome,
    )


class CpuPools:
    """CPU nodes of ``cores`` cores each, as ``engines.CoreEngine`` runs them."""

    def __init__(self, policy: Policy, nodes: int, cores: int, numa: int = 2) -> None:
        # the driver delivers the detector's verdicts; the core judges no silence itself
        cfg = CoreConfig(queue_timeout_s=None, node_timeouts=False)
        self.core = SchedulerCore(policy, cfg)
        self.restore_s = 0.0
        self._shape = (cores, numa)
        self._incarnation = {f"node-{n}": "sim" for n in range(nodes)}
        self._running: dict[str, dict[str, tuple[StartOnNode, float]]] = {
            n: {} for n in self._incarnation
        }
        for node_id in self._incarnation:
            self.core.node_report(self._report(node_id), 0.0)

    def node_ids(self) -> list[str]:
        return list(self._incarnation)

    def _report(self, node_id: str) -> NodeReport:
        running = tuple(
            RunningAction(aid, e.action.attempt, e.action.spec.trajectory_id, e.cores)
            for aid, (e, _) in self._running[node_id].items()
        )
        base = sim_node(node_id, *self._shape)
        return msgspec.structs.replace(
            base, incarnation=self._incarnation[node_id], running=running
        )

    def action(self, key: str, trajectory_id: str, step: Step, now: float) -> UnifiedAction:
        return unified(SimAction(key, trajectory_id, step, now))

    def start(self, e: StartOnNode, step: Step, now: float) -> float:
        self._running[e.node_id][e.action.spec.action_id] = (e, now)
        return step.duration(len(e.cores))

    def end(self, e: StartOnNode, now: float) -> None:
        _, started = self._running[e.node_id].pop(e.action.spec.action_id)
        self.core.complete(_done(e, started, now), now)

    def die(self, node_id: str, now: float) -> str:
        self.core.node_report(self._report(node_id), now)
        self._running[node_id].clear()
        return self._incarnation[node_id]

    def revive(self, node_id: str, incarnation: str, now: float) -> None:
        self._incarnation[node_id] = incarnation
        self.core.node_report(self._report(node_id), now)

    def close(self, trajectory_id: str, now: float) -> None:
        self.core.close_env(trajectory_id, now)

    def full(self) -> bool:
        return False  # a pass also ends actions whose environment was lost: always run it


class GpuPools:
    """MOPD's GPU nodes with their teachers (``mopd_gpu.Pooled``, elastic): a call whose
    teacher is not resident on its chunk restores it from the host tier first, so the
    teachers a failed node held are restored elsewhere on demand."""

    def __init__(self, cfg: Config) -> None:
        self._pooled = Pooled(cfg, "elastic")
        self.core = self._pooled.core
        self.restore_s = 0.0
        self._parallel = cfg.parallel
        self._times: dict[str, tuple[float, float]] = {}  # action -> (exec_s, restore_s)

    def node_ids(self) -> list[str]:
        return list(self._pooled.nodes)

    def action(self, key: str, trajectory_id: str, step: Step, now: float) -> UnifiedAction:
        spec = ActionSpec(
            action_id=key,
            job_id="mopd",
            trajectory_id="",  # a teacher call needs no environment
            action=InferAction(service=step.profile),
            duration=DurationHint(t_ori_s=step.t_ori_s, parallel_fraction=self._parallel),
        )
        return UnifiedAction(
            spec=spec,
            demands=(Demand(resource="gpu", choices=()),),
            key_resource="gpu",
            env_memory_mb=0,
            submitted_at=now,
        )

    def start(self, e: StartOnNode, step: Step, now: float) -> float:
        # Pooled's own start: residency, LRU eviction, the restore charged at its bandwidth
        exec_s, restore = self._pooled._start(e, now)
        self._times[e.action.spec.action_id] = (exec_s, restore)
        self.restore_s += restore
        return exec_s + restore

    def end(self, e: StartOnNode, now: float) -> None:
        exec_s, restore = self._times.pop(e.action.spec.action_id)
        self._pooled._complete(e, now, exec_s, restore)

    def die(self, node_id: str, now: float) -> str:
        node = self._pooled.nodes[node_id]
        self.core.node_report(self._pooled._report(node), now)
        for aid in node.running:
            self._times.pop(aid, None)
        node.running.clear()
        node.lru = [OrderedDict() for _ in node.lru]  # device memory is gone with the node
        return node.incarnation

    def revive(self, node_id: str, incarnation: str, now: float) -> None:
        node = self._pooled.nodes[node_id]
        node.incarnation = incarnation
        self.core.node_report(self._pooled._report(node), now)

    def close(self, trajectory_id: str, now: float) -> None:
        return None

    def full(self) -> bool:
        # as Pooled.run: one call per chunk, so with no free GPU a pass starts nothing
        return not any(node.free for node in self.core.nodes.values())
