"""Figure 8(b)'s two baselines for the MOPD workload (``mopd_workload``).

- SGLang (``run_dedicated``): one server per teacher, tensor parallel over 4 GPUs, always
  resident, one call at a time in arrival order (§6.1: "allocating four GPUs per model with
  tensor parallelism"; 40 GPUs for 10 services, §6.3's over-provisioned baseline).
- ServerlessLLM (``run_maas``): model-as-a-service without elastic reallocation (§6.3), as its
  released controller runs with its default deployment config (``ServerlessConfig``). Per
  model, a router (``sllm/routers/roundrobin_router.py``): its auto-scaler ticks every second,
  wants ``ceil(calls in the router / target)`` instances (at most ``max_instances``), starts
  one more or stops one a tick (stopping the newest ready instance, after its call, once idle
  for ``keep_alive_s``); its load balancer takes the queued calls one at a time, sleeps a tick,
  then offers the call to the next ready instance round-robin, sleeping two ticks when that one
  is busy (an instance holds ``target`` calls). A new instance waits for ``num_gpus`` free GPUs
  on one node (its FCFS loading scheduler, ``sllm/schedulers/fcfs_scheduler.py``, every tick),
  then loads the model from host memory -- at our measured restore bandwidth, as generous as
  ours -- plus ``startup_s``. Its DoP is fixed; a stopped instance leaves nothing on the GPU,
  so every start reloads (no preference for cached chunks). Timeouts are not modelled: a call
  waits as long as it takes.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from services.scheduler.core import gpu
from services.scheduler.sim.mopd_workload import (
    Call,
    Config,
    Outcomes,
    Teacher,
    node_sizes,
    teachers,
)

DEDICATED_TP = 4  # §6.1: the SGLang baseline gives each model four GPUs with TP


def run_dedicated(cfg: Config, calls: list[Call]) -> Outcomes:
    """One SGLang server per teacher at TP ``DEDICATED_TP``, always resident, FCFS (calls come
    sorted by arrival). Its GPUs are ``DEDICATED_TP`` per teacher whatever ``cfg.gpus`` is:
    the baseline is defined by its deployment, not by the pool."""
    out = Outcomes(len(calls))
    free = {t.name: 0.0 for t in teachers(cfg)}
    for c in calls:
        dop = max(DEDICATED_TP, c.teacher.dops[0])
        start = max(free[c.teacher.name], c.at)
        exec_s = c.teacher.duration(dop, cfg.parallel)
        free[c.teacher.name] = start + exec_s
        out.add(c, start + exec_s, exec_s, 0.0, dop)
    return out


def run_ideal(cfg: Config, calls: list[Call], shortest_first: bool = False) -> Outcomes:
    """An ideal pool, against which the pooled policies' GPU counts are read: every teacher
    resident on each of ``cfg.gpus`` GPUs at once (no restore, no memory limit), each call at
    DoP 1 (the least GPU time, Amdahl), on the GPU that frees first; in arrival order, or
    (``shortest_first``) the shortest queued call first whenever a GPU frees (non-preemptive
    SJF). A real pool pays restores and keeps a few copies per GPU, so it needs at least about
    as many GPUs for the same ACT (``bench/fig8b.py``'s ``ideal_pool_at_1024``)."""
    out = Outcomes(len(calls))
    free = [0.0] * cfg.gpus
    if not shortest_first:
        for c in calls:
            start = max(heapq.heappop(free), c.at)
            heapq.heappush(free, start + c.teacher.t1_s)
            out.add(c, start + c.teacher.t1_s, c.teacher.t1_s, 0.0, 1)
        return out
    queue: list[tuple[float, int, Call]] = []
    arriving = deque(calls)
    now = 0.0  # decisions in time order: a GPU free earlier takes a call from now on
    while arriving or queue:
        now = max(now, heapq.heappop(free))
        if not queue:  # idle until the next arrival
            now = max(now, arriving[0].at)
        while arriving and arriving[0].at <= now:
            c = arriving.popleft()
            heapq.heappush(queue, (c.teacher.t1_s, len(arriving), c))
        _, _, c = heapq.heappop(queue)
        heapq.heappush(free, now + c.teacher.t1_s)
        out.add(c, now + c.teacher.t1_s, c.teacher.t1_s, 0.0, 1)
    return out


def dedicated_gpus(cfg: Config) -> int:
    return sum(max(DEDICATED_TP, t.dops[0]) for t in teachers(cfg))


# ---------------------------------------------------------------------- ServerlessLLM


@dataclass(eq=False)
class _Instance:
    teacher: Teacher
    node: int
    gpus: int
    busy_until: float = 0.0


@dataclass
class _Router:
    """One model's router: its calls, its instances, its load balancer's state."""

    teacher: Teacher
    queue: deque[Call] = field(default_factory=deque)
    inside: int = 0  # calls arrived and not finished: the auto-scaler's metric
    starting: int = 0  # instances asked for and not ready
    ready: list[_Instance] = field(default_factory=list)  # in the order they became ready
    balancing: bool = False  # the load balancer holds the queue's head
    rr: int = 0
    idle_s: float = 0.0


class _Serverless:
    """The discrete-event run of ``run_maas`` (see the module docstring)."""

    def __init__(self, cfg: Config, calls: list[Call]) -> None:
        self.cfg, self.sc = cfg, cfg.maas
        self.out = Outcomes(len(calls))
        self.routers = {t.name: _Router(t) for t in teachers(cfg)}
        self.free = node_sizes(cfg.gpus)
        self.loading: list[_Router] = []  # instance starts waiting for GPUs, FCFS
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = 0
        biggest = max(self.free, default=0)
        served = [c for c in calls if self._need(c.teacher) <= biggest]  # others never run
        for c in served:
            self._at(c.at, partial(self._arrive, c))
        self.servable = len(served)

    def _need(self, t: Teacher) -> int:
        return self.sc.num_gpus or t.dops[0]

    def _at(self, t: float, act: Callable[[float], None]) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, act))

    def run(self) -> Outcomes:
        self._at(0.0, self._tick)
        while self.out.served < self.servable:
            now, _, act = heapq.heappop(self.events)
            act(now)
        return self.out

    def _arrive(self, c: Call, now: float) -> None:
        r = self.routers[c.teacher.name]
        r.inside += 1
        r.idle_s = 0.0
        r.queue.append(c)
        if not r.balancing:
            r.balancing = True
            self._at(now + self.sc.tick_s, partial(self._balance, r))

    def _balance(self, r: _Router, now: float) -> None:
        """The head call to the next ready instance, round-robin; a tick later if there is
        none, two if that one is busy."""
        if not r.ready:
            self._at(now + self.sc.tick_s, partial(self._balance, r))
            return
        inst = r.ready[r.rr % len(r.ready)]
        r.rr += 1
        if inst.busy_until > now:
            self._at(now + 2 * self.sc.tick_s, partial(self._balance, r))
            return
        c = r.queue.popleft()
        exec_s = c.teacher.duration(inst.gpus, self.cfg.parallel)
        inst.busy_until = now + exec_s
        self._at(inst.busy_until, partial(self._done, r, c, exec_s, inst.gpus))
        if r.queue:
            self._at(now + self.sc.tick_s, partial(self._balance, r))
        else:
            r.balancing = False

    def _done(self, r: _Router, c: Call, exec_s: float, dop: int, now: float) -> None:
        r.inside -= 1
        self.out.add(c, now, exec_s, 0.0, dop)

    def _ready(self, r: _Router, inst: _Instance, now: float) -> None:
        r.starting -= 1
        r.ready.append(inst)

    def _free(self, inst: _Instance, now: float) -> None:
        self.free[inst.node] += inst.gpus

    def _tick(self, now: float) -> None:
        for r in self.routers.values():
            self._scale(r, now)
        self._load(now)
        self._at(now + self.sc.tick_s, self._tick)

    def _scale(self, r: _Router, now: float) -> None:
        sc = self.sc
        want = min(sc.max_instances, math.ceil(r.inside / sc.target))
        have = r.starting + len(r.ready)
        if want > have:
            r.starting += 1
            self.loading.append(r)
        elif want < have and r.ready:
            if r.idle_s < sc.keep_alive_s:
                r.idle_s += sc.tick_s
                return
            inst = r.ready.pop()  # the newest; a call on it finishes first
            self._at(max(now, inst.busy_until), partial(self._free, inst))
            r.idle_s = 0.0

    def _load_s(self, t: Teacher, gpus: int) -> float:
        """Loading ``t`` onto ``gpus`` GPUs: the whole model through one host link, priced by
        the scheduler core's function (MiB against the measured decimal GB/s)."""
        return gpu.restore_cost(t.footprint_mb(gpus), (0,), self.cfg.restore_gb_per_s)

    def _load(self, now: float) -> None:
        """Grant waiting instance starts a node with enough free GPUs, in order."""
        waiting, self.loading = self.loading, []
        for r in waiting:
            t = r.teacher
            need = self._need(t)
            node = next((n for n, f in enumerate(self.free) if f >= need), None)
            if node is None:
                self.loading.append(r)
                continue
            self.free[node] -= need
            load_s = self.sc.startup_s + self._load_s(t, need)
            self.out.add_restore(load_s)
            self._at(now + load_s, partial(self._ready, r, _Instance(t, node, need)))


def run_maas(cfg: Config, calls: list[Call]) -> Outcomes:
    """ServerlessLLM with its default deployment config on ``cfg.gpus`` GPUs."""
    return _Serverless(cfg, calls).run()
