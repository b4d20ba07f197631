"""Elastic scheduling (§4.2): Algorithm 1 (greedy eviction) with the ACT approximation of
Algorithm 2.

``ElasticPolicy`` answers the ``Policy.arrange`` call of ``base.py`` for one pool and is pure
apart from what it learns: durations per profile (it ``Learns``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial

import numpy as np

from services.scheduler.policies import act_kernel
from services.scheduler.policies.base import Running, Waiting, clamp_choice, fits_at_min
from services.scheduler.policies.chunks import fits_chunks_at_min
from services.scheduler.policies.dparrange import (
    BasicOperator,
    ChunkOperator,
    DpOperator,
    FloatArray,
    IntArray,
    PrefixTable,
    Task,
    greedy_applies,
    prefix_table,
)
from services.scheduler.policies.durations import (
    DEFAULT_DURATION_S,
    Amdahl,
    DurationLearner,
    DurationModel,
    resolve,
)

__all__ = ["DEFAULT_DURATION_S", "ElasticPolicy", "fits_chunks_at_min"]
HINTED_ROWS = 65_536  # rows remembered per policy for queued actions with their own hints


@dataclass(frozen=True, slots=True)
class Row:
    """One queued action as the objective sees it: its task (allowed units, durations), plus the
    facts every decision reads, computed once per row (rows are cached per duration model)."""

    task: Task
    elastic: bool
    min_units: int = field(init=False)
    convex: bool = field(init=False)  # the exact greedy of ``GreedyTable`` holds for this task
    options: tuple[tuple[int, float], ...] = field(init=False)  # (units, duration) pairs
    level_units: tuple[int, ...] = field(init=False)  # its amount at each DoP level
    level_durs: tuple[float, ...] = field(init=False)  # and its duration there
    _own: dict[int, tuple[IntArray, FloatArray]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        pairs = tuple(zip(self.task.choices.tolist(), self.task.durations.tolist(), strict=True))
        object.__setattr__(self, "options", pairs)
        object.__setattr__(self, "min_units", int(self.task.choices[0]))
        object.__setattr__(self, "convex", greedy_applies((self.task,)))
        units, durs = [u for u, _ in pairs], dict(pairs)
        at = [clamp_choice(units, m) for m in LEVELS]
        object.__setattr__(self, "level_units", tuple(at))
        object.__setattr__(self, "level_durs", tuple(durs[c] for c in at))
        object.__setattr__(self, "_own", {})

    def own(self, depth: int) -> tuple[IntArray, FloatArray]:
        """The ``depth`` amounts (and their durations) it tries first in the estimate."""
        hit = self._own.get(depth)
        if hit is None:
            pick = np.asarray(spread(self.task.choices.size, depth), dtype=np.int64)
            hit = self._own[depth] = (
                self.task.choices[pick].astype(np.int64),
                self.task.durations[pick].astype(np.float64),
            )
        return hit


# The DoP levels the estimate runs the queue at: powers of two, then "each at its maximum".
LEVELS = (1, 4, 16, 64, 256, 1 << 30)


def levels_for(top: int) -> tuple[int, ...]:
    """Indices of the levels that differ for actions allowing at most ``top`` units."""
    return (*(j for j, m in enumerate(LEVELS) if m < top), len(LEVELS) - 1)


def make_row(w: Waiting, learner: DurationLearner | None, default_s: float) -> Row:
    """Durations over the allowed units; unknown elasticity collapses the choices to the min.
    A setup cost per choice (``Waiting.setup_s``) is added to the duration there."""
    if w.t_ori_s is not None and w.parallel_fraction is not None:
        row = _model_row(w.choices, Amdahl(w.t_ori_s, w.parallel_fraction))
    else:
        model = resolve(w.profile, w.t_ori_s, w.parallel_fraction, learner)
        row = _min_row(w.choices[0], default_s) if model is None else _model_row(w.choices, model)
    return _with_setup(row, w) if any(w.setup_s) else row  # no setup anywhere: the row as is


def _with_setup(row: Row, w: Waiting) -> Row:
    setup = dict(zip(w.choices, w.setup_s, strict=True))
    extra = np.array([setup[u] for u in row.task.choices.tolist()], dtype=np.float64)
    return Row(Task(row.task.choices, row.task.durations + extra), row.elastic)


@lru_cache(maxsize=1024)
def _min_row(units: int, duration_s: float) -> Row:
    """An action nothing is known of: its minimum, for the default duration."""
    return Row(Task(np.array([units], dtype=np.int64), np.array([duration_s])), False)


def forget_rows() -> None:
    """Drop every remembered row (benchmarks of the first decision over new actions)."""
    _min_row.cache_clear()
    _model_row.cache_clear()


@lru_cache(maxsize=8192)
def _model_row(choices: tuple[int, ...], model: DurationModel) -> Row:
    """Rows depend on the allowed units and the (frozen, hashable) model only: computed once
    per model, so hinted rows, and learned ones until their profile learns more, are reused."""
    if model.elastic and len(choices) > 1:
        units = np.asarray(choices, dtype=np.int64)
        return Row(Task(units, model.durations(units)), True)
    lo = np.asarray(choices[:1], dtype=np.int64)
    return Row(Task(lo, model.durations(lo)), False)


@dataclass(frozen=True, slots=True)
class Releases:
    """Units that come back at known times: running actions' expected ends, sorted."""

    ends: tuple[float, ...]
    units: tuple[int, ...]


def releases_of(
    running: Sequence[Running], now: float, learner: DurationLearner | None, default_s: float
) -> Releases:
    """When each running action gives its units back: ``expected_end`` or its duration model."""
    pairs = sorted((_expected_end(b, now, learner, default_s), b.units) for b in running)
    return Releases(tuple(p[0] for p in pairs), tuple(p[1] for p in pairs))


def _expected_end(
    b: Running, now: float, learner: DurationLearner | None, default_s: float
) -> float:
    if b.expected_end is not None:
        return max(now, b.expected_end)
    model = resolve(b.profile, b.t_ori_s, b.parallel_fraction, learner)
    if model is None:
        return max(now, b.started_at + default_s)
    return max(now, b.started_at + float(model.durations(np.array([b.units]))[0]))


class Objective:
    """Algorithm 2's ``getApproximatedObjective`` for the FCFS prefixes of the candidates.

    The paper estimates the actions behind the candidates at their minimum allocation. Under
    load that makes every evicted elastic action look as if it would run on one unit, so evicting
    one for a larger allocation later never pays and long scalable actions start on whatever one
    or two units come back. Here the estimate is the best of one pass per DoP level ``m``: the
    actions behind the candidates all run at ``m`` (each at its largest allowed amount not above
    it), and the lowest level is the paper's own estimate, where the first of them tries
    ``depth`` of its amounts. So a prefix is weighed against the best fixed-DoP continuation
    behind it, and an eviction pays when waiting for more units beats that.

    Built once per decision, evaluated once per prefix: the table gives a prefix's allocation
    with the candidates' durations there in one vectorized step; the simulations behind it run
    compiled (``act_kernel``), every level's amounts and durations laid out once as arrays.
    """

    def __init__(
        self,
        rows: Sequence[Row],
        table: PrefixTable,
        free: int,
        releases: Releases,
        now: float,
        depth: int,
    ) -> None:
        self._rows, self._table = rows, table
        self._free, self._now, self._depth = free, now, depth
        top = max((r.options[-1][0] for r in rows if r.elastic), default=1)
        levels = levels_for(top)
        pick = list(levels)  # level -> row: each action's amount and duration at the level
        self._units = np.array([r.level_units for r in rows], dtype=np.int64).T[pick].copy()
        self._durs = np.array([r.level_durs for r in rows], dtype=np.float64).T[pick].copy()
        # suffix sums of the durations at each level: the bound of ``estimate``, for times ≥ 0
        self._tails = np.cumsum(self._durs[:, ::-1], axis=1)[:, ::-1].copy()
        ok = now >= 0.0 and min(releases.ends, default=0) >= 0
        self._bounded = np.array([ok and (d.size == 0 or d.min() >= 0) for d in self._durs])
        self._hint = 0  # the level that won the last prefix looked at
        self._rel_ends = np.asarray(releases.ends, dtype=np.float64)
        self._rel_units = np.asarray(releases.units, dtype=np.int64)

    def __call__(self, t: int) -> float:
        """Exact ACT part for the first t candidates plus the estimate for all behind them."""
        exact = self._table.objective(t)
        if not math.isfinite(exact):
            return exact
        if t >= len(self._rows):
            return t * self._now + exact
        units_at, durs_at = self._table.arrangement(t)
        head = self._rows[t]
        tail, self._hint = act_kernel.best_level(
            self._now,
            self._free,
            self._rel_ends,
            self._rel_units,
            units_at,
            durs_at,
            *head.own(self._depth),
            self._units,
            self._durs,
            self._tails,
            self._bounded,
            self._hint,
        )
        return t * self._now + exact + tail


@lru_cache(maxsize=4096)
def spread(n_choices: int, depth: int) -> tuple[int, ...]:
    """Indices of the ``depth`` allocations the first queued action tries in the estimate: its
    minimum and then evenly up to its maximum, so that "wait for a large allocation" is among
    them."""
    if depth >= n_choices:
        return tuple(range(n_choices))
    if depth == 1:
        return (0,)
    return tuple(sorted({round(i * (n_choices - 1) / (depth - 1)) for i in range(depth)}))


def greedy_evict(objective: Callable[[int], float], n: int, keep: int) -> int:
    """Algorithm 1 lines 8-13: drop the last candidate while that lowers the objective.

    At least ``keep`` candidates stay: 1 when nothing runs in the pool, because then no
    completion would ever come to reconsider an evicted head (the liveness guard).
    """
    t, obj = n, objective(n)
    while t > keep:
        new = objective(t - 1)
        if new >= obj:
            break
        t, obj = t - 1, new
    return t


class ElasticPolicy:
    """Algorithm 1 over one pool with the ACT approximation of depth ``depth`` (Algorithm 2)."""

    lookahead = True  # the estimate weighs the actions behind the candidates

    def __init__(
        self,
        depth: int = 2,
        horizon: int = 64,
        learner: DurationLearner | None = None,
        default_s: float = DEFAULT_DURATION_S,
    ) -> None:
        if depth < 1 or horizon < 0:
            raise ValueError("depth must be ≥ 1 and horizon ≥ 0")
        self.name = "elastic" if depth == 2 else f"elastic:{depth}"
        self.depth, self.horizon, self.default_s = depth, horizon, default_s
        self.learner = learner if learner is not None else DurationLearner()
        self._hinted: dict[int, tuple[Waiting, Row]] = {}
        act_kernel.warm()  # compiled before the first decision, never during one

    def observe(self, profile: str, units: int, exec_s: float) -> None:
        """Learn from a completed action (feeds durations of profiles without hints)."""
        self.learner.observe(profile, units, exec_s)

    def _row(self, w: Waiting) -> Row:
        """``make_row``, remembered per queued action when its own hints fix it: the core
        passes the same view of an action to every decision while it waits."""
        hit = self._hinted.get(id(w))
        if hit is not None and hit[0] is w:
            return hit[1]
        row = make_row(w, self.learner, self.default_s)
        if w.t_ori_s is not None and w.parallel_fraction is not None:
            if len(self._hinted) >= HINTED_ROWS:
                self._hinted.clear()
            self._hinted[id(w)] = (w, row)  # holding w keeps its id from being reused
        return row

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Running],
        now: float,
    ) -> list[int]:
        n = fits_at_min(waiting, free)
        if n == 0:
            return []
        return self._decide(waiting, n, free, partial(BasicOperator, free), running, now)

    def arrange_chunks(
        self,
        waiting: Sequence[Waiting],
        free_chunks: tuple[int, int, int, int],
        running: Sequence[Running],
        now: float,
        candidates: int | None = None,
    ) -> list[int]:
        """The same decision for a GPU pool whose free units are buddy chunks (Algorithm 4);
        only the first ``candidates`` of ``waiting`` may start (all by default), those behind
        weigh in the estimate only."""
        n = fits_chunks_at_min(waiting[:candidates], free_chunks)
        if n == 0:
            return []
        free = sum(c * s for c, s in zip(free_chunks, (1, 2, 4, 8), strict=True))
        return self._decide(waiting, n, free, partial(ChunkOperator, free_chunks), running, now)

    def _decide(
        self,
        waiting: Sequence[Waiting],
        n: int,
        free: int,
        op: Callable[[], DpOperator],
        running: Sequence[Running],
        now: float,
    ) -> list[int]:
        """Algorithm 1 over the first ``n`` of ``waiting``; ``op`` makes the DP operator of
        the free units (only when some candidate can scale)."""
        rows = [self._row(w) for w in waiting[: n + self.horizon]]
        if not any(r.elastic for r in rows[:n]):
            return [r.min_units for r in rows[:n]]  # Alg. 1 lines 6-7: nothing to scale
        cands = rows[:n]
        table = prefix_table(op(), [r.task for r in cands], all(r.convex for r in cands))
        releases = releases_of(running, now, self.learner, self.default_s)
        objective = Objective(rows, table, free, releases, now, self.depth)
        keep = 0 if running else 1
        return list(table.allocation(greedy_evict(objective, n, keep)))
