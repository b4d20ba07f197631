"""The resource engines the simulator drives, one per kind of pool.

- ``CoreEngine`` — CPU nodes through the scheduler's own pure core (``SchedulerCore``): the same
  code the live scheduler runs (policy hooks included), fed with the same messages.
- ``PodEngine`` — the trajectory-static baseline of the figures (a pod per trajectory, as
  Kubernetes does it, bound to the node with the fewest trajectories), per node with
  ``TrajectoryStaticPolicy``; a model of that baseline outside the core. The same policy through
  the core, as the live scheduler runs it, is ``CoreEngine`` (``Simulator(pods=False)``).
- ``SharedEngine`` — cluster-wide pools: GPUs in buddy chunks (Algorithm 4) and API quotas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from services.scheduler.core.effects import StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.base import Policy, Running, Waiting
from services.scheduler.policies.chunks import CHUNK_SIZES, chunk_level
from services.scheduler.policies.elastic import ElasticPolicy, fits_chunks_at_min
from services.scheduler.policies.static import TrajectoryStaticPolicy
from services.scheduler.sim.traces import Step
from tangram.contract import (
    ActionSpec,
    Completion,
    Demand,
    DurationHint,
    ExecAction,
    Inventory,
    NodeReport,
    NumaCores,
    Outcome,
    UnifiedAction,
)

NODE_MEMORY_MB = 2_400_000
P = TypeVar("P", bound=Policy)
Started = tuple[str, int]  # (action_id, units)


@dataclass(frozen=True, slots=True)
class SimAction:
    action_id: str
    trajectory_id: str
    step: Step
    submitted_at: float

    def waiting(self) -> Waiting:
        s = self.step
        return Waiting(
            self.action_id,
            s.choices,
            self.submitted_at,
            s.profile,
            s.t_ori_s if s.hinted else None,
            s.parallel_fraction if s.hinted else None,
            self.trajectory_id,
        )


class CoreEngine:
    """CPU nodes scheduled by ``SchedulerCore`` with the given policy."""

    def __init__(self, policy: Policy, nodes: int, cores: int, numa: int = 2) -> None:
        self.core = SchedulerCore(policy, CoreConfig(queue_timeout_s=None))  # queues are measured
        self._running: dict[str, tuple[StartOnNode, float]] = {}
        for n in range(nodes):
            self.core.node_report(sim_node(f"node-{n}", cores, numa), 0.0)

    def submit(self, a: SimAction, now: float) -> None:
        self.core.enqueue(unified(a), now)

    def schedule(self, now: float) -> list[Started]:
        out: list[Started] = []
        for e in self.core.schedule(now):
            if isinstance(e, StartOnNode):
                self._running[e.action.spec.action_id] = (e, now)
                out.append((e.action.spec.action_id, len(e.cores)))
        return out

    def complete(self, action_id: str, now: float) -> None:
        start, t0 = self._running.pop(action_id)
        outcome = Outcome(exit_code=0, started_at=t0, finished_at=now)
        done = Completion(
            node_id=start.node_id,
            incarnation=start.incarnation,
            action_id=action_id,
            attempt=start.action.attempt,
            outcome=outcome,
        )
        self.core.complete(done, now)  # a policy that learns is told by the core, as live

    def close(self, trajectory_id: str, now: float) -> None:
        self.core.close_env(trajectory_id, now)


def sim_node(node_id: str, cores: int, numa: int) -> NodeReport:
    """The registration a simulated node sends: ``cores`` split evenly over ``numa`` nodes."""
    per = cores // numa
    inv = Inventory(
        numa=tuple(
            NumaCores(numa_node=k, cores=tuple(range(k * per, (k + 1) * per))) for k in range(numa)
        ),
        memory_mb=NODE_MEMORY_MB,
        backend="sim",
        isolates=False,
    )
    return NodeReport(node_id=node_id, incarnation="sim", inventory=inv, full=True)


def unified(a: SimAction) -> UnifiedAction:
    """The message the gateway would hand the scheduler for this action."""
    s = a.step
    hint = DurationHint(t_ori_s=s.t_ori_s, parallel_fraction=s.parallel_fraction)
    spec = ActionSpec(
        action_id=a.action_id,
        job_id="sim",
        trajectory_id=a.trajectory_id,
        action=ExecAction(command="true"),
        profile=s.profile,
        cpus=s.choices[0] if len(s.choices) == 1 else [s.choices[0], s.choices[-1]],
        duration=hint if s.hinted else None,
    )
    return UnifiedAction(
        spec=spec,
        demands=(Demand(resource="cpu", choices=s.choices),),
        key_resource="cpu",
        env_memory_mb=512,
        submitted_at=a.submitted_at,
    )


@dataclass
class _Pool(Generic[P]):
    capacity: int
    policy: P
    waiting: list[SimAction] = field(default_factory=list)
    running: dict[str, Running] = field(default_factory=dict)
    trajectories: int = 0

    @property
    def free(self) -> int:
        return self.capacity - sum(b.units for b in self.running.values())


class PodEngine:
    """Trajectory-static: nodes with one ``TrajectoryStaticPolicy`` each; a trajectory is bound
    to the node with the fewest trajectories at its first action."""

    def __init__(self, units: int, nodes: int, cores: int) -> None:
        self._pools = [_Pool(cores, TrajectoryStaticPolicy(units)) for _ in range(nodes)]
        self._node: dict[str, int] = {}
        self._where: dict[str, int] = {}

    def submit(self, a: SimAction, now: float) -> None:
        if a.trajectory_id not in self._node:
            n = min(range(len(self._pools)), key=lambda i: (self._pools[i].trajectories, i))
            self._node[a.trajectory_id] = n
            self._pools[n].trajectories += 1
        self._pools[self._node[a.trajectory_id]].waiting.append(a)

    def schedule(self, now: float) -> list[Started]:
        return [s for i, p in enumerate(self._pools) for s in self._admit(i, p, now)]

    def _admit(self, i: int, p: _Pool[TrajectoryStaticPolicy], now: float) -> list[Started]:
        if not p.waiting:
            return []
        grants = p.policy.arrange(
            [a.waiting() for a in p.waiting], p.free, p.capacity, list(p.running.values()), now
        )
        started = [(a, g) for a, g in zip(p.waiting, grants, strict=False) if g > 0]
        gone = {a.action_id for a, _ in started}
        p.waiting = [a for a in p.waiting if a.action_id not in gone]
        for a, g in started:
            p.running[a.action_id] = Running(a.action_id, g, now, trajectory_id=a.trajectory_id)
            self._where[a.action_id] = i
        return [(a.action_id, g) for a, g in started]

    def complete(self, action_id: str, now: float) -> None:
        del self._pools[self._where.pop(action_id)].running[action_id]

    def close(self, trajectory_id: str, now: float) -> None:
        pool = self._pools[self._node.pop(trajectory_id)]
        pool.trajectories -= 1
        pool.policy.close_trajectory(trajectory_id)


class SharedEngine:
    """One cluster-wide pool: GPUs (``gpus_per_node`` per node, buddy chunks) or a quota."""

    def __init__(self, policy: Policy, capacity: int, gpus_per_node: int | None = None) -> None:
        self._pool = _Pool(capacity, policy)
        self._gpn = gpus_per_node
        self._chunks: dict[str, tuple[int, int, int]] = {}  # action -> (node, start, size)
        self._free: list[tuple[int, int, int]] = (
            [(n, 0, gpus_per_node) for n in range(capacity // gpus_per_node)]
            if gpus_per_node
            else []
        )

    def submit(self, a: SimAction, now: float) -> None:
        self._pool.waiting.append(a)

    def schedule(self, now: float) -> list[Started]:
        p = self._pool
        if not p.waiting:
            return []
        waiting = [a.waiting() for a in p.waiting]
        grants = self._grants(waiting, now)
        started = list(zip(p.waiting, grants, strict=False))
        p.waiting = p.waiting[len(started) :]
        for a, g in started:
            p.running[a.action_id] = Running(a.action_id, g, now)
            if self._gpn:
                self._chunks[a.action_id] = self._take(g)
        return [(a.action_id, g) for a, g in started]

    def _grants(self, waiting: list[Waiting], now: float) -> list[int]:
        p = self._pool
        running = list(p.running.values())
        if not self._gpn:
            return p.policy.arrange(waiting, p.free, p.capacity, running, now)
        counts = self.free_chunks()
        if isinstance(p.policy, ElasticPolicy):
            return p.policy.arrange_chunks(waiting, counts, running, now)
        grants = p.policy.arrange(waiting, p.free, p.capacity, running, now)
        ok = fits_chunks_at_min(
            [Waiting(w.action_id, (g,), 0.0) for w, g in zip(waiting, grants, strict=False)], counts
        )
        return grants[:ok]

    def free_chunks(self) -> tuple[int, int, int, int]:
        sizes = [s for _, _, s in self._free]
        c = [sizes.count(s) for s in CHUNK_SIZES]
        return c[0], c[1], c[2], c[3]

    def _take(self, units: int) -> tuple[int, int, int]:
        """Smallest free chunk that holds ``units``, split into buddies (§5.3)."""
        size = 1 << chunk_level(units)
        node, start, have = min((c for c in self._free if c[2] >= size), key=lambda c: (c[2], c))
        self._free.remove((node, start, have))
        while have > size:
            have //= 2
            self._free.append((node, start + have, have))
        return node, start, size

    def complete(self, action_id: str, now: float) -> None:
        del self._pool.running[action_id]
        chunk = self._chunks.pop(action_id, None)
        if chunk is not None:
            self._give_back(chunk)

    def _give_back(self, chunk: tuple[int, int, int]) -> None:
        node, start, size = chunk
        while size < (self._gpn or 0):
            buddy = (node, start ^ size, size)
            if buddy not in self._free:
                break
            self._free.remove(buddy)
            start, size = min(start, buddy[1]), size * 2
        self._free.append((node, start, size))

    def close(self, trajectory_id: str, now: float) -> None:
        return None


Engine = CoreEngine | PodEngine | SharedEngine
EngineFactory = Callable[[str], Engine]
