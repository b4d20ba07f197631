"""Wait for a resident copy or restore a new one (``gpu_wait``): a call waits for a busy chunk
holding its service when that finishes it before a restore would; the k-th queued call restores
once the wait behind the copy exceeds the restore; a waiting call restores when the copy
vanishes or its chunk's call overruns its prediction."""

from __future__ import annotations

import pytest

from services.scheduler.core import gpu_wait
from services.scheduler.core.scheduler import SchedulerCore
from tangram.contract import DurationHint, NodeReport, RunningAction, ServiceSpec

from .test_scheduler_gpu import core_with, done, gpu_report, infer, prepared, starts

ONE = ServiceSpec("one", "pkg.models:one", dops=(1,), max_batch=1)
RIVAL = ServiceSpec("rival", "pkg.models:rival", dops=(1,), max_batch=1)
SECOND = DurationHint(t_ori_s=1.0, parallel_fraction=0.0)  # 1 s on any chunk


def core(gpus: int, restore_s: float, resident: tuple[int, ...] = (0,)) -> SchedulerCore:
    """``gpus`` GPUs at 2 GB/s; ONE (restoring in ``restore_s``) resident on ``resident``,
    RIVAL resident on GPU 0."""
    c = core_with(gpu_report(gpus=gpus, services=services(restore_s, resident)))
    c.restore_services([ONE, RIVAL])
    return c


def services(restore_s: float, resident: tuple[int, ...]) -> tuple:
    footprint = int(restore_s * 2.0 * 1024)
    return prepared(ONE, footprint, {1: resident}) + prepared(RIVAL, 1024, {1: (0,)})


def report(c: SchedulerCore, restore_s: float, resident: tuple[int, ...], gpus: int) -> None:
    """A full report of g0 listing what it runs (so nothing is taken for lost)."""
    runs = tuple(RunningAction(aid, r.action.attempt, "", r.cores) for aid, r in c.running.items())
    base = gpu_report(gpus=gpus, services=services(restore_s, resident))
    c.node_report(NodeReport(**{**_fields(base), "running": runs}), 0.5)


def _fields(r: NodeReport) -> dict[str, object]:
    return {f: getattr(r, f) for f in r.__struct_fields__}


def call(aid: str, service: str = "one", now: float = 0.0):  # type: ignore[no-untyped-def]
    return infer(aid, service, now=now, hint=SECOND)


def test_a_call_waits_for_a_busy_resident_chunk_that_frees_before_a_restore() -> None:
    c = core(gpus=2, restore_s=4.0)
    c.enqueue(call("a"), 0.0)
    (a,) = starts(c.schedule(0.0))
    assert a.gpus == (0,)  # resident: no restore
    c.enqueue(call("b", now=0.1), 0.1)
    assert starts(c.schedule(0.1)) == []  # GPU 1 is free, but 1.0 + 1 s beats 4 s + 1 s
    assert list(c.queue) == ["b"]
    c.complete(done(a), 1.0)
    (b,) = starts(c.schedule(1.0))
    assert b.gpus == (0,)


def test_a_restore_sooner_than_the_wait_is_taken() -> None:
    c = core(gpus=2, restore_s=0.5)
    c.enqueue(call("a"), 0.0)
    starts(c.schedule(0.0))
    c.enqueue(call("b", now=0.1), 0.1)
    (b,) = starts(c.schedule(0.1))  # 0.5 s + 1 s ends before 1.0 + 1 s
    assert b.gpus == (1,)


def test_the_kth_queued_call_restores_once_the_wait_behind_the_copy_exceeds_it() -> None:
    """The copy frees at 1.0, then runs the calls booked on it: b ends at 2, c at 3, d at 4;
    a restore on the free GPU ends at 2.5 + 1 = 3.5, so b and c wait and d restores."""
    c = core(gpus=2, restore_s=2.5)
    c.enqueue(call("a"), 0.0)
    starts(c.schedule(0.0))
    for aid in ("b", "c", "d"):
        c.enqueue(call(aid), 0.0)
    (d,) = starts(c.schedule(0.0))
    assert (d.action.spec.action_id, d.gpus) == ("d", (1,))
    assert list(c.queue) == ["b", "c"]


def test_on_a_contended_pool_a_call_waits_rather_than_restore_a_little_sooner() -> None:
    """As ``test_a_restore_sooner_than_the_wait_is_taken``, but four RIVAL calls queue for the
    two free GPUs: b's restore would take a GPU they need, so it counts twice (ends at
    0.1 + 2 x 0.5 + 1 = 2.1, after the copy's 2.0): b waits for the copy, the rivals get the
    free GPUs."""
    c = core(gpus=3, restore_s=0.5)
    c.enqueue(call("a"), 0.0)
    starts(c.schedule(0.0))
    c.enqueue(call("b", now=0.1), 0.1)
    for aid in ("r1", "r2", "r3", "r4"):
        c.enqueue(call(aid, "rival", now=0.1), 0.1)
    started = {s.action.spec.action_id: s.gpus for s in starts(c.schedule(0.1))}
    assert "b" not in started
    assert sorted(started.values()) == [(1,), (2,)]
    assert "b" in c.queue


def test_a_restore_counts_more_only_while_other_services_want_the_free_gpus() -> None:
    assert gpu_wait.restore_weight(rivals=0, free_gpus=4) == 1.0
    assert gpu_wait.restore_weight(rivals=4, free_gpus=4) == 1.0  # room for every rival
    assert gpu_wait.restore_weight(rivals=6, free_gpus=2) == 3.0
    assert gpu_wait.restore_weight(rivals=10, free_gpus=0) == 1.0 + gpu_wait.MAX_EXTRA_RESTORES
    assert gpu_wait.restore_weight(rivals=10**6, free_gpus=3) == 1.0 + gpu_wait.MAX_EXTRA_RESTORES


def test_a_free_resident_copy_takes_one_call_and_the_next_waits_behind_it() -> None:
    """Two calls, the copy free on GPU 0: the first takes it; the second would end at 2 behind
    it, a restore at 3 + 1: it waits rather than restoring beside the copy."""
    c = core(gpus=2, restore_s=3.0)
    c.enqueue(call("a"), 0.0)
    c.enqueue(call("b"), 0.0)
    (a,) = starts(c.schedule(0.0))
    assert (a.action.spec.action_id, a.gpus) == ("a", (0,))
    assert list(c.queue) == ["b"]


def test_a_waiting_call_restores_when_the_resident_copy_vanishes() -> None:
    """ONE is cached on GPU 0 while a RIVAL call runs there: b waits for it, until the node
    reports the copy gone (evicted); then b restores on the free GPU."""
    c = core(gpus=2, restore_s=4.0)
    c.enqueue(call("r", "rival"), 0.0)
    (r,) = starts(c.schedule(0.0))
    assert r.gpus == (0,)
    c.enqueue(call("b", now=0.1), 0.1)
    assert starts(c.schedule(0.1)) == []
    report(c, 4.0, resident=(), gpus=2)
    (b,) = starts(c.schedule(0.5))
    assert b.gpus == (1,)


def test_a_waiting_call_restores_when_the_copy_overruns_its_prediction() -> None:
    """a was predicted to end at 1.0; at 1.5 it may end any moment (b still waits), past 2.0
    (twice its prediction) the prediction is wrong and b restores."""
    c = core(gpus=2, restore_s=4.0)
    c.enqueue(call("a"), 0.0)
    starts(c.schedule(0.0))
    c.enqueue(call("b"), 0.0)
    assert starts(c.schedule(1.5)) == []
    (b,) = starts(c.schedule(2.1))
    assert b.gpus == (1,)


def test_a_cancelled_call_s_chunk_is_not_waited_for() -> None:
    c = core_with(gpu_report(gpus=2, services=services(4.0, (0,))), kill_grace_s=10.0)
    c.restore_services([ONE, RIVAL])
    c.enqueue(call("a"), 0.0)
    starts(c.schedule(0.0))
    c.cancel("a", 0.1)  # may be stuck: its chunk frees at no known time
    c.enqueue(call("b"), 0.2)
    (b,) = starts(c.schedule(0.2))
    assert b.gpus == (1,)


# ---------------------------------------------------------------------- pure parts


def test_until_trusts_a_prediction_up_to_twice_its_duration() -> None:
    assert gpu_wait.until(3.0, 1.0, 2.0) == 3.0
    assert gpu_wait.until(3.0, 1.0, 4.5) == 4.5  # overrunning: may end now
    assert gpu_wait.until(3.0, 1.0, 5.5) == gpu_wait.NEVER


@pytest.mark.parametrize(("max_batch", "ends"), [(1, [2.0, 3.0, 4.0]), (2, [2.0, 2.0, 3.0])])
def test_a_copy_runs_its_bookings_max_batch_at_a_time(max_batch: int, ends: list[float]) -> None:
    copy = gpu_wait.Copy("g0", (0,), free_at=1.0, joinable=False)
    assert [copy.book(1.0, max_batch, 0.0) for _ in ends] == ends
