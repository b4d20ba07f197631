"""Figure 8(b)'s workload on GPUs: multi-teacher distillation (MOPD) against pooled reward
services, through the live scheduler core, and its two baselines.

Workload: ``batch`` trajectories; each makes 1-3 calls to teacher services drawn from 10 of
different sizes (weights 1-70 GB, DoP variants up to 8 for the large ones); the calls come in
bursts (rollouts finish together, every ``burst_period_s``). A call's time on ``m`` GPUs is
Amdahl's (``t1_s`` on one GPU, parallel fraction ``parallel``).

Policies (``run``):
- ``elastic`` -- Tangram: the scheduler core (elastic DoP over buddy chunks, residency-aware,
  restore cost in the duration) on ``gpus`` pooled GPUs. The simulated agents keep each GPU's
  memory with LRU eviction and report residency after every change, as the gpu_manager does;
  a call whose variant is not resident on its chunk first restores it (footprint / bandwidth).
- ``maas`` -- model-as-a-service without elastic reallocation (the ServerlessLLM baseline): the
  same pooled GPUs and restores, through the same core with the ``min`` policy (every call on
  its service's smallest variant), FCFS.
- ``dedicated`` -- SGLang per service: the GPUs are split among the services in proportion to
  their peak demand (at least one replica each, at the smallest variant), the model stays
  resident, calls queue FCFS per service.

Batching is modelled by none of them (every service has ``max_batch=1``).

The metric is the paper's §6.3 one: total ACT per trajectory, averaged over trajectories.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from services.scheduler.core.effects import StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.spec import make_policy
from tangram.contract import (
    ActionSpec,
    Completion,
    Demand,
    DurationHint,
    GpuDevice,
    InferAction,
    Inventory,
    NodeReport,
    Outcome,
    PreparedService,
    ServiceSpec,
    UnifiedAction,
)

GPU_MEMORY_MB = 80 * 1024
GPUS_PER_NODE = 8


@dataclass(frozen=True, slots=True)
class Teacher:
    name: str
    weights_gb: float
    dops: tuple[int, ...]
    t1_s: float  # one call on one GPU

    def duration(self, m: int, parallel: float) -> float:
        return self.t1_s * ((1.0 - parallel) + parallel / m)

    def footprint_mb(self, dop: int) -> int:
        return int(self.weights_gb * 1024)


# Ten teachers of different sizes (1.5B-70B-like); large ones must span GPUs to fit in memory.
TEACHERS = (
    Teacher("t0", 3, (1, 2), 0.6),
    Teacher("t1", 3, (1, 2), 0.6),
    Teacher("t2", 8, (1, 2, 4), 1.2),
    Teacher("t3", 8, (1, 2, 4), 1.2),
    Teacher("t4", 16, (1, 2, 4), 2.0),
    Teacher("t5", 16, (1, 2, 4), 2.0),
    Teacher("t6", 30, (1, 2, 4, 8), 3.5),
    Teacher("t7", 30, (1, 2, 4, 8), 3.5),
    Teacher("t8", 70, (2, 4, 8), 6.0),
    Teacher("t9", 70, (2, 4, 8), 6.0),
)


@dataclass(frozen=True, slots=True)
class Config:
    batch: int = 1024
    calls: tuple[int, int] = (1, 3)
    bursts: int = 5
    hot: int = 3  # teachers a burst's task domain calls
    burst_period_s: float = 60.0
    parallel: float = 0.85
    gpus: int = 40
    restore_gb_per_s: float = 9.38
    services: int = 10
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Call:
    call_id: str
    trajectory: int
    teacher: Teacher
    at: float


def workload(cfg: Config) -> list[Call]:
    """Bursty MOPD: each burst is one task domain whose trajectories call its ``hot`` teachers
    (so which services are busy shifts from burst to burst, as a dedicated deployment sized for
    each service's own peak cannot follow)."""
    rng = np.random.default_rng(cfg.seed)
    teachers = TEACHERS[: cfg.services]
    domains = [
        rng.choice(len(teachers), min(cfg.hot, len(teachers)), False) for _ in range(cfg.bursts)
    ]
    out = []
    for i in range(cfg.batch):
        burst = int(rng.integers(0, cfg.bursts))
        base = burst * cfg.burst_period_s + float(rng.exponential(2))
        for k in range(int(rng.integers(cfg.calls[0], cfg.calls[1] + 1))):
            t = teachers[int(rng.choice(domains[burst]))]
            out.append(Call(f"c{i}-{k}", i, t, base + k * float(rng.exponential(1.0))))
    return sorted(out, key=lambda c: (c.at, c.call_id))


@dataclass
class Outcomes:
    act_s: dict[int, float] = field(default_factory=dict)  # trajectory -> total ACT
    exec_s: float = 0.0
    restore_s: float = 0.0

    def add(self, call: Call, done: float, exec_s: float, restore_s: float) -> None:
        self.act_s[call.trajectory] = self.act_s.get(call.trajectory, 0.0) + done - call.at
        self.exec_s += exec_s
        self.restore_s += restore_s

    def mean_act(self) -> float:
        return float(np.mean(list(self.act_s.values()))) if self.act_s else 0.0


# ---------------------------------------------------------------------- pooled (core)


@dataclass
class _Node:
    """A simulated gpu_manager: per GPU, an LRU of the (service, dop) variants it holds."""

    node_id: str
    lru: list[OrderedDict[tuple[str, int], int]]  # per GPU: variant -> MiB on that GPU

    def restore(self, variant: tuple[str, int], gpus: tuple[int, ...], mb: int) -> bool:
        """Make ``variant`` resident on ``gpus``; False when it already was (no restore)."""
        if all(variant in self.lru[g] for g in gpus):
            for g in gpus:
                self.lru[g].move_to_end(variant)
            return False
        per_gpu = mb // len(gpus)
        for g in gpus:
            self.lru[g].pop(variant, None)
            while sum(self.lru[g].values()) + per_gpu > GPU_MEMORY_MB and self.lru[g]:
                self._evict(g, self.lru[g].popitem(last=False)[0])
            self.lru[g][variant] = per_gpu
        return True

    def _evict(self, g: int, variant: tuple[str, int]) -> None:
        """Drop the copy of ``variant`` whose chunk holds GPU ``g`` (all of its GPUs)."""
        size = variant[1]
        start = g - g % size
        for other in range(start, start + size):
            self.lru[other].pop(variant, None)

    def where(self, variant: tuple[str, int]) -> tuple[int, ...]:
        return tuple(g for g, held in enumerate(self.lru) if variant in held)


class Pooled:
    """Calls through ``SchedulerCore`` on pooled GPU nodes (``elastic`` or ``maas``)."""

    def __init__(self, cfg: Config, policy: str, order: str = "fcfs") -> None:
        self.cfg = cfg
        core_cfg = CoreConfig(gpu_order=order, queue_timeout_s=None)  # type: ignore[arg-type]
        self.core = SchedulerCore(make_policy(policy), core_cfg)
        self.teachers = {t.name: t for t in TEACHERS[: cfg.services]}
        # max_batch=1: no policy here models batching (a dedicated SGLang server batches
        # too), so the comparison stays like for like; co-batched calls would otherwise run
        # for free beside each other in this model.
        specs = [
            ServiceSpec(t.name, f"teachers:{t.name}", dops=t.dops, max_batch=1)
            for t in self.teachers.values()
        ]
        self.core.restore_services(specs)
        nodes = max(1, cfg.gpus // GPUS_PER_NODE)
        per = cfg.gpus // nodes
        self.nodes = {
            f"g{n}": _Node(f"g{n}", [OrderedDict() for _ in range(per)]) for n in range(nodes)
        }
        for node in self.nodes.values():
            self.core.node_report(self._report(node), 0.0)

    def _report(self, node: _Node) -> NodeReport:
        per = len(node.lru)
        services = tuple(
            PreparedService(
                name=t.name,
                dop=d,
                footprint_mb=t.footprint_mb(d),
                resident=node.where((t.name, d)),
            )
            for t in self.teachers.values()
            for d in t.dops
            if d <= per
        )
        inv = Inventory(
            kind="gpu",
            gpus=tuple(GpuDevice(index=i, memory_mb=GPU_MEMORY_MB) for i in range(per)),
            restore_gb_per_s=self.cfg.restore_gb_per_s,
        )
        return NodeReport(
            node_id=node.node_id, incarnation="sim", inventory=inv, full=True, services=services
        )

    def run(self, calls: list[Call]) -> Outcomes:
        out = Outcomes()
        events: list[tuple[float, int, str]] = []
        by_id = {c.call_id: c for c in calls}
        pending: dict[str, tuple[StartOnNode, float, float]] = {}
        for seq, c in enumerate(calls):
            heapq.heappush(events, (c.at, seq, c.call_id))
        seq = len(calls)
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, _, cid = heapq.heappop(events)
                if cid in pending:
                    start, exec_s, restore = pending.pop(cid)
                    self._complete(start, now, exec_s, restore)
                    out.add(by_id[cid], now, exec_s + restore, restore)
                else:
                    self.core.enqueue(_unified(by_id[cid], self.cfg.parallel), now)
            for e in self.core.schedule(now):
                if isinstance(e, StartOnNode):
                    exec_s, restore = self._start(e)
                    pending[e.action.spec.action_id] = (e, exec_s, restore)
                    seq += 1
                    heapq.heappush(events, (now + exec_s + restore, seq, e.action.spec.action_id))
        return out

    def _start(self, e: StartOnNode) -> tuple[float, float]:
        t = self.teachers[e.service.name if e.service else ""]
        node = self.nodes[e.node_id]
        dop = len(e.gpus)
        cold = node.restore((t.name, dop), e.gpus, t.footprint_mb(dop))
        restore = t.footprint_mb(dop) / 1024 / self.cfg.restore_gb_per_s if cold else 0.0
        if cold:
            self.core.node_report(self._report(node), 0.0)  # residency changed
        return t.duration(dop, self.cfg.parallel), restore

    def _complete(self, e: StartOnNode, now: float, exec_s: float, restore: float) -> None:
        outcome = Outcome(started_at=now - exec_s - restore, finished_at=now, restore_s=restore)
        done = Completion(
            node_id=e.node_id,
            incarnation=e.incarnation,
            action_id=e.action.spec.action_id,
            attempt=e.action.attempt,
            outcome=outcome,
        )
        self.core.complete(done, now)


def _unified(c: Call, parallel: float) -> UnifiedAction:
    """The call as the gateway formulates it, with the teacher's profiled duration as a hint."""
    spec = ActionSpec(
        action_id=c.call_id,
        job_id="mopd",
        trajectory_id="",
        action=InferAction(service=c.teacher.name),
        duration=DurationHint(t_ori_s=c.teacher.t1_s, parallel_fraction=parallel),
    )
    return UnifiedAction(
        spec=spec,
        demands=(Demand(resource="gpu", choices=()),),
        key_resource="gpu",
        env_memory_mb=0,
        submitted_at=c.at,
    )


# ---------------------------------------------------------------------- dedicated


def dedicated_shares(cfg: Config, calls: list[Call]) -> dict[str, int]:
    """GPUs per service in proportion to its peak GPU-seconds in a burst (a replica at its
    smallest variant each at least): sizing for peak, as a per-service deployment must."""
    teachers = TEACHERS[: cfg.services]
    work = {t.name: 0.0 for t in teachers}
    for c in calls:
        work[c.teacher.name] += (
            c.teacher.duration(c.teacher.dops[0], cfg.parallel) * c.teacher.dops[0]
        )
    total = sum(work.values()) or 1.0
    share = {t.name: t.dops[0] for t in teachers}
    spare = cfg.gpus - sum(share.values())
    for t in sorted(teachers, key=lambda t: -work[t.name]):
        extra = int(spare * work[t.name] / total) // t.dops[0] * t.dops[0]
        share[t.name] += extra
    left = cfg.gpus - sum(share.values())
    for t in sorted(teachers, key=lambda t: -work[t.name]):
        if left >= t.dops[0]:
            share[t.name] += t.dops[0]
            left -= t.dops[0]
    return share


def run_dedicated(cfg: Config, calls: list[Call]) -> Outcomes:
    """Each service's replicas (its smallest variant, always resident) serve its calls FCFS."""
    out = Outcomes()
    share = dedicated_shares(cfg, calls)
    free: dict[str, list[float]] = {
        t.name: [0.0] * max(1, share[t.name] // t.dops[0]) for t in TEACHERS[: cfg.services]
    }
    for c in calls:
        replicas = free[c.teacher.name]
        ready = heapq.heappop(replicas)
        start = max(ready, c.at)
        exec_s = c.teacher.duration(c.teacher.dops[0], cfg.parallel)
        heapq.heappush(replicas, start + exec_s)
        out.add(c, start + exec_s, exec_s, 0.0)
    return out


def run(cfg: Config, policy: str, order: str = "fcfs") -> Outcomes:
    calls = workload(cfg)
    if policy == "dedicated":
        return run_dedicated(cfg, calls)
    return Pooled(cfg, "min" if policy == "maas" else "elastic", order).run(calls)
