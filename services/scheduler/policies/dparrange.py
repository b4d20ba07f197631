"""Topology-agnostic DPArrange (Appendix B, Algorithm 3) and its DP operators, numpy-vectorized.

DPArrange assigns each of m scalable candidates one of its allowed unit counts so that the sum of
their durations is minimal under the pool's topology. One forward pass yields the optimum of every
FCFS prefix of the candidates, which is exactly what the greedy eviction of Algorithm 1 asks for.

Operators (the topology-specific primitives of Algorithm 3):
- ``BasicOperator`` — interchangeable units (cores of one node, quota tokens); state = units used.
- ``ChunkOperator`` — GPUs in power-of-two chunks (Algorithm 4, §5.3 buddy cells); state = the
  counts of free chunks of sizes 1, 2, 4, 8 in mixed radix; a request takes the smallest free
  chunk that holds it and splits it into legal buddies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import numpy as np
import numpy.typing as npt

from services.scheduler.policies import act_kernel
from services.scheduler.policies.chunks import CHUNK_SIZES, chunk_level, take_chunk

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
INF = float("inf")


class DpOperator(Protocol):
    """The topology primitives DPArrange needs (Start/Prev/IsValid of Algorithm 3, vectorized)."""

    start: int
    units_used: IntArray  # units used in each state, for tie-breaking and accounting

    def step(
        self, dp: FloatArray, choices: IntArray, durs: FloatArray
    ) -> tuple[FloatArray, IntArray, IntArray]:
        """Add one task: new costs per state, the units chosen there (0 = none) and the parent."""
        ...


class BasicOperator:
    """Interchangeable units: state j = units used, Prev(j, k) = j - k, valid while j ≤ capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.start = 0
        self.units_used = np.arange(capacity + 1, dtype=np.int64)

    def step(
        self, dp: FloatArray, choices: IntArray, durs: FloatArray
    ) -> tuple[FloatArray, IntArray, IntArray]:
        n = dp.size
        if choices.size == 1:  # one allowed amount: a shift, no choice to make
            return _shift(dp, int(choices[0]), float(durs[0]))
        kmax = int(choices[-1])
        padded = np.concatenate((np.full(kmax, INF), dp))
        cand = padded[_gather_index(n, tuple(choices.tolist()), kmax)] + durs[:, None]
        best = cand.argmin(axis=0)
        new = cand[best, np.arange(n)]
        chosen = np.where(np.isfinite(new), choices[best], 0)
        return new, chosen, self.units_used - chosen


def _shift(dp: FloatArray, k: int, dur: float) -> tuple[FloatArray, IntArray, IntArray]:
    n = dp.size
    new = np.full(n, INF)
    if k < n:
        new[k:] = dp[: n - k] + dur
    chosen = np.where(np.isfinite(new), k, 0).astype(np.int64)
    return new, chosen, np.arange(n, dtype=np.int64) - chosen


@lru_cache(maxsize=256)
def _gather_index(n: int, choices: tuple[int, ...], kmax: int) -> IntArray:
    ks = np.asarray(choices, dtype=np.int64)
    return np.arange(n, dtype=np.int64)[None, :] - ks[:, None] + kmax


class ChunkOperator:
    """Algorithm 4: states are free-chunk counts (a, b, c, d) encoded in mixed radix.

    Under the smallest-fit rule a level only gains a chunk by a split, which happens only when it
    has none, so count[l] ≤ max(initial[l], 1) bounds the radices and the state space.
    """

    def __init__(self, free_counts: Sequence[int]) -> None:
        if len(free_counts) != len(CHUNK_SIZES) or min(free_counts) < 0:
            raise ValueError("free_counts are the numbers of free chunks of sizes 1, 2, 4, 8")
        self.free_counts = tuple(int(c) for c in free_counts)
        self.radix = tuple(max(c, 1) + 1 for c in self.free_counts)
        states, nxt = _chunk_tables(self.radix)
        self.states = states
        self._next = nxt
        self.start = self.encode(self.free_counts)
        free_units = sum(c * s for c, s in zip(self.free_counts, CHUNK_SIZES, strict=True))
        self.units_used = free_units - states @ np.asarray(CHUNK_SIZES, dtype=np.int64)

    def encode(self, counts: Sequence[int]) -> int:
        idx, mult = 0, 1
        for c, r in zip(counts, self.radix, strict=True):
            idx += c * mult
            mult *= r
        return idx

    def decode(self, state: int) -> tuple[int, ...]:
        return tuple(int(x) for x in self.states[state])

    def step(
        self, dp: FloatArray, choices: IntArray, durs: FloatArray
    ) -> tuple[FloatArray, IntArray, IntArray]:
        levels = np.fromiter((chunk_level(k) for k in choices.tolist()), np.int64, choices.size)
        return act_kernel.chunk_step(dp, self._next, levels, choices, durs)


@lru_cache(maxsize=64)
def _chunk_tables(radix: tuple[int, ...]) -> tuple[IntArray, IntArray]:
    """All states in encoding order and, per state and level, the state after taking a chunk."""
    mults = np.cumprod((1, *radix[:-1]))
    idx = np.arange(int(np.prod(radix)), dtype=np.int64)
    states = np.stack([(idx // m) % r for m, r in zip(mults, radix, strict=True)], axis=1)
    nxt = np.full((len(states), len(CHUNK_SIZES)), -1, dtype=np.int64)
    for i, counts in enumerate(states.tolist()):
        for level in range(len(CHUNK_SIZES)):
            after = take_chunk(tuple(counts), level)
            if after is not None and all(c < r for c, r in zip(after, radix, strict=True)):
                nxt[i, level] = int(np.dot(after, mults))
    return states.astype(np.int64), nxt


@dataclass(frozen=True, slots=True)
class Task:
    """A candidate as DPArrange sees it: allowed units (ascending) and the duration of each."""

    choices: IntArray
    durations: FloatArray


class PrefixTable(Protocol):
    """Optimal arrangements of every FCFS prefix of the candidates."""

    def objective(self, t: int) -> float: ...
    def allocation(self, t: int) -> tuple[int, ...]: ...
    def arrangement(self, t: int) -> tuple[IntArray, FloatArray]: ...


class DpTable:
    """The DP layers of Algorithm 3; layer t is the optimum over the first t tasks."""

    def __init__(self, op: DpOperator, tasks: Sequence[Task]) -> None:
        dp = np.full(op.units_used.size, INF)
        dp[op.start] = 0.0
        self._op = op
        self._tasks = tasks
        self._flat: FlatTasks | None = None
        self._best: list[int] = [op.start]
        self._cost: list[float] = [0.0]
        self._layers: list[tuple[IntArray, IntArray]] = []
        self._stacked: tuple[IntArray, IntArray] | None = None
        for task in tasks:
            if not np.isfinite(self._cost[-1]):
                break  # an infeasible prefix stays infeasible
            dp, chosen, parent = op.step(dp, task.choices, task.durations)
            self._layers.append((chosen, parent))
            self._best.append(_best_state(dp, op.units_used))
            self._cost.append(float(dp[self._best[-1]]))

    def objective(self, t: int) -> float:
        """Minimal sum of durations of the first t tasks (inf when they cannot all be placed)."""
        return self._cost[t] if t < len(self._cost) else INF

    def allocation(self, t: int) -> tuple[int, ...]:
        """Units per task of the optimal arrangement of the first t tasks (backtracking)."""
        return tuple(self._backtrack(t).tolist())

    def arrangement(self, t: int) -> tuple[IntArray, FloatArray]:
        """The allocation of the first t tasks and the duration of each there."""
        if self._flat is None:
            self._flat = FlatTasks(self._tasks)
        units = self._backtrack(t)
        return units, self._flat.durations_at(units)

    def _backtrack(self, t: int) -> IntArray:
        if t == 0:
            return np.zeros(0, dtype=np.int64)
        if self._stacked is None:  # the layers as two matrices, once the eviction asks
            self._stacked = (
                np.stack([c for c, _ in self._layers]),
                np.stack([p for _, p in self._layers]),
            )
        out: IntArray = act_kernel.backtrack(self._best[t], *self._stacked, t)
        return out


class FlatTasks:
    """Tasks' allowed units and durations laid end to end, searchable by ``task * stride + k``."""

    def __init__(self, tasks: Sequence[Task]) -> None:
        units = np.concatenate([t.choices for t in tasks])
        self._stride = int(units.max()) + 1
        self._offsets = np.arange(len(tasks), dtype=np.int64) * self._stride
        self._keys = np.repeat(self._offsets, [t.choices.size for t in tasks]) + units
        self._durs = np.concatenate([t.durations for t in tasks])

    def durations_at(self, units: IntArray) -> FloatArray:
        """The duration of task i at ``units[i]`` (an allowed amount) for the first len(units)."""
        at = self._keys.searchsorted(self._offsets[: units.size] + units)
        out: FloatArray = self._durs[at]
        return out


def _best_state(dp: FloatArray, units_used: IntArray) -> int:
    """Cheapest state; among equals the one that uses the fewest units (keeps room for others)."""
    low = dp.min()
    if not np.isfinite(low):
        return int(np.argmin(units_used))
    ties = np.flatnonzero(dp == low)
    return int(ties[np.argmin(units_used[ties])])


class GreedyTable:
    """Exact fast path for the basic operator when every task allows a contiguous range of units
    and its duration is convex there (Amdahl curves are): the marginal-gain greedy is then
    optimal for a separable convex objective under one sum constraint, at O(m·w) numpy cost."""

    def __init__(self, capacity: int, tasks: Sequence[Task]) -> None:
        sizes = np.array([t.choices.size for t in tasks], dtype=np.int64)
        durs = np.concatenate([t.durations for t in tasks])
        units = np.concatenate([t.choices for t in tasks])
        starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        row = np.repeat(np.arange(len(tasks), dtype=np.int64), sizes)
        pos = np.arange(durs.size, dtype=np.int64) - starts[row]
        step = pos[1:] > 0  # durs[j + 1] and durs[j] belong to the same task
        gains = np.full((len(tasks), max(int(sizes.max()) - 1, 1)), -INF)
        gains[row[1:][step], pos[1:][step] - 1] = -np.diff(durs)[step]
        mins = units[starts].astype(np.int64)
        self._durs, self._starts = durs, starts
        self._base = np.concatenate(([0.0], np.cumsum(durs[starts])))  # prefix sums at minimum
        self._mins = mins
        # per prefix, as ints: the increments worth taking and the units left after the minimums
        self._positive = [0, *np.cumsum(np.count_nonzero(gains > 0.0, axis=1)).tolist()]
        self._slack = [capacity, *(capacity - np.cumsum(mins)).tolist()]
        # every increment worth taking, best first (among equal gains, the earlier task's, and
        # a task's in its own order): a prefix takes the first ones that belong to its tasks
        order = np.argsort(-gains.ravel(), kind="stable")[: self._positive[-1]]
        self._order_rows = (order // gains.shape[1]).astype(np.int64)
        self._order_gains = gains.ravel()[order]
        self._memo: dict[int, tuple[IntArray, float]] = {}

    def objective(self, t: int) -> float:
        if self._slack[t] < 0:
            return INF
        return float(self._base[t]) - self._picked(t)[1]

    def allocation(self, t: int) -> tuple[int, ...]:
        return tuple(self.arrangement(t)[0].tolist())

    def arrangement(self, t: int) -> tuple[IntArray, FloatArray]:
        """The allocation of the first t tasks and the duration of each there: the choices are
        contiguous, so task i's duration at min + extra is at offset extra of its durations."""
        extra, _ = self._picked(t)
        return self._mins[:t] + extra, self._durs[self._starts[:t] + extra]

    def _picked(self, t: int) -> tuple[IntArray, float]:
        """Increments taken per task, and their gains summed, for the first t tasks (memoized:
        the eviction loop asks for the objective and then the allocation of the same prefix)."""
        hit = self._memo.get(t)
        if hit is None:
            budget = max(0, min(self._slack[t], self._positive[t]))
            hit = self._memo[t] = act_kernel.take_best(
                self._order_rows, self._order_gains, t, budget
            )
        return hit


def greedy_applies(tasks: Sequence[Task]) -> bool:
    """True when every task's choices are contiguous and its durations convex and non-increasing."""
    for t in tasks:
        if t.choices.size > 1:
            if int(t.choices[-1] - t.choices[0]) != t.choices.size - 1:
                return False
            gains = -np.diff(t.durations)
            if gains.size > 1 and np.any(np.diff(gains) > 1e-12 * (1.0 + gains[0])):
                return False
            if np.any(gains < -1e-12):
                return False
    return True


def prefix_table(op: DpOperator, tasks: Sequence[Task], convex: bool | None = None) -> PrefixTable:
    """The prefix optima, by the exact greedy when it applies and by the DP otherwise.

    ``convex`` is ``greedy_applies(tasks)`` when the caller already knows it (cached per row).
    """
    if convex is None:
        convex = greedy_applies(tasks)
    if isinstance(op, BasicOperator) and tasks and convex:
        return GreedyTable(op.capacity, tasks)
    return DpTable(op, tasks)


def dparrange(op: DpOperator, tasks: Sequence[Task]) -> tuple[float, tuple[int, ...]]:
    """Algorithm 3: the optimal total duration T* and the units of each task (all of them)."""
    table = DpTable(op, tasks)
    return table.objective(len(tasks)), (
        table.allocation(len(tasks)) if np.isfinite(table.objective(len(tasks))) else ()
    )
