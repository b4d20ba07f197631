"""Algorithm 1 over k resource types at once: the vectorized, multi-resource form.

Each action has a cost vector (its minimum on every resource type), one key elastic resource
whose allowed amounts are a range or a discrete set, and durations over those amounts. The FCFS
candidates are the longest prefix whose minimum vectors fit (one cumulative sum); they are split
by key resource and each group runs the greedy eviction of Algorithm 1 with DPArrange on the
units of its key resource left after every candidate's minimum on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from services.scheduler.dparrange import BasicOperator, Task, prefix_table
from services.scheduler.elastic import Objective, Releases, Row, greedy_evict

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Queue:
    """The waiting queue in FCFS order as arrays: ``mins`` is (n, k); ``key`` is (n,)."""

    mins: IntArray
    key: IntArray
    tasks: Sequence[Task]  # allowed amounts of the key resource and durations there
    elastic: Sequence[bool]


@dataclass(frozen=True, slots=True)
class Decision:
    """Which queued actions start now (indices into the queue) and their key-resource units."""

    started: tuple[int, ...]
    units: tuple[int, ...]


def candidates(mins: IntArray, free: IntArray) -> int:
    """Length of the longest prefix whose summed minimum vectors fit ``free`` on every type."""
    fits = np.all(np.cumsum(mins, axis=0) <= free, axis=1)
    return int(fits.size if fits.all() else np.argmin(fits))


def schedule(
    q: Queue,
    free: IntArray,
    now: float,
    releases: Sequence[Releases],
    depth: int = 2,
    horizon: int = 64,
) -> Decision:
    """Algorithm 1: candidates by FCFS at minimum, then elastic arrangement per key resource."""
    n = candidates(q.mins, free)
    used = q.mins[:n].sum(axis=0)
    started: list[int] = []
    units: list[int] = []
    for r in range(q.mins.shape[1]):
        group = np.flatnonzero(q.key[: n + horizon] == r)
        cand = group[group < n]
        if cand.size == 0:
            continue
        if not any(q.elastic[i] for i in cand):
            started += cand.tolist()
            units += [int(q.tasks[i].choices[0]) for i in cand]
            continue
        budget = int(free[r] - used[r] + q.mins[cand, r].sum())
        rows = [Row(q.tasks[i], q.elastic[i]) for i in group]
        convex = all(r.convex for r in rows[: cand.size])  # group ascending: cand come first
        table = prefix_table(BasicOperator(budget), [q.tasks[i] for i in cand], convex)
        obj = Objective(rows, table, budget, releases[r], now, depth)
        t = greedy_evict(obj, cand.size, 0 if releases[r].ends else 1)
        started += cand[:t].tolist()
        units += list(table.allocation(t))
    order = np.argsort(started, kind="stable")
    return Decision(tuple(int(started[i]) for i in order), tuple(units[i] for i in order))
