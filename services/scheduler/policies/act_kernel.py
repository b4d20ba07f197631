"""The inner loops of a decision, compiled: Algorithm 2's ``estimate`` (the FCFS simulation of
the actions behind a prefix) and the greedy take of ``GreedyTable``.

The estimate is the hot loop of a decision (one heap simulation per DoP level per prefix that
greedy eviction looks at); in Python it cost 85% of a decision. This is the same simulation
over arrays, compiled once per machine by numba (``cache=True`` keeps the machine code beside
this file), with the same floating-point operations in the same order, hence the same sums.

Releases are a binary min-heap of (end, units) pairs compared as tuples, exactly as ``heapq``
orders them. Every function here is pure and allocation-light; ``warm`` compiles them before a
service takes work, so no decision ever waits for the compiler.
"""

from __future__ import annotations

import numpy as np
from numba import njit

INF = np.inf
# A bound on the rounding of a float sum of a few hundred terms ≥ 0 (relative, generous).
SAFE = 1.0 - 1e-9


@njit(cache=True, inline="always")
def _less(e1: float, u1: int, e2: float, u2: int) -> bool:
    return e1 < e2 or (e1 == e2 and u1 < u2)


@njit(cache=True)
def _push(ends: np.ndarray, units: np.ndarray, n: int, end: float, u: int) -> int:
    i = n
    while i > 0:
        parent = (i - 1) >> 1
        if not _less(end, u, ends[parent], units[parent]):
            break
        ends[i], units[i] = ends[parent], units[parent]
        i = parent
    ends[i], units[i] = end, u
    return n + 1


@njit(cache=True)
def _sift_down(ends: np.ndarray, units: np.ndarray, n: int, i: int) -> None:
    end, u = ends[i], units[i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _less(ends[child + 1], units[child + 1], ends[child], units[child]):
            child += 1
        if not _less(ends[child], units[child], end, u):
            break
        ends[i], units[i] = ends[child], units[child]
        i = child
    ends[i], units[i] = end, u


@njit(cache=True)
def _heapify(ends: np.ndarray, units: np.ndarray, n: int) -> None:
    for i in range(n // 2 - 1, -1, -1):
        _sift_down(ends, units, n, i)


@njit(cache=True)
def _wait_for(
    t: float, f: int, need: int, ends: np.ndarray, units: np.ndarray, n: int
) -> tuple[float, int, int]:
    """Pop releases in (end, units) order until ``need`` units are free: time, free, heap size."""
    while f < need and n > 0:
        end, back = ends[0], units[0]
        n -= 1
        if n > 0:
            ends[0], units[0] = ends[n], units[n]
            _sift_down(ends, units, n, 0)
        f += back
        if end > t:
            t = end
    return t, f, n


@njit(cache=True)
def estimate(
    now: float,
    free: int,
    base_ends: np.ndarray,
    base_units: np.ndarray,
    first_units: np.ndarray,
    first_durs: np.ndarray,
    rest_units: np.ndarray,
    rest_durs: np.ndarray,
    tails: np.ndarray,
    bound: float,
) -> float:
    """The sum of the end times of the actions behind a prefix, started in FCFS order as units
    come back (``base_*`` is a heap of the releases); the first tries each of its ``first``
    amounts and the best sum is kept; ``rest`` gives the amount and duration of each later one.

    ``tails[k]``, when ``tails`` is not empty, lower-bounds the durations of ``rest[k:]``
    summed: an option is abandoned once even starting all the rest at once could not beat the
    best one (or ``bound``), which leaves the result as it is; INF when nothing beats ``bound``.
    """
    if first_units.size == 0:
        return 0.0
    size = base_ends.size + 1 + rest_units.size
    ends = np.empty(size)
    units = np.empty(size, dtype=np.int64)
    left = rest_units.size
    bounded = tails.size > 0
    best = bound
    for i in range(first_units.size):
        n = base_ends.size
        ends[:n] = base_ends
        units[:n] = base_units
        t, f, n = _wait_for(now, free, first_units[i], ends, units, n)
        obj = t + first_durs[i]
        n = _push(ends, units, n, obj, first_units[i])
        f -= first_units[i]
        if bounded and obj >= 0.0 and (obj + left * t + tails[0]) * SAFE >= best:
            continue  # cannot beat best: its exact sum is ≥ this bound
        for k in range(left):
            if obj >= best or (bounded and (obj + (left - k) * t + tails[k]) * SAFE >= best):
                obj = INF
                break  # the rest start no earlier than t and last at least tails[k]
            need = rest_units[k]
            if f < need:
                t, f, n = _wait_for(t, f, need, ends, units, n)
            end = t + rest_durs[k]
            n = _push(ends, units, n, end, need)
            f -= need
            obj += end
        best = min(best, obj)
    return best if best < bound else INF


@njit(cache=True)
def best_level(
    now: float,
    free: int,
    rel_ends: np.ndarray,
    rel_units: np.ndarray,
    prefix_units: np.ndarray,
    prefix_durs: np.ndarray,
    head_units: np.ndarray,
    head_durs: np.ndarray,
    level_units: np.ndarray,
    level_durs: np.ndarray,
    tails: np.ndarray,
    bounded: np.ndarray,
    hint: int,
) -> tuple[float, int]:
    """The lowest estimate behind a prefix over the DoP levels, and the level that gave it.

    The prefix runs ``prefix_*`` from ``now`` on ``free`` units, beside the running actions'
    releases ``rel_*`` (sorted). Rows of ``level_*`` give each action behind the prefix its
    amount and duration at a level; at level 0 the first of them tries ``head_*`` (``depth``
    of its amounts), at the others it runs at the level too. Level ``hint`` goes first, so its
    sum prunes the others early.
    """
    n_rel, t = rel_ends.size, prefix_units.size
    ends = np.empty(n_rel + t)
    units = np.empty(n_rel + t, dtype=np.int64)
    ends[:n_rel], units[:n_rel] = rel_ends, rel_units
    for i in range(t):
        ends[n_rel + i] = now + prefix_durs[i]
        units[n_rel + i] = prefix_units[i]
        free -= prefix_units[i]
    _heapify(ends, units, ends.size)
    no_tails = np.empty(0)
    best, won = INF, hint
    for k in range(level_units.shape[0]):
        level = hint if k == 0 else (k - 1 if k <= hint else k)
        if level == 0:
            first_u, first_d = head_units, head_durs
        else:
            first_u, first_d = level_units[level, t : t + 1], level_durs[level, t : t + 1]
        rest_u, rest_d = level_units[level, t + 1 :], level_durs[level, t + 1 :]
        rest_t = tails[level, t + 1 :] if bounded[level] else no_tails
        value = estimate(now, free, ends, units, first_u, first_d, rest_u, rest_d, rest_t, best)
        if value < best:
            best, won = value, level
    return best, won


@njit(cache=True)
def take_best(
    order_rows: np.ndarray, order_gains: np.ndarray, t: int, budget: int
) -> tuple[np.ndarray, float]:
    """The marginal-gain greedy of ``GreedyTable`` for the first ``t`` tasks: the first
    ``budget`` increments of the best-first ``order`` that belong to them. Returns the
    increments per task and their gains summed (in that order)."""
    extra = np.zeros(t, dtype=np.int64)
    total, taken = 0.0, 0
    for j in range(order_rows.size):
        if taken >= budget:
            break
        row = order_rows[j]
        if row < t:
            extra[row] += 1
            total += order_gains[j]
            taken += 1
    return extra, total


@njit(cache=True)
def chunk_step(
    dp: np.ndarray, nxt: np.ndarray, levels: np.ndarray, choices: np.ndarray, durs: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One task added to Algorithm 4's DP over free-chunk states: per target state the cheapest
    way in, then the fewest units, then the lowest source state. ``nxt[s, level]`` is the state
    after taking a 2**level chunk from s (-1: none free); choice c takes ``levels[c]``."""
    n = dp.size
    new = np.full(n, INF)
    chosen = np.zeros(n, dtype=np.int64)
    parent = np.full(n, -1, dtype=np.int64)
    for s in range(n):
        if not np.isfinite(dp[s]):
            continue
        for c in range(choices.size):
            tgt = nxt[s, levels[c]]
            if tgt < 0:
                continue
            v, u = dp[s] + durs[c], choices[c]
            if v < new[tgt] or (v == new[tgt] and u < chosen[tgt]):
                new[tgt], chosen[tgt], parent[tgt] = v, u, s
    return new, chosen, parent


@njit(cache=True)
def backtrack(state: int, chosen: np.ndarray, parent: np.ndarray, t: int) -> np.ndarray:
    """Units per task of the DP's arrangement of the first ``t`` tasks ending in ``state``
    (row i of ``chosen``/``parent`` is the layer of task i)."""
    out = np.empty(t, dtype=np.int64)
    for i in range(t - 1, -1, -1):
        out[i] = chosen[i, state]
        state = parent[i, state]
    return out


def warm() -> None:
    """Compile (or load from the cache) every kernel with the types decisions call them with."""
    one_f, one_i = np.ones(1), np.ones(1, dtype=np.int64)
    grid_f, grid_i = np.ones((2, 2)), np.ones((2, 2), dtype=np.int64)
    best_level(
        0.0,
        1,
        one_f,
        one_i,
        one_i,
        one_f,
        one_i,
        one_f,
        grid_i,
        grid_f,
        grid_f,
        np.ones(2, dtype=np.bool_),
        0,
    )
    take_best(one_i, one_f, 1, 1)
    chunk_step(one_f, grid_i, one_i - 1, one_i, one_f)
    backtrack(0, grid_i, grid_i, 1)
