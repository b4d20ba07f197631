"""Weighted fair queueing across jobs, and Jain's index."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.policies.quota_fair import FairQueue, jain_index, weighted_jain


def test_jain_index_bounds() -> None:
    assert jain_index([5, 5, 5]) == 1.0
    assert jain_index([1, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([]) == 1.0
    assert weighted_jain({"a": 10, "b": 20}, {"b": 2}) == 1.0


def saturate(weights: dict[str, float], callers: int, serves: int) -> Counter[str]:
    """Closed loop: every caller of every job waits in the queue; each served caller asks again."""
    queue: FairQueue[int] = FairQueue(weights)
    for job in weights:
        for caller in range(callers):
            queue.push(job, caller)
    served: Counter[str] = Counter()
    for _ in range(serves):
        job, caller = queue.pop()
        served[job] += 1
        queue.push(job, caller)
    return served


def test_three_jobs_of_100_callers_share_equally() -> None:
    served = saturate({"a": 1, "b": 1, "c": 1}, callers=100, serves=3000)
    assert jain_index(served.values()) >= 0.95
    assert max(served.values()) - min(served.values()) <= 1


def test_weights_are_honoured() -> None:
    weights = {"a": 1.0, "b": 2.0, "c": 3.0}
    served = saturate(weights, callers=100, serves=6000)
    assert served == pytest.approx({"a": 1000, "b": 2000, "c": 3000}, abs=3)
    assert weighted_jain(dict(served), weights) >= 0.99


def test_a_job_with_many_callers_does_not_crowd_out_one_with_few() -> None:
    queue: FairQueue[str] = FairQueue()
    for i in range(100):
        queue.push("big", f"b{i}")
    queue.push("small", "s0")
    order = [queue.pop()[0] for _ in range(3)]
    assert "small" in order


def test_an_idle_job_banks_no_credit() -> None:
    queue: FairQueue[int] = FairQueue()
    for i in range(50):
        queue.push("a", i)
    for _ in range(40):
        queue.pop()
    for i in range(10):
        queue.push("b", i)
    first = [queue.pop()[0] for _ in range(10)]
    assert Counter(first)["a"] >= 4, "b is served fairly from now, not 40 calls in a row"


def test_peek_matches_pop_and_fifo_within_a_job() -> None:
    queue: FairQueue[int] = FairQueue()
    assert queue.peek() is None
    for i in range(3):
        queue.push("a", i)
    assert queue.peek() == ("a", 0)
    assert [queue.pop()[1] for _ in range(3)] == [0, 1, 2]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.pop()
    with pytest.raises(ValueError, match="weight"):
        queue.set_weight("a", 0)


@settings(max_examples=60, deadline=None)
@given(
    weights=st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=2, max_size=5),
    costs=st.lists(st.integers(1, 4), min_size=200, max_size=200),
)
def test_backlogged_service_per_weight_stays_within_the_sfq_bound(
    weights: list[float], costs: list[int]
) -> None:
    jobs = {f"j{i}": w for i, w in enumerate(weights)}
    queue: FairQueue[int] = FairQueue(jobs)
    stream = iter(costs * 10)
    for job in jobs:
        for _ in range(3):
            c = next(stream)
            queue.push(job, c, cost=c)
    work = dict.fromkeys(jobs, 0.0)
    for _ in range(300):
        job, cost = queue.pop()
        work[job] += cost
        c = next(stream)
        queue.push(job, c, cost=c)
    norm = [work[j] / w for j, w in jobs.items()]
    bound = max(4 / w for w in weights) * 2
    assert max(norm) - min(norm) <= bound + 1e-9
