"""Policies: capacity, allowed sets, FCFS prefixes and progress; the multi-resource Algorithm 1."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.dparrange import Task
from services.scheduler.durations import Amdahl
from services.scheduler.elastic import (
    ElasticPolicy,
    FixedDopPolicy,
    Releases,
    TrajectoryStaticPolicy,
)
from services.scheduler.multiresource import Queue, candidates, schedule
from services.scheduler.policy import Busy, Waiting, make_policy


@st.composite
def waiting_lists(draw: st.DrawFn) -> list[Waiting]:
    out = []
    for i in range(draw(st.integers(0, 12))):
        if draw(st.booleans()):
            choices = tuple(sorted(draw(st.sets(st.sampled_from([1, 2, 4, 8]), min_size=1))))
        else:
            lo = draw(st.integers(1, 4))
            choices = tuple(range(lo, lo + draw(st.integers(1, 16))))
        hinted = draw(st.booleans())
        out.append(Waiting(
            f"a{i}", choices, float(i), "p" if hinted else "",
            draw(st.floats(0.5, 500)) if hinted else None,
            draw(st.floats(0, 1)) if hinted else None, f"t{i % 4}",
        ))  # fmt: skip
    return out


running_lists = st.lists(
    st.tuples(st.integers(1, 8), st.one_of(st.none(), st.floats(0, 100))), max_size=5
).map(lambda xs: [Busy(f"r{i}", u, 0.0, e) for i, (u, e) in enumerate(xs)])

POLICIES = ["min", "elastic", "elastic:3", "fixed-dop:4", "fixed-dop:16"]


@pytest.mark.parametrize("spec", POLICIES)
@settings(max_examples=60, deadline=None)
@given(waiting_lists(), st.integers(0, 64), running_lists)
def test_grants_fit_are_allowed_and_a_prefix(
    spec: str, waiting: list[Waiting], free: int, running: list[Busy]
) -> None:
    grants = make_policy(spec).arrange(waiting, free, free + 8, running, 10.0)
    assert len(grants) <= len(waiting)  # a prefix: nobody behind starts before anyone ahead
    assert sum(grants) <= free
    assert all(g in w.choices for w, g in zip(waiting, grants, strict=False))


@pytest.mark.parametrize("spec", POLICIES)
@settings(max_examples=60, deadline=None)
@given(waiting_lists(), st.integers(0, 64))
def test_head_that_fits_starts_when_the_pool_is_idle(
    spec: str, waiting: list[Waiting], free: int
) -> None:
    """Progress: with nothing running no completion would come, so the head must start now."""
    grants = make_policy(spec).arrange(waiting, free, free, [], 0.0)
    if waiting and waiting[0].min <= free and (spec == "min" or spec.startswith("elastic")):
        assert grants


def test_elastic_spreads_idle_units_over_scalable_actions() -> None:
    w = [Waiting(f"a{i}", tuple(range(1, 33)), 0.0, "r", 100.0, 0.95) for i in range(4)]
    grants = ElasticPolicy().arrange(w, 64, 64, [], 0.0)
    assert grants == [16, 16, 16, 16]


def test_elastic_gives_unknown_elasticity_its_minimum() -> None:
    w = [Waiting("a", (2, 3, 4, 5, 6), 0.0, "never-seen")]
    assert ElasticPolicy().arrange(w, 64, 64, [], 0.0) == [2]


def test_elastic_learns_elasticity_from_completions() -> None:
    policy = ElasticPolicy()
    for units in (1, 2, 4, 8):
        policy.observe("tests", units, 100.0 * (0.05 + 0.95 / units))
    w = [Waiting("a", tuple(range(1, 17)), 0.0, "tests")]
    assert policy.arrange(w, 16, 16, [], 0.0) == [16]


def test_elastic_waits_for_a_large_allocation_when_it_comes_soon() -> None:
    """A long scalable action with one core free and 31 coming back in 1 s waits for them."""
    w = [Waiting("a", tuple(range(1, 33)), 0.0, "r", 1000.0, 0.99)]
    running = [Busy("b", 31, 0.0, expected_end=1.0)]
    assert ElasticPolicy().arrange(w, 1, 32, running, 0.0) == []


def test_fixed_dop_clamps_into_the_allowed_set() -> None:
    w = [Waiting("a", (1, 2, 8), 0.0), Waiting("b", (1,), 0.0), Waiting("c", (6, 7), 0.0)]
    assert FixedDopPolicy(4).arrange(w, 64, 64, [], 0.0) == [2, 1, 6]


def test_trajectory_static_reserves_per_trajectory() -> None:
    pol = TrajectoryStaticPolicy(2)
    w = [Waiting(f"a{i}", (1, 2, 4), 0.0, trajectory_id=f"t{i}") for i in range(3)]
    assert pol.arrange(w, 4, 4, [], 0.0) == [2, 2]  # the third trajectory gets no reservation
    later = [
        Waiting("a3", (1,), 1.0, trajectory_id="t2"),
        Waiting("a4", (1,), 1.0, trajectory_id="t0"),
    ]
    assert pol.arrange(later, 4, 4, [], 1.0) == [0, 1]  # t0 runs inside its own reservation
    pol.close_trajectory("t1")
    assert pol.arrange(later, 4, 4, [], 2.0) == [1, 1]


@st.composite
def multi_queues(draw: st.DrawFn) -> tuple[Queue, np.ndarray]:
    k = draw(st.integers(2, 4))
    n = draw(st.integers(0, 20))
    mins = np.array([[draw(st.integers(0, 3)) for _ in range(k)] for _ in range(n)],
                    dtype=np.int64).reshape(n, k)  # fmt: skip
    key = np.array([draw(st.integers(0, k - 1)) for _ in range(n)], dtype=np.int64)
    tasks, elastic = [], []
    for i in range(n):
        lo = max(1, int(mins[i, key[i]]))
        mins[i, key[i]] = lo
        choices = np.arange(lo, lo + draw(st.integers(1, 8)), dtype=np.int64)
        model = Amdahl(draw(st.floats(1, 100)), draw(st.floats(0, 1)))
        tasks.append(Task(choices, model.durations(choices)))
        elastic.append(model.elastic and choices.size > 1)
    free = np.array([draw(st.integers(0, 24)) for _ in range(k)], dtype=np.int64)
    return Queue(mins, key, tasks, elastic), free


@settings(max_examples=100, deadline=None)
@given(multi_queues())
def test_multi_resource_never_exceeds_capacity(qf: tuple[Queue, np.ndarray]) -> None:
    q, free = qf
    k = free.size
    d = schedule(q, free, 0.0, [Releases((), ())] * k)
    n = candidates(q.mins, free)
    assert all(i < n for i in d.started)
    use = np.zeros(k, dtype=np.int64)
    for i, u in zip(d.started, d.units, strict=True):
        assert u in q.tasks[i].choices
        row = q.mins[i].copy()
        row[q.key[i]] = u
        use += row
    assert np.all(use <= free)
