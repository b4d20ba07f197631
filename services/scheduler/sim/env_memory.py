"""One CPU node's memory and cores under N concurrent trajectories, with and without tiering.

A closed loop: ``slots`` trajectories live on the node at once (a finished one is followed by the
next of the trace). Each step is an LLM gap (the environment idle), then one action that needs
its environment resident and its cores (FCFS, head of line waits). An environment holds
``memory_mb`` of the node's memory:

- without tiering, from its first action until its trajectory ends (a new trajectory waits for
  memory: that wait is part of its first action's completion time);
- with tiering, only while running or paused: when memory is short, the longest-idle idle
  environment (idle at least ``min_idle_s``) goes to disk (as ``tiers.pressure_victims``), and
  an action whose environment is on disk first waits ``restore_s`` (measured by the bench).

ACT = an action's completion time, from submission to its end: its run time on its cores plus
what it waited (for cores, memory, a restore). So that the count of trajectories does not change
which actions of the trace are averaged, the mean ACT is the trace's mean run time plus the mean
wait measured in the loop. The question it answers: how
many trajectories fit on a node at the average ACT the node has without tiering when filled to
its memory (``node_memory_mb // memory_mb`` trajectories)?
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from services.scheduler.sim.traces import Step, Trace

GAP, ARRIVE, DONE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class NodeModel:
    cores: int = 16
    memory_mb: int = 16 * 1024
    env_mb: int = 1024
    reward_dop: int = 4  # cores a reward run gets (tool calls get 1)
    restore_s: float = 1.0  # disk -> running, measured
    min_idle_s: float = 5.0
    horizon_s: float = 24 * 3600.0  # simulated time; actions submitted after it are not counted


@dataclass
class _Env:
    resident: bool = False
    idle_since: float | None = None  # None while an action waits or runs


@dataclass
class _Run:
    envs: dict[int, _Env] = field(default_factory=dict)  # slot -> its current environment
    used_mb: int = 0
    free_cores: int = 0
    queue: list[tuple[int, float, Step]] = field(default_factory=list)  # slot, submitted
    waits: list[float] = field(default_factory=list)  # of each action counted
    restores: int = 0


class EnvMemorySim:
    """The closed loop on one node; ``run()`` returns the mean ACT (seconds)."""

    def __init__(self, trace: Trace, slots: int, tiering: bool, node: NodeModel) -> None:
        self.trace, self.slots, self.tiering, self.node = trace, slots, tiering, node
        self._next_traj = itertools.cycle(range(len(trace)))
        self._events: list[tuple[float, int, int, int, object]] = []
        self._seq = itertools.count()
        self._cursor: dict[int, tuple[int, int]] = {}  # slot -> (trajectory index, step index)
        self.r = _Run(free_cores=node.cores)

    def run(self) -> float:
        for slot in range(self.slots):
            self._begin(slot, 0.0)
        while self._events:
            now, _, kind, slot, payload = heapq.heappop(self._events)
            if kind == ARRIVE:
                self._arrive(slot, now)
            elif kind == DONE:
                assert isinstance(payload, int)
                self._done(slot, now, payload)
            self._dispatch(now)
        return self._mean_run_s() + sum(self.r.waits) / max(1, len(self.r.waits))

    def _units(self, step: Step) -> int:
        return 1 if step.profile != "reward" else min(self.node.reward_dop, self.node.cores)

    def _mean_run_s(self) -> float:
        runs = [s.duration(self._units(s)) for t in self.trace for s in t.steps]
        return sum(runs) / max(1, len(runs))

    def _push(self, t: float, kind: int, slot: int, payload: object = None) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, slot, payload))

    def _begin(self, slot: int, now: float) -> None:
        """A new trajectory in ``slot``: a new environment, not made yet."""
        self._cursor[slot] = (next(self._next_traj), 0)
        self.r.envs[slot] = _Env()
        self._gap(slot, now)

    def _gap(self, slot: int, now: float) -> None:
        ti, si = self._cursor[slot]
        env = self.r.envs[slot]
        env.idle_since = now
        if now <= self.node.horizon_s:
            self._push(now + self.trace[ti].steps[si].gap_s, ARRIVE, slot)

    def _arrive(self, slot: int, now: float) -> None:
        ti, si = self._cursor[slot]
        self.r.envs[slot].idle_since = None
        self.r.queue.append((slot, now, self.trace[ti].steps[si]))

    def _dispatch(self, now: float) -> None:
        """FCFS on cores (the head of line waits for them); an action whose environment finds
        no memory waits aside, in order, without blocking the others (they free memory)."""
        for item in list(self.r.queue):
            slot, submitted, step = item
            units = self._units(step)
            if units > self.r.free_cores:
                return
            env = self.r.envs[slot]
            if not (env.resident or self._make_room(now)):
                continue
            self.r.queue.remove(item)
            delay = 0.0
            if not env.resident:
                env.resident = True
                self.r.used_mb += self.node.env_mb
                if self.tiering and self._cursor[slot][1] > 0:  # it was on disk
                    delay, self.r.restores = self.node.restore_s, self.r.restores + 1
            self.r.free_cores -= units
            if submitted <= self.node.horizon_s:
                self.r.waits.append(now - submitted + delay)
            self._push(now + delay + step.duration(units), DONE, slot, units)

    def _make_room(self, now: float) -> bool:
        """Memory for one more resident environment, putting idle ones on disk if tiering."""
        if self.r.used_mb + self.node.env_mb <= self.node.memory_mb:
            return True
        if not self.tiering:
            return False
        idle = [
            (e.idle_since, s)
            for s, e in self.r.envs.items()
            if e.resident and e.idle_since is not None
        ]
        for since, s in sorted(idle):
            if now - since < self.node.min_idle_s:
                break
            self.r.envs[s].resident = False
            self.r.used_mb -= self.node.env_mb
            if self.r.used_mb + self.node.env_mb <= self.node.memory_mb:
                return True
        return False

    def _done(self, slot: int, now: float, units: int) -> None:
        self.r.free_cores += units
        ti, si = self._cursor[slot]
        if si + 1 < len(self.trace[ti].steps):
            self._cursor[slot] = (ti, si + 1)
            self._gap(slot, now)
            return
        env = self.r.envs.pop(slot)  # the trajectory ends: its environment goes
        if env.resident:
            self.r.used_mb -= self.node.env_mb
        if now <= self.node.horizon_s:
            self._begin(slot, now)


def mean_act(trace: Trace, slots: int, tiering: bool, node: NodeModel) -> float:
    """The average ACT with ``slots`` concurrent trajectories on the node."""
    return EnvMemorySim(trace, slots, tiering, node).run()


@dataclass(frozen=True, slots=True)
class Capacity:
    """Trajectories per node within each ACT tolerance, and the ACT curves behind them."""

    target_act_s: float  # the node filled to its memory, without tiering
    per_tolerance: dict[float, dict[str, int]]  # tolerance -> {"with": n, "without": m}
    curves: dict[str, dict[int, float]]  # "with"/"without" -> trajectories -> mean ACT


def trajectories_per_node(
    trace: Trace, node: NodeModel, tolerances: tuple[float, ...] = (0.0,), max_slots: int = 1024
) -> Capacity:
    """For each tolerance t, the most concurrent trajectories (counting up from the node filled
    to its memory) whose average ACT stays within ``(1 + t)`` times that of the node filled to
    its memory without tiering (``node_memory_mb // env_mb`` trajectories)."""
    full = node.memory_mb // node.env_mb
    target = mean_act(trace, full, False, node)
    limit = target * (1 + max(tolerances)) * (1 + 1e-9)
    curves: dict[str, dict[int, float]] = {"with": {}, "without": {}}
    for name, tiering in (("without", False), ("with", True)):
        for n in range(full, max_slots + 1):
            act = curves[name][n] = mean_act(trace, n, tiering, node)
            if act > limit:
                break
    per = {
        t: {k: _last_within(c, full, target * (1 + t)) for k, c in curves.items()}
        for t in tolerances
    }
    return Capacity(target, per, curves)


def _last_within(curve: dict[int, float], full: int, bound: float) -> int:
    n = full - 1
    while n + 1 in curve and curve[n + 1] <= bound * (1 + 1e-9):
        n += 1
    return n
