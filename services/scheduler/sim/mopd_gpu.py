"""Figure 8(b) on GPUs: the MOPD workload (``mopd_workload``) through the live scheduler core on
pooled GPUs, and its two baselines (``mopd_baselines``).

Policies (``run``), all on ``cfg.gpus`` GPUs but dedicated (which is its deployment):
- ``elastic`` -- Tangram: the scheduler core (elastic DoP over buddy chunks, Algorithm 4,
  residency-aware, restore cost in the duration, FCFS, depth 2: §4.2, §6.1) on pooled GPUs,
  after the step before the measured one (``Config.warmup``: what it left stays resident).
  The simulated agents keep each GPU's weights share (``WEIGHTS_MB``: the rest of its memory
  is the running prefill's) with LRU eviction and report residency after every change, as the
  gpu_manager does; a call whose variant is not resident on its chunk
  first restores it (footprint / the measured restore bandwidth) and evicts without
  write-back (EOE, §5.3). ``order="hrrs"`` orders the candidates by plexrl's HRRS instead.
- ``dedicated`` -- SGLang: one server per teacher, tensor parallel over 4 GPUs (§6.1).
- ``maas`` -- ServerlessLLM, model-as-a-service without elastic reallocation (§6.3).

Modelling notes:
- One call at a time per chunk or server, for every policy: a teacher call is a prefill of
  thousands of tokens, compute-bound (arithmetic intensity ~L FLOP/byte for L tokens in bf16
  against a Hopper GPU's ~300 FLOP/byte ridge), so co-batching b calls takes about b times one
  call: ``max_batch=1`` for the pooled services, FCFS per dedicated server.
- Pool layout: 8-GPU nodes plus one node with the rest, so the search over GPU counts
  (``bench/fig8b.py``) runs the real buddy rule on legal nodes.
- A call never served (no node can hold its teacher) makes the ACT infinite.
- The simulated agents list the calls they run in every report, as the gpu_manager does, and
  report at the simulated time. A pass is skipped when every GPU is busy: with one call per
  chunk it could start nothing (same decisions; the run takes a fraction as long).
- Restores are priced by the scheduler core's one function (``gpu.restore_cost``): the
  gpu_manager restores a DoP-k variant as k slices, one through each GPU's own host link, so
  a simulated node reports one link per GPU (``Config.gpus_per_link``) and a restore onto k
  GPUs takes footprint / (k x the measured bandwidth per link). No gather is charged by
  default (``Config.gather_gb_per_s`` 0): the paper's variants are tensor parallel (§6.1),
  each GPU keeping the shard it loaded, as the simulated memory does (footprint / k per GPU).

The metric is the paper's §6.3 one: total ACT per trajectory, averaged over trajectories.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from services.scheduler.core import gpu
from services.scheduler.core.effects import StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.spec import make_policy
from services.scheduler.sim.mopd_baselines import dedicated_gpus, run_dedicated, run_maas
from services.scheduler.sim.mopd_workload import (
    GPU_MEMORY_MB,
    SGLANG_ACT_S,
    SGLANG_BATCH,
    STEP_GAP_S,
    TEACHERS,
    WARMUP_SEED_OFFSET,
    WEIGHTS_MB,
    Call,
    Config,
    Outcomes,
    Teacher,
    node_sizes,
    teachers,
    workload,
)
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

__all__ = [
    "GPU_MEMORY_MB",
    "TEACHERS",
    "WEIGHTS_MB",
    "Call",
    "Config",
    "Outcomes",
    "Pooled",
    "Teacher",
    "calibrated",
    "dedicated_gpus",
    "node_sizes",
    "run",
    "run_dedicated",
    "run_maas",
    "teachers",
    "workload",
]

# ---------------------------------------------------------------------- pooled (core)


@dataclass
class _Node:
    """A simulated gpu_manager: per GPU, an LRU of the (service, dop) variants it holds, in
    ``WEIGHTS_MB`` (the rest of the GPU's memory is the running call's)."""

    node_id: str
    lru: list[OrderedDict[tuple[str, int], int]]  # per GPU: variant -> MiB on that GPU
    running: dict[str, StartOnNode] = field(default_factory=dict)  # what it reports running
    incarnation: str = "sim"  # a new one when a failed node comes back (sim/faults.py)

    def restore(self, variant: tuple[str, int], gpus: tuple[int, ...], mb: int) -> bool:
        """Make ``variant`` resident on ``gpus``; False when it already was (no restore)."""
        if all(variant in self.lru[g] for g in gpus):
            for g in gpus:
                self.lru[g].move_to_end(variant)
            return False
        per_gpu = mb // len(gpus)
        for g in gpus:
            self.lru[g].pop(variant, None)
            while sum(self.lru[g].values()) + per_gpu > WEIGHTS_MB and self.lru[g]:
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
        self.teachers = {t.name: t for t in teachers(cfg)}
        self.beside_copy = 0  # restores while a copy of the teacher sat on other GPUs
        self.clock = 0.0  # when the last call served so far ended
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
            gpus=tuple(
                GpuDevice(index=i, memory_mb=WEIGHTS_MB, link=self._link(i)) for i in range(per)
            ),
            restore_gb_per_s=self.cfg.restore_gb_per_s,
            gather_gb_per_s=self.cfg.gather_gb_per_s,
        )
        running = tuple(
            RunningAction(aid, e.action.attempt, "", e.gpus) for aid, e in node.running.items()
        )
        return NodeReport(
            node_id=node.node_id,
            incarnation=node.incarnation,
            inventory=inv,
            running=running,
            full=True,
            services=services,
        )

    def _link(self, gpu_index: int) -> int:
        return gpu_index // self.cfg.gpus_per_link

    def restore_s(self, t: Teacher, gpus: tuple[int, ...]) -> float:
        """A restore of ``t`` onto ``gpus``, priced as the core prices it (one function)."""
        links = tuple(self._link(g) for g in gpus)
        mb = t.footprint_mb(len(gpus))
        return gpu.restore_cost(mb, links, self.cfg.restore_gb_per_s, self.cfg.gather_gb_per_s)

    def run(self, calls: list[Call], before: list[Call] | None = None) -> Outcomes:
        """``calls`` on the pool; ``before`` (the previous step, ``Config.warmup``) first, to
        the last call, and ``calls`` ``STEP_GAP_S`` later on what it left resident. Only
        ``calls`` are counted (their ACT does not depend on the shift)."""
        if not before:
            return self._drive(calls, 0.0)
        self._drive([replace(c, call_id=f"p{c.call_id}") for c in before], 0.0)
        self.beside_copy = 0
        return self._drive(calls, self.clock + STEP_GAP_S)

    def _drive(self, calls: list[Call], offset: float) -> Outcomes:
        """Serve ``calls`` from ``offset`` on (their times shifted by it) until all are done."""
        calls = [replace(c, at=c.at + offset) for c in calls] if offset else calls
        out = Outcomes(len(calls))
        events: list[tuple[float, int, str]] = []
        by_id = {c.call_id: c for c in calls}
        pending: dict[str, tuple[StartOnNode, float, float]] = {}
        for seq, c in enumerate(calls):
            heapq.heappush(events, (c.at, seq, c.call_id))
        seq, busy, now = len(calls), 0, offset
        while events:
            now = events[0][0]
            while events and events[0][0] == now:
                _, _, cid = heapq.heappop(events)
                if cid in pending:
                    start, exec_s, restore = pending.pop(cid)
                    busy -= len(start.gpus)
                    self._complete(start, now, exec_s, restore)
                    out.add(by_id[cid], now, exec_s + restore, restore, len(start.gpus))
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
        out.restores_beside_copy = self.beside_copy
        self.clock = max(self.clock, now)
        return out

    def _start(self, e: StartOnNode, now: float) -> tuple[float, float]:
        t = self.teachers[e.service.name if e.service else ""]
        node = self.nodes[e.node_id]
        node.running[e.action.spec.action_id] = e
        dop = len(e.gpus)
        copy = any(n.where((t.name, d)) for n in self.nodes.values() for d in t.dops)
        cold = node.restore((t.name, dop), e.gpus, t.footprint_mb(dop))
        restore = self.restore_s(t, e.gpus) if cold else 0.0
        if cold:
            self.beside_copy += copy
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


def calibrated(cfg: Config, act_s: float = SGLANG_ACT_S, batch: int = SGLANG_BATCH) -> Config:
    """``cfg`` with the rollout length at which the SGLang baseline's average ACT at ``batch``
    is ``act_s`` (the paper's, by default): the call rate of the workload. Bisection in log
    space; the baseline's ACT falls as the same arrivals are spread over a longer rollout."""
    lo, hi = 1.0, 1e6
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        probe = replace(cfg, batch=batch, rollout_s=mid)
        if run_dedicated(probe, workload(probe)).mean_act() > act_s:
            lo = mid
        else:
            hi = mid
    return replace(cfg, rollout_s=round(hi, 1))


def run(cfg: Config, policy: str, order: str = "fcfs") -> Outcomes:
    """``cfg``'s workload under ``policy``: elastic, dedicated or maas."""
    calls = workload(cfg)
    if policy == "dedicated":
        return run_dedicated(cfg, calls)
    if policy == "maas":
        return run_maas(cfg, calls)
    if policy != "elastic":
        raise ValueError(f"unknown policy {policy!r}; known: elastic, dedicated, maas")
    before = workload(replace(cfg, seed=cfg.seed + WARMUP_SEED_OFFSET)) if cfg.warmup else None
    return Pooled(cfg, "elastic", order).run(calls, before)
