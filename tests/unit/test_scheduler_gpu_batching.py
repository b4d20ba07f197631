"""Co-batching in the scheduler core: calls to a service running on a chunk share it up to its
max_batch (no free GPU taken), never two services on one GPU, the chunk freed on its last
call's end, and a cancel or a node's loss of a shared chunk."""

from __future__ import annotations

from services.scheduler.core.scheduler import SchedulerCore
from tangram.contract import ErrorKind, NodeLeaving, NodeReport, ServiceSpec

from .test_scheduler_gpu import core_with, done, finishes, gpu_report, infer, prepared, starts

HOT = ServiceSpec("hot", "pkg.models:hot", max_batch=3)
COLD = ServiceSpec("cold", "pkg.models:cold", max_batch=3)


def core(gpus: int = 1, policy: str = "elastic", **cfg: object) -> SchedulerCore:
    c = core_with(
        gpu_report(gpus=gpus, services=prepared(HOT) + prepared(COLD)), policy=policy, **cfg
    )
    c.restore_services([HOT, COLD])
    return c


def ids(effects: list) -> list[str]:
    return [s.action.spec.action_id for s in starts(effects)]


def test_calls_share_a_chunk_up_to_max_batch_then_wait() -> None:
    c = core()
    for i in range(5):
        c.enqueue(infer(f"a{i}", "hot"), 0.0)
    first = starts(c.schedule(0.0))
    assert [s.action.spec.action_id for s in first] == ["a0", "a1", "a2"]
    assert {s.gpus for s in first} == {(0,)}
    assert list(c.queue) == ["a3", "a4"]
    c.complete(done(first[0]), 1.0)
    assert 0 not in c.nodes["g0"].free  # two calls still on it
    assert ids(c.schedule(1.0)) == ["a3"]  # room for one more, on the busy chunk


def test_joining_a_running_chunk_takes_no_free_gpu() -> None:
    for policy in ("elastic", "min"):
        c = core(gpus=2, policy=policy)
        c.enqueue(infer("a", "hot"), 0.0)
        (a,) = starts(c.schedule(0.0))
        c.enqueue(infer("b", "hot"), 0.5)
        (b,) = starts(c.schedule(0.5))
        assert b.gpus == a.gpus
        assert len(c.nodes["g0"].free) == 1  # the other GPU stays free


def test_a_backlog_is_granted_chunks_per_batch_not_per_call() -> None:
    c = core(gpus=2)
    for i in range(5):
        c.enqueue(infer(f"a{i}", "hot"), 0.0)
    runs = starts(c.schedule(0.0))
    per_chunk: dict[tuple[int, ...], int] = {}
    for s in runs:
        per_chunk[s.gpus] = per_chunk.get(s.gpus, 0) + 1
    assert sorted(per_chunk.values()) == [2, 3]  # groups of max_batch, one chunk each


def test_never_two_services_on_one_gpu() -> None:
    c = core()
    c.enqueue(infer("h", "hot"), 0.0)
    (h,) = starts(c.schedule(0.0))
    c.enqueue(infer("c", "cold"), 0.1)
    c.enqueue(infer("h2", "hot"), 0.2)
    assert ids(c.schedule(0.2)) == ["h2"]  # cold waits; hot joins
    c.complete(done(h), 1.0)
    assert ids(c.schedule(1.0)) == []  # h2 still holds the GPU
    (h2,) = [r for r in c.running.values() if r.action.spec.action_id == "h2"]
    c.complete(done(starts_of(h2)), 2.0)
    assert c.nodes["g0"].free == {0}
    (cold,) = starts(c.schedule(2.0))
    assert cold.action.spec.action_id == "c"
    assert cold.service == COLD


def test_the_chunk_frees_on_its_last_call_only() -> None:
    c = core()
    for i in range(3):
        c.enqueue(infer(f"a{i}", "hot"), 0.0)
    runs = starts(c.schedule(0.0))
    for r in runs[:2]:
        c.complete(done(r), 1.0)
        assert c.nodes["g0"].free == set()
    out = finishes(c.complete(done(runs[2], output=[1.0]), 1.0))
    assert out["a2"].status == "succeeded"
    assert c.nodes["g0"].free == {0}


def test_a_cancelled_call_closes_its_chunk_to_new_calls() -> None:
    c = core(gpus=2, kill_grace_s=1.0)
    c.enqueue(infer("a", "hot"), 0.0)
    c.enqueue(infer("b", "hot"), 0.0)
    a, b = starts(c.schedule(0.0))
    c.cancel("a", 0.1)
    c.enqueue(infer("n", "hot"), 0.2)
    (n,) = starts(c.schedule(0.2))
    assert n.gpus != a.gpus  # the cancelled call may be stuck there: not joined
    out = finishes(c.tick(1.5))  # the node never confirmed the kill: it ends cancelled ...
    assert out["a"].error is not None
    assert out["a"].error.kind is ErrorKind.CANCELLED
    c.complete(done(b), 2.0)
    assert not set(a.gpus) <= c.nodes["g0"].free  # ... and its chunk stays booked
    c.complete(done(a), 3.0)  # the process is over after all
    assert set(a.gpus) <= c.nodes["g0"].free


def test_losing_the_node_fails_every_call_on_a_shared_chunk() -> None:
    c = core()
    for i in range(3):
        c.enqueue(infer(f"a{i}", "hot"), 0.0)
    assert len(starts(c.schedule(0.0))) == 3
    leave = NodeLeaving(node_id="g0", incarnation="i0", started=("a0", "a1", "a2"))
    out = finishes(c.node_leaving(leave, 1.0))
    assert sorted(out) == ["a0", "a1", "a2"]
    assert {r.error.kind for r in out.values() if r.error} == {ErrorKind.NODE_DIED}
    c.node_report(gpu_report(inc="i1", gpus=1, services=prepared(HOT)), 2.0)
    assert c.nodes["g0"].free == {0}
    c.enqueue(infer("b", "hot"), 2.0)
    assert ids(c.schedule(2.0)) == ["b"]


def test_a_restarted_node_agent_frees_its_shared_chunk() -> None:
    c = core()
    for i in range(2):
        c.enqueue(infer(f"a{i}", "hot"), 0.0)
    assert len(starts(c.schedule(0.0))) == 2
    out = finishes(c.node_report(gpu_report(inc="i1", gpus=1, services=prepared(HOT)), 1.0))
    assert sorted(out) == ["a0", "a1"]
    assert c.nodes["g0"].free == {0}


def test_max_batch_one_never_shares() -> None:
    one = ServiceSpec("hot", "pkg.models:hot", max_batch=1)
    c = core_with(gpu_report(gpus=2, services=prepared(one)))
    c.restore_services([one])
    for i in range(3):
        c.enqueue(infer(f"a{i}", "hot"), 0.0)
    runs = starts(c.schedule(0.0))
    assert len(runs) == 2
    assert len({s.gpus for s in runs}) == 2


def test_hrrs_joins_too() -> None:
    c = core(gpus=1, gpu_order="hrrs")
    c.enqueue(infer("a", "hot"), 0.0)
    c.schedule(0.0)
    c.enqueue(infer("c", "cold"), 0.1)
    c.enqueue(infer("b", "hot"), 0.2)
    assert ids(c.schedule(0.3)) == ["b"]


def starts_of(run: object) -> object:
    """A StartOnNode-like view of a running call, enough for ``done``."""
    from services.scheduler.core.books import Dispatched
    from services.scheduler.core.effects import StartOnNode

    assert isinstance(run, Dispatched)
    return StartOnNode(run.node_id, run.action, (), run.incarnation, gpus=run.cores)


def test_service_states_sum_the_calls_and_batches_gpu_nodes_report() -> None:
    import msgspec

    def ran(node: str, calls: int, batches: int) -> NodeReport:
        services = tuple(
            msgspec.structs.replace(p, calls=calls, batches=batches) for p in prepared(HOT)
        )
        return gpu_report(node, services=services)

    c = core_with(ran("g0", 10, 3), ran("g1", 4, 4))
    c.restore_services([HOT])
    (state,) = [s for s in c.service_states() if s.spec.name == "hot"]
    assert (state.calls, state.batches) == (14, 7)
