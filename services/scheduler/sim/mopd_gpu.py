"""Figure 8(b)'s workload on GPUs: multi-teacher distillation (MOPD) against pooled reward
services, through the live scheduler core, and its two baselines.

Workload: ``batch`` trajectories (the paper's RL batch size, §6.3: trajectories per batch);
each makes 1-3 calls to teacher services drawn from 10 of different sizes (weights 3-70 GB);
the calls come in bursts (rollouts finish together, every ``burst_period_s``), each burst one
task domain calling ``hot`` of the teachers. A call's time on ``m`` GPUs is Amdahl's (``t1_s``
on one GPU, parallel fraction ``parallel``). These workload figures are ours (the paper gives
no trace) and were left as they were; what changed is how the systems are modelled.

Policies (``run``), all on the same ``gpus`` (40: the paper's five 8-GPU nodes, §6.1):
- ``elastic`` -- Tangram: the scheduler core (elastic DoP over buddy chunks, Algorithm 4,
  residency-aware, restore cost in the duration) on pooled GPUs. The simulated agents keep
  each GPU's memory with LRU eviction and report residency after every change, as the
  gpu_manager does; a call whose variant is not resident on its chunk first restores it
  (footprint / the measured restore bandwidth) and evicts without write-back (EOE, §5.3).
- ``maas`` -- model-as-a-service without elastic reallocation (the ServerlessLLM baseline):
  the same pooled GPUs, restores and LRU, through the same core with the ``min`` policy: every
  call on its service's fixed deployment (its smallest variant: the fewest GPUs that hold it),
  replicas scaled per call, FCFS.
- ``dedicated`` -- SGLang: one server per service with tensor parallelism over 4 GPUs, always
  resident, serving its calls FCFS.

Modelling notes (each a fix of an earlier departure from the paper or from the systems):
- Dedicated is the paper's baseline, 4 GPUs per model with TP (§6.1: "for MOPD+Search, 10
  reward services ... each model with four GPUs with TP"; §6.3's "over-provisioned baseline"
  for 10 services = 40 GPUs). It was a load-proportional split into 1-GPU replicas, a
  deployment that needs the load known in advance and is not what the paper measured.
- Every teacher offers every chunk level its memory allows (DoP 1/2/4/8, §5.3: a ∈ {0..3};
  the 70 GB ones from 2). Small teachers were capped at DoP 2 and medium ones at 4, so elastic
  could not take a larger chunk when the pool was idle, and the SGLang baseline's TP=4 did not
  exist for them.
- Batching: the same rule for all three, one call at a time per server or chunk. A teacher
  call computes log-probabilities of a whole trajectory: a prefill of thousands of tokens,
  compute-bound (arithmetic intensity ~L FLOP/byte for L tokens in bf16 against a Hopper
  GPU's ~300 FLOP/byte ridge), so batching b calls takes about b times one call's compute:
  it adds no throughput, and SGLang's prefill token budget (chunked prefill) holds about one
  such trajectory per pass, serving them in arrival order. ``t1_s`` is that compute. The
  earlier attempt that co-batched calls for free in the pooled policies modelled compute that
  does not exist; so ``max_batch=1`` for the pooled services and FCFS per dedicated server.
- Pool layout: ``gpus`` GPUs as 8-GPU nodes plus one node with the rest (12 GPUs: 8 + 4), so
  the search over GPU counts (``bench/fig8b.py``) runs the real buddy rule on legal nodes; it
  was ``gpus // 8`` equal nodes (12 GPUs became one 12-GPU node).
- A call never served (no node can hold its teacher) makes the ACT infinite instead of being
  left out of the average.
- The simulated agents list the calls they run in every report, as the gpu_manager does
  (the core otherwise redoes an unlisted dispatch after its grace, double-booking GPUs), and
  report at the simulated time. A pass is skipped when every GPU is busy: with one call per
  chunk it could start nothing (same decisions, checked; the run takes a fraction as long).
- Restores are charged at the agent's measured bandwidth (``bench/results/gpu.json``) for the
  whole model, not per GPU shard in parallel: the conservative reading, and the one the
  scheduler core itself prices grants with.

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
    RunningAction,
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


# Ten teachers of different sizes (1.5B-35B-like in bf16); every DoP level their memory
# allows: the 70 GB ones need two 80 GB GPUs.
TEACHERS = (
    Teacher("t0", 3, (1, 2, 4, 8), 0.6),
    Teacher("t1", 3, (1, 2, 4, 8), 0.6),
    Teacher("t2", 8, (1, 2, 4, 8), 1.2),
    Teacher("t3", 8, (1, 2, 4, 8), 1.2),
    Teacher("t4", 16, (1, 2, 4, 8), 2.0),
    Teacher("t5", 16, (1, 2, 4, 8), 2.0),
    Teacher("t6", 30, (1, 2, 4, 8), 3.5),
    Teacher("t7", 30, (1, 2, 4, 8), 3.5),
    Teacher("t8", 70, (2, 4, 8), 6.0),
    Teacher("t9", 70, (2, 4, 8), 6.0),
)
DEDICATED_TP = 4  # §6.1: the SGLang baseline gives each model four GPUs with TP


def node_sizes(gpus: int) -> list[int]:
    """``gpus`` GPUs as 8-GPU nodes and one node with the rest."""
    full, rest = divmod(gpus, GPUS_PER_NODE)
    return [GPUS_PER_NODE] * full + ([rest] if rest else [])


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
    calls: int  # calls made: fewer served means some were never (an infinite ACT)
    act_s: dict[int, float] = field(default_factory=dict)  # trajectory -> total ACT
    served: int = 0
    exec_s: float = 0.0  # execution, restores included
    restore_s: float = 0.0

    def add(self, call: Call, done: float, exec_s: float, restore_s: float) -> None:
        self.act_s[call.trajectory] = self.act_s.get(call.trajectory, 0.0) + done - call.at
        self.served += 1
        self.exec_s += exec_s
        self.restore_s += restore_s

    def mean_act(self) -> float:
        if self.served < self.calls:
            return float("inf")
        return float(np.mean(list(self.act_s.values()))) if self.act_s else 0.0

    def restore_share(self) -> float:
        """Restore time over execution time with restores (the paper's Table 1 reading:
        overhead / (execution + overhead))."""
        return self.restore_s / self.exec_s if self.exec_s else 0.0


# ---------------------------------------------------------------------- pooled (core)


@dataclass
class _Node:
    """A simulated gpu_manager: per GPU, an LRU of the (service, dop) variants it holds."""

    node_id: str
    lru: list[OrderedDict[tuple[str, int], int]]  # per GPU: variant -> MiB on that GPU
    running: dict[str, StartOnNode] = field(default_factory=dict)  # what it reports running

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
        # max_batch=1: compute-bound calls gain nothing from batching (module docstring);
        # the dedicated servers follow the same rule.
        specs = [
            ServiceSpec(t.name, f"teachers:{t.name}", dops=t.dops, max_batch=1)
            for t in self.teachers.values()
        ]
        self.core.restore_services(specs)
        self.nodes = {
            f"g{n}": _Node(f"g{n}", [OrderedDict() for _ in range(size)])
            for n, size in enumerate(node_sizes(cfg.gpus))
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
        running = tuple(
            RunningAction(aid, e.action.attempt, "", e.gpus) for aid, e in node.running.items()
        )
        return NodeReport(
            node_id=node.node_id,
            incarnation="sim",
            inventory=inv,
            running=running,
            full=True,
            services=services,
        )

    def run(self, calls: list[Call]) -> Outcomes:
        out = Outcomes(len(calls))
        events: list[tuple[float, int, str]] = []
        by_id = {c.call_id: c for c in calls}
        pending: dict[str, tuple[StartOnNode, float, float]] = {}
        for seq, c in enumerate(calls):
            heapq.heappush(events, (c.at, seq, c.call_id))
        seq, busy = len(calls), 0
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, _, cid = heapq.heappop(events)
                if cid in pending:
                    start, exec_s, restore = pending.pop(cid)
                    busy -= len(start.gpus)
                    self._complete(start, now, exec_s, restore)
                    out.add(by_id[cid], now, exec_s + restore, restore)
                else:
                    self.core.enqueue(_unified(by_id[cid], self.cfg.parallel), now)
            if busy >= self.cfg.gpus:
                continue  # no free GPU: a pass could start nothing (calls never share here)
            for e in self.core.schedule(now):
                if isinstance(e, StartOnNode):
                    busy += len(e.gpus)
                    exec_s, restore = self._start(e, now)
                    pending[e.action.spec.action_id] = (e, exec_s, restore)
                    seq += 1
                    heapq.heappush(events, (now + exec_s + restore, seq, e.action.spec.action_id))
        return out

    def _start(self, e: StartOnNode, now: float) -> tuple[float, float]:
        t = self.teachers[e.service.name if e.service else ""]
        node = self.nodes[e.node_id]
        node.running[e.action.spec.action_id] = e
        dop = len(e.gpus)
        cold = node.restore((t.name, dop), e.gpus, t.footprint_mb(dop))
        restore = t.footprint_mb(dop) / 1024 / self.cfg.restore_gb_per_s if cold else 0.0
        if cold:
            self.core.node_report(self._report(node), now)  # residency changed
        return t.duration(dop, self.cfg.parallel), restore

    def _complete(self, e: StartOnNode, now: float, exec_s: float, restore: float) -> None:
        del self.nodes[e.node_id].running[e.action.spec.action_id]
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


def run_dedicated(cfg: Config, calls: list[Call]) -> Outcomes:
    """One SGLang server per service at TP ``DEDICATED_TP``, always resident, FCFS (calls come
    sorted by arrival). Its GPUs are ``DEDICATED_TP`` per service whatever ``cfg.gpus`` is:
    the baseline is defined by its deployment, not by the pool."""
    out = Outcomes(len(calls))
    free = {t.name: 0.0 for t in TEACHERS[: cfg.services]}
    for c in calls:
        dop = max(DEDICATED_TP, c.teacher.dops[0])
        start = max(free[c.teacher.name], c.at)
        exec_s = c.teacher.duration(dop, cfg.parallel)
        free[c.teacher.name] = start + exec_s
        out.add(c, start + exec_s, exec_s, 0.0)
    return out


def dedicated_gpus(cfg: Config) -> int:
    return sum(max(DEDICATED_TP, t.dops[0]) for t in TEACHERS[: cfg.services])


def run(cfg: Config, policy: str, order: str = "fcfs") -> Outcomes:
    calls = workload(cfg)
    if policy == "dedicated":
        return run_dedicated(cfg, calls)
    return Pooled(cfg, "min" if policy == "maas" else "elastic", order).run(calls)
