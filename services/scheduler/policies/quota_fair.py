"""Weighted fair queueing of waiting calls across jobs, and Jain's fairness index.

Start-time fair queueing (SFQ, Goyal et al. 1996), a WFQ variant that needs no simulated
fluid server: a call of ``cost`` from job ``j`` gets start tag ``S = max(V, F_prev(j))`` and
finish tag ``F = S + cost / w_j``; the next call served is the head with the smallest finish
tag, and virtual time ``V`` advances to its start tag. Each job is FIFO, so only heads compete.
For jobs that stay backlogged, service divided by weight never differs by more than
``cost_max/w_i + cost_max/w_j``; a job that was idle re-enters at ``V`` (no credit banked
while idle). Weights are per job (default 1); a job's weight counts from its next call.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Tagged(Generic[T]):
    finish: float
    seq: int
    start: float = field(compare=False)
    job: str = field(compare=False)
    item: T = field(compare=False)


class FairQueue(Generic[T]):
    """Waiting calls of many jobs; ``pop`` returns them in weighted-fair order."""

    def __init__(self, weights: dict[str, float] | None = None) -> None:
        self.weights = dict(weights or {})
        self._vtime = 0.0
        self._last_finish: dict[str, float] = {}
        self._queues: dict[str, deque[_Tagged[T]]] = {}
        self._heads: list[_Tagged[T]] = []
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def set_weight(self, job: str, weight: float) -> None:
        """Give ``job`` a share proportional to ``weight`` (> 0)."""
        if not weight > 0:
            raise ValueError(f"weight must be > 0, got {weight}")
        self.weights[job] = weight

    def push(self, job: str, item: T, cost: float = 1.0) -> None:
        """Queue ``item`` for ``job``; ``cost`` is what serving it spends (units, tokens)."""
        start = max(self._vtime, self._last_finish.get(job, 0.0))
        finish = start + cost / self.weights.get(job, 1.0)
        self._last_finish[job] = finish
        tagged = _Tagged(finish, next(self._seq), start, job, item)
        queue = self._queues.setdefault(job, deque())
        queue.append(tagged)
        if len(queue) == 1:
            heapq.heappush(self._heads, tagged)
        self._len += 1

    def peek(self) -> tuple[str, T] | None:
        """The job and item ``pop`` would return, without removing it."""
        if not self._heads:
            return None
        head = self._heads[0]
        return head.job, head.item

    def pop(self) -> tuple[str, T]:
        """Remove and return the next call in fair order (IndexError when empty)."""
        head = heapq.heappop(self._heads)
        queue = self._queues[head.job]
        queue.popleft()
        if queue:
            heapq.heappush(self._heads, queue[0])
        else:
            del self._queues[head.job]
        self._vtime = max(self._vtime, head.start)
        if head.job not in self._queues and self._last_finish[head.job] <= self._vtime:
            del self._last_finish[head.job]  # idle and owed nothing: forget the job
        self._len -= 1
        return head.job, head.item

    def waiting(self, job: str) -> int:
        """How many calls of ``job`` are queued."""
        return len(self._queues.get(job, ()))


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2): 1 is perfectly fair, 1/n worst."""
    xs = list(values)
    squares = sum(x * x for x in xs)
    return 1.0 if squares == 0 else sum(xs) ** 2 / (len(xs) * squares)


def weighted_jain(served: dict[str, float], weights: dict[str, float]) -> float:
    """Jain's index of service normalised by weight (default weight 1)."""
    return jain_index(served[j] / weights.get(j, 1.0) for j in served)
