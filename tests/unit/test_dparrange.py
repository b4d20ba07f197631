"""DPArrange (Algorithm 3) against brute force, and the GPU chunk operator (Algorithm 4)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies.dparrange import (
    BasicOperator,
    ChunkOperator,
    DpTable,
    GreedyTable,
    Task,
    chunk_level,
    dparrange,
    greedy_applies,
    take_chunk,
)
from services.scheduler.policies.durations import Amdahl


@st.composite
def tasks(draw: st.DrawFn, max_tasks: int = 4, discrete: bool = True) -> list[Task]:
    out = []
    for _ in range(draw(st.integers(1, max_tasks))):
        if discrete:
            choices = sorted(draw(st.sets(st.integers(1, 6), min_size=1, max_size=4)))
        else:
            lo = draw(st.integers(1, 3))
            choices = list(range(lo, lo + draw(st.integers(1, 5))))
        durs = [draw(st.floats(0.1, 100.0)) for _ in choices]
        out.append(Task(np.array(choices, dtype=np.int64), np.array(durs)))
    return out


def brute(capacity: int, ts: list[Task]) -> float:
    best = float("inf")
    for combo in itertools.product(*[range(t.choices.size) for t in ts]):
        if sum(int(t.choices[c]) for t, c in zip(ts, combo, strict=True)) <= capacity:
            best = min(best, sum(float(t.durations[c]) for t, c in zip(ts, combo, strict=True)))
    return best


@settings(max_examples=150, deadline=None)
@given(tasks(), st.integers(0, 20))
def test_basic_dparrange_equals_brute_force(ts: list[Task], capacity: int) -> None:
    obj, alloc = dparrange(BasicOperator(capacity), ts)
    expected = brute(capacity, ts)
    if np.isinf(expected):
        assert np.isinf(obj)
        return
    assert np.isclose(obj, expected)
    assert sum(alloc) <= capacity
    assert all(k in t.choices for t, k in zip(ts, alloc, strict=True))
    assert np.isclose(
        sum(float(t.durations[list(t.choices).index(k)]) for t, k in zip(ts, alloc, strict=True)),
        obj,
    )


@settings(max_examples=100, deadline=None)
@given(tasks(discrete=False), st.integers(0, 20))
def test_every_prefix_is_optimal(ts: list[Task], capacity: int) -> None:
    table = DpTable(BasicOperator(capacity), ts)
    for t in range(len(ts) + 1):
        assert np.isclose(table.objective(t), brute(capacity, ts[:t])) or (
            np.isinf(table.objective(t)) and np.isinf(brute(capacity, ts[:t]))
        )


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 8), st.floats(1, 50), st.floats(0, 1)),
        min_size=1,
        max_size=5,
    ),
    st.integers(0, 30),
)
def test_greedy_fast_path_equals_dp(spec: list[tuple[int, int, float, float]], cap: int) -> None:
    ts = []
    for lo, width, t_ori, p in spec:
        choices = np.arange(lo, lo + width, dtype=np.int64)
        ts.append(Task(choices, Amdahl(t_ori, p).durations(choices)))
    assert greedy_applies(ts)
    dp, greedy = DpTable(BasicOperator(cap), ts), GreedyTable(cap, ts)
    for t in range(len(ts) + 1):
        a, b = dp.objective(t), greedy.objective(t)
        assert (np.isinf(a) and np.isinf(b)) or np.isclose(a, b)
        if np.isfinite(b):
            alloc = greedy.allocation(t)
            assert sum(alloc) <= cap
            assert all(k in task.choices for task, k in zip(ts[:t], alloc, strict=True))


chunk_counts = st.tuples(st.integers(0, 3), st.integers(0, 2), st.integers(0, 2), st.integers(0, 3))


@settings(max_examples=150, deadline=None)
@given(chunk_counts, st.lists(st.sampled_from([1, 2, 4, 8]), max_size=8))
def test_chunk_operator_follows_buddy_rule(counts: tuple[int, ...], reqs: list[int]) -> None:
    """Every transition of the DP is a legal smallest-fit take on a concrete buddy pool."""
    op = ChunkOperator(counts)
    free = _concrete(counts)
    state = op.start
    for k in reqs:
        nxt = op._next[state, chunk_level(k)]
        got = _take(free, k)
        assert (nxt < 0) == (got is None)
        if got is None:
            break
        start, size = got
        assert size == k
        assert start % size == 0
        assert start + size <= 8 * 16
        state = int(nxt)
        sizes = [s for _, s in free]
        assert op.decode(state) == tuple(sizes.count(s) for s in (1, 2, 4, 8))


def _concrete(counts: tuple[int, ...]) -> list[tuple[int, int]]:
    """Free aligned chunks (start, size), each in its own 8-GPU node for simplicity."""
    out, node = [], 0
    for size, c in zip((1, 2, 4, 8), counts, strict=True):
        for _ in range(c):
            out.append((node * 8, size))
            node += 1
    return out


def _take(free: list[tuple[int, int]], k: int) -> tuple[int, int] | None:
    fitting = [c for c in free if c[1] >= k]
    if not fitting:
        return None
    start, size = min(fitting, key=lambda c: (c[1], c[0]))
    free.remove((start, size))
    while size > k:
        size //= 2
        free.append((start + size, size))
    return start, size


@settings(max_examples=100, deadline=None)
@given(chunk_counts, st.lists(st.tuples(st.floats(1, 20), st.floats(0, 1)), min_size=1, max_size=4))
def test_chunk_dparrange_equals_brute_force(
    counts: tuple[int, ...], spec: list[tuple[float, float]]
) -> None:
    choices = np.array([1, 2, 4, 8], dtype=np.int64)
    ts = [Task(choices, Amdahl(t, p).durations(choices)) for t, p in spec]
    obj, alloc = dparrange(ChunkOperator(counts), ts)
    best = float("inf")
    for combo in itertools.product(range(4), repeat=len(ts)):
        c: tuple[int, ...] | None = counts
        for i in combo:
            c = take_chunk(c, i) if c is not None else None
        if c is not None:
            best = min(best, sum(float(t.durations[i]) for t, i in zip(ts, combo, strict=True)))
    assert (np.isinf(obj) and np.isinf(best)) or np.isclose(obj, best)
    if alloc:
        c2: tuple[int, ...] | None = counts
        for k in alloc:
            c2 = take_chunk(c2, chunk_level(k)) if c2 is not None else None
        assert c2 is not None


def test_chunk_level_rejects_more_than_a_node() -> None:
    assert [chunk_level(k) for k in (1, 2, 3, 4, 5, 8)] == [0, 1, 2, 2, 3, 3]
    try:
        chunk_level(9)
    except ValueError:
        return
    raise AssertionError("9 GPUs must be rejected")
