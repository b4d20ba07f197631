"""The scheduler core's GPU half on a virtual clock: buddy-chunk grants, residency, restore cost,
HRRS, unknown services, device failures and the registration bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.formulation import formulate_infer
from services.scheduler.core import gpu, gpu_sched
from services.scheduler.core.books import GpuFacts
from services.scheduler.core.effects import Finish, PrepareOnNode, ServiceSettled, StartOnNode
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.spec import make_policy
from tangram.contract import (
    ActionResult,
    ActionSpec,
    Completion,
    DurationHint,
    ErrorKind,
    GpuDevice,
    InferAction,
    Inventory,
    NodeLeaving,
    NodeReport,
    Outcome,
    PreparedService,
    ServiceSpec,
    UnifiedAction,
)

from .core_kit import report as cpu_report

JUDGE = ServiceSpec("judge", "pkg.models:judge", dops=(1, 2, 4))


def infer(
    aid: str, service: str = "judge", now: float = 0.0, hint: DurationHint | None = None
) -> UnifiedAction:
    spec = ActionSpec(
        action_id=aid,
        job_id="j",
        trajectory_id="",
        action=InferAction(service=service, payload={"x": 1}),
        duration=hint,
    )
    return formulate_infer(spec, now=now)


def prepared(
    spec: ServiceSpec = JUDGE,
    footprint: int = 2048,
    resident: dict[int, tuple[int, ...]] | None = None,
) -> tuple[PreparedService, ...]:
    where = resident or {}
    return tuple(
        PreparedService(
            name=spec.name, dop=d, footprint_mb=footprint * d, resident=where.get(d, ())
        )
        for d in spec.dops
    )


def gpu_report(
    node: str = "g0",
    inc: str = "i0",
    gpus: int = 8,
    services: tuple[PreparedService, ...] = (),
    listed: tuple[int, ...] | None = None,
    gbps: float = 2.0,
) -> NodeReport:
    devices = tuple(
        GpuDevice(index=i, memory_mb=16_000) for i in (range(gpus) if listed is None else listed)
    )
    inv = Inventory(kind="gpu", gpus=devices, restore_gb_per_s=gbps)
    return NodeReport(node_id=node, incarnation=inc, inventory=inv, full=True, services=services)


def core_with(*reports: NodeReport, policy: str = "elastic", **cfg: object) -> SchedulerCore:
    core = SchedulerCore(make_policy(policy), CoreConfig(**cfg))  # type: ignore[arg-type]
    core.restore_services([JUDGE])
    for r in reports:
        core.node_report(r, 0.0)
    return core


def starts(effects: list) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def finishes(effects: list) -> dict[str, ActionResult]:
    return {e.result.action_id: e.result for e in effects if isinstance(e, Finish)}


def done(run: StartOnNode, **outcome: object) -> Completion:
    return Completion(
        node_id=run.node_id,
        incarnation=run.incarnation,
        action_id=run.action.spec.action_id,
        attempt=run.action.attempt,
        outcome=Outcome(started_at=1.0, finished_at=2.0, **outcome),  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------- chunks


def test_free_chunks_are_maximal_buddies() -> None:
    ok = [True] * 8
    assert gpu.free_chunks(ok) == [gpu.Chunk(0, 8)]
    ok[1] = False
    assert gpu.chunk_counts(gpu.free_chunks(ok)) == (1, 1, 1, 0)  # 0 | 2-3 | 4-7
    assert gpu.free_chunks([True] * 3) == [gpu.Chunk(0, 2), gpu.Chunk(2, 1)]


def test_pick_takes_smallest_level_then_the_resident_chunk() -> None:
    chunks = gpu.free_chunks([False, True, True, True, True, True, True, True])
    none: frozenset[int] = frozenset()
    assert gpu.pick(chunks, 1, none) == gpu.Chunk(1, 1)  # the lone GPU, not a split
    assert gpu.pick(chunks, 2, none) == gpu.Chunk(2, 2)
    assert gpu.pick(chunks, 4, frozenset({4, 5, 6, 7})) == gpu.Chunk(4, 4)
    full = gpu.free_chunks([True] * 8)
    assert gpu.pick(full, 2, frozenset({6, 7})) == gpu.Chunk(6, 2)  # the one caching it
    assert gpu.pick(chunks, 1, frozenset({5})) == gpu.Chunk(5, 1)  # warm beats a whole chunk
    assert gpu.pick(full, 2, frozenset({1, 2})) == gpu.Chunk(0, 2)  # no copy spans 1-2


def test_a_restore_lands_where_it_evicts_the_least_of_what_is_in_demand() -> None:
    """Four free GPUs: 0 holds a copy of a queued service, 1 a larger one of an idle service,
    2 a small idle one, 3 nothing. A restore of another service picks 3 (evicts nothing), then
    2, then 1 (idle copies only), then 0; without ``held`` the buddy rule's first chunk."""
    facts = GpuFacts(
        gpus=(0, 1, 2, 3),
        restore_gb_per_s=2.0,
        services={
            ("busy", 1): PreparedService(name="busy", footprint_mb=1000, resident=(0,)),
            ("idle", 1): PreparedService(name="idle", footprint_mb=4000, resident=(1,)),
            ("tiny", 1): PreparedService(name="tiny", footprint_mb=100, resident=(2,)),
            ("down", 1): PreparedService(name="down", error="no", resident=(3,)),
        },
    )
    held = gpu.cached(facts, {"busy"}.__contains__)
    assert held.hot == (1000.0, 0.0, 0.0, 0.0)
    assert held.every == (1000.0, 4000.0, 100.0, 0.0)
    none: frozenset[int] = frozenset()
    chunks = gpu.free_chunks([True] * 4)
    assert gpu.pick(chunks, 1, none, held) == gpu.Chunk(3, 1)
    assert gpu.pick(gpu.free_chunks([True, True, True, False]), 1, none, held) == gpu.Chunk(2, 1)
    assert gpu.pick(gpu.free_chunks([True, True, False, False]), 1, none, held) == gpu.Chunk(1, 1)
    assert gpu.pick(chunks, 2, none, held) == gpu.Chunk(2, 2)  # the pair without "busy"
    assert gpu.pick(chunks, 1, none) == gpu.Chunk(0, 1)
    assert gpu.pick(chunks, 1, frozenset({0}), held) == gpu.Chunk(0, 1)  # resident still first


def test_hrrs_score_favours_no_setup_and_ages() -> None:
    assert gpu.hrrs_score(1.0, 1.0, 0.0) > gpu.hrrs_score(1.0, 1.0, 4.0)
    assert gpu.hrrs_score(100.0, 1.0, 4.0) > gpu.hrrs_score(1.0, 1.0, 0.0)


# ---------------------------------------------------------------------- grants


RIVAL = ServiceSpec("rival", "pkg.models:rival", dops=(1, 2), max_batch=3)


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40)), min_size=1, max_size=60),
    gpus=st.sampled_from([1, 2, 3, 4, 6, 8]),
)
def test_grants_are_legal_chunks_shared_only_by_one_service_up_to_max_batch(
    ops: list[tuple[int, int]], gpus: int
) -> None:
    """Calls of two services come and go: every grant is a legal chunk; chunks never overlap;
    calls share a chunk only when they are of one service variant, at most its max_batch;
    a chunk's GPUs are free exactly when no call is on them."""
    core = core_with(gpu_report(gpus=gpus, services=prepared() + prepared(RIVAL)))
    core.restore_services([JUDGE, RIVAL])
    specs = {"judge": JUDGE, "rival": RIVAL}
    running: dict[str, StartOnNode] = {}
    n = 0
    for op, pick in ops:
        if op < 2:
            core.enqueue(infer(f"a{n}", ("judge", "rival")[op]), float(n))
            n += 1
        elif running:
            run = running.pop(sorted(running)[pick % len(running)])
            core.complete(done(run), float(n))
        for s in starts(core.schedule(float(n))):
            running[s.action.spec.action_id] = s
        chunks: dict[tuple[int, ...], list[StartOnNode]] = {}
        for s in running.values():
            chunks.setdefault(s.gpus, []).append(s)
        busy = [g for c in chunks for g in c]
        assert len(busy) == len(set(busy))  # distinct chunks never overlap
        assert set(busy) <= set(range(gpus))
        assert core.nodes["g0"].free == set(range(gpus)) - set(busy)
        for c, calls in chunks.items():
            size = len(c)
            assert size & (size - 1) == 0
            assert c[0] % size == 0
            assert c == tuple(range(c[0], c[0] + size))
            (name,) = {s.action.spec.action.service for s in calls}  # type: ignore[union-attr]
            assert all(s.service == specs[name] for s in calls)  # one service per chunk
            assert len(calls) <= specs[name].max_batch
            assert all(not s.cores for s in calls)


def test_dispatch_carries_gpus_service_and_result_output_restore() -> None:
    core = core_with(gpu_report(services=prepared()))
    core.enqueue(infer("a"), 0.0)
    (run,) = starts(core.schedule(0.0))
    assert run.gpus
    assert run.service == JUDGE
    assert run.units == run.gpus
    out = finishes(core.complete(done(run, output=[0.5], restore_s=0.25), 3.0))["a"]
    assert out.status == "succeeded"
    assert out.output == [0.5]
    assert out.timings is not None
    assert out.timings.restore_s == 0.25
    assert out.allocation is not None
    assert out.allocation.gpus == run.gpus
    assert not out.allocation.cores


def test_exec_actions_never_go_to_gpu_nodes() -> None:
    from .core_kit import action

    core = core_with(gpu_report(services=prepared()), cpu_report(node="c0"))
    core.enqueue(action("x", "t1"), 0.0)
    (run,) = starts(core.schedule(0.0))
    assert run.node_id == "c0"
    assert run.cores
    assert not run.gpus
    assert core.snapshot()["free_cores"] == 3


def test_resident_node_and_chunk_preferred() -> None:
    warm = prepared(resident={1: (5,)})
    core = core_with(gpu_report("g0", services=prepared()), gpu_report("g1", services=warm))
    core.enqueue(infer("a"), 0.0)
    (run,) = starts(core.schedule(0.0))
    assert (run.node_id, run.gpus) == ("g1", (5,))


def test_restore_cost_steers_the_dop_choice() -> None:
    """Hinted as nearly serial: the warm 1-GPU variant beats a cold 4-GPU one that must
    restore 8 GiB at 2 GB/s (4.29 s) first."""
    hint = DurationHint(t_ori_s=2.0, parallel_fraction=0.9)
    cold = core_with(gpu_report(services=prepared()))
    cold.enqueue(infer("a", hint=hint), 0.0)
    (c,) = starts(cold.schedule(0.0))
    warm = core_with(gpu_report(services=prepared(resident={1: (3,)})))
    warm.enqueue(infer("a", hint=hint), 0.0)
    (w,) = starts(warm.schedule(0.0))
    assert w.gpus == (3,)
    assert len(c.gpus) >= 1  # cold: it pays the restore whatever it gets
    facts = warm.nodes["g0"].gpu
    assert facts is not None
    assert gpu.restore_s(facts, "judge", 4) == pytest.approx(8192 * 2**20 / 1e9 / 2.0)


def test_hrrs_orders_warm_calls_first_fcfs_does_not() -> None:
    other = ServiceSpec("big", "pkg.models:big")
    services = prepared(resident={1: (0,)}) + prepared(other, footprint=16_000)
    for order, first in (("fcfs", "cold"), ("hrrs", "warm")):
        core = core_with(gpu_report(gpus=1, services=services), policy="min", gpu_order=order)
        core.restore_services([JUDGE, other])
        core.enqueue(infer("cold", "big", now=0.0), 0.0)
        core.enqueue(infer("warm", "judge", now=0.0), 0.0)
        (run,) = starts(core.schedule(0.5))
        assert run.action.spec.action_id == first


def test_unknown_service_fails_at_once_naming_the_registered() -> None:
    core = core_with(gpu_report(services=prepared()))
    core.enqueue(infer("a", "nope"), 0.0)
    err = finishes(core.schedule(0.0))["a"].error
    assert err is not None
    assert err.kind is ErrorKind.INVALID_REQUEST
    assert "'nope'" in err.message
    assert "judge" in err.message


def test_unprepared_service_waits_and_failed_everywhere_fails() -> None:
    core = core_with(gpu_report(services=()))
    core.enqueue(infer("a"), 0.0)
    assert core.schedule(0.0) == []
    assert "a" in core.queue
    bad = tuple(
        PreparedService(name="judge", dop=d, error="ImportError: no pkg") for d in (1, 2, 4)
    )
    core.node_report(gpu_report(services=bad), 1.0)
    err = finishes(core.schedule(1.0))["a"].error
    assert err is not None
    assert err.kind is ErrorKind.BACKEND_UNAVAILABLE
    assert "ImportError: no pkg" in err.message


def _bad(name: str = "judge") -> tuple[PreparedService, ...]:
    return tuple(PreparedService(name=name, dop=d, error="ImportError: no pkg") for d in (1, 2, 4))


def test_failed_everywhere_follows_reports_registrations_and_nodes() -> None:
    core = core_with(gpu_report("g0", services=_bad()), gpu_report("g1", services=_bad()))
    core.enqueue(infer("a"), 0.0)
    assert "a" in finishes(core.schedule(0.0))  # every node failed it
    core.node_report(gpu_report("g1", services=prepared()), 1.0)  # fixed on g1
    core.enqueue(infer("b"), 1.0)
    (run,) = starts(core.schedule(1.0))
    assert run.node_id == "g1"
    core.node_report(gpu_report("g1", services=_bad()), 2.0)
    core.node_report(gpu_report("g2", services=()), 2.0)  # a new node has not reported it
    core.enqueue(infer("c"), 2.0)
    assert core.schedule(2.0) == []  # so c waits
    core.node_leaving(NodeLeaving(node_id="g2", incarnation="i0", started=()), 3.0)
    assert "c" in finishes(core.schedule(3.0))  # the node left: failed everywhere again
    core.register_service(JUDGE, 4.0)  # a new registration forgets what the nodes said
    core.enqueue(infer("d"), 4.0)
    assert core.schedule(4.0) == []


def test_a_pass_recomputes_failed_everywhere_only_for_what_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    specs = [ServiceSpec(f"s{i}", "pkg.models:s", dops=(1,)) for i in range(20)]
    core = core_with(gpu_report(services=tuple(p for s in specs for p in prepared(s))))
    core.restore_services(specs)
    computed: list[str] = []
    real = gpu_sched.failed_everywhere

    def counted(spec: ServiceSpec, nodes: object) -> str:
        computed.append(spec.name)
        return real(spec, nodes)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu_sched, "failed_everywhere", counted)
    core.enqueue(infer("a", "s0"), 0.0)
    core.schedule(0.0)
    computed.clear()
    beat = gpu_report(services=tuple(p for s in specs for p in prepared(s, footprint=9)))
    core.node_report(beat, 1.0)  # a heartbeat: footprints changed, no error did
    core.enqueue(infer("b", "s1"), 1.0)
    core.schedule(1.0)
    assert computed == []
    failing = tuple(p for s in specs[1:] for p in prepared(s)) + _bad("s0")[:1]
    core.node_report(gpu_report(services=failing), 2.0)
    core.enqueue(infer("c", "s0"), 2.0)
    assert "c" in finishes(core.schedule(2.0))
    assert computed == ["s0"]


def test_device_oom_retries_once_on_a_larger_chunk() -> None:
    core = core_with(gpu_report(services=prepared()), policy="min")
    core.enqueue(infer("a"), 0.0)
    (first,) = starts(core.schedule(0.0))
    assert len(first.gpus) == 1
    assert core.complete(done(first, failure=ErrorKind.DEVICE_OOM), 1.0) == []
    (second,) = starts(core.schedule(1.0))
    assert len(second.gpus) == 2
    assert second.action.attempt == 2
    out = finishes(core.complete(done(second, failure=ErrorKind.DEVICE_OOM), 2.0))["a"]
    assert out.error is not None
    assert out.error.kind is ErrorKind.DEVICE_OOM


def test_device_oom_at_the_largest_dop_fails() -> None:
    one = ServiceSpec("judge", "pkg.models:judge")
    core = core_with(gpu_report(services=prepared(one)), policy="min")
    core.restore_services([one])
    core.enqueue(infer("a"), 0.0)
    (run,) = starts(core.schedule(0.0))
    out = finishes(core.complete(done(run, failure=ErrorKind.DEVICE_OOM), 1.0))["a"]
    assert out.error is not None
    assert out.error.kind is ErrorKind.DEVICE_OOM


def test_device_lost_stops_grants_until_listed_again() -> None:
    core = core_with(gpu_report(gpus=1, services=prepared()), policy="min")
    core.enqueue(infer("a"), 0.0)
    (run,) = starts(core.schedule(0.0))
    out = finishes(core.complete(done(run, failure=ErrorKind.DEVICE_LOST), 1.0))["a"]
    assert out.error is not None
    assert out.error.kind is ErrorKind.DEVICE_LOST
    core.enqueue(infer("b"), 1.0)
    assert starts(core.schedule(1.0)) == []
    core.node_report(gpu_report(gpus=1, services=prepared()), 2.0)  # still listed: still down
    assert starts(core.schedule(2.0)) == []
    core.node_report(gpu_report(gpus=1, services=prepared(), listed=()), 3.0)  # dropped ...
    core.node_report(gpu_report(gpus=1, services=prepared()), 4.0)  # ... and back: healthy
    assert [s.action.spec.action_id for s in starts(core.schedule(4.0))] == ["b"]


def test_gpu_node_death_fails_its_calls_node_died() -> None:
    core = core_with(gpu_report(services=prepared()))
    core.enqueue(infer("a"), 0.0)
    (run,) = starts(core.schedule(0.0))
    leave = NodeLeaving(node_id="g0", incarnation="i0", started=("a",))
    out = finishes(core.node_leaving(leave, 1.0))["a"]
    assert out.error is not None
    assert out.error.kind is ErrorKind.NODE_DIED
    assert out.allocation is not None
    assert out.allocation.gpus == run.gpus


# ---------------------------------------------------------------------- registration


def test_registration_prepares_everywhere_and_answers_when_all_reported() -> None:
    core = core_with(gpu_report("g0"), gpu_report("g1"), cpu_report(node="c0"))
    new = ServiceSpec("rm", "pkg.models:rm", dops=(1, 2))
    effects = core.register_service(new, 0.0)
    assert sorted(e.node_id for e in effects if isinstance(e, PrepareOnNode)) == ["g0", "g1"]
    assert not [e for e in effects if isinstance(e, ServiceSettled)]
    assert not [
        e
        for e in core.node_report(gpu_report("g0", services=prepared(new)), 1.0)
        if isinstance(e, ServiceSettled)
    ]
    failed = (PreparedService(name="rm", dop=1, error="boom"),)
    (settled,) = [
        e
        for e in core.node_report(gpu_report("g1", services=failed), 2.0)
        if isinstance(e, ServiceSettled)
    ]
    assert settled.error == ""
    assert settled.state.prepared_on == ("g0",)


def test_registration_all_failed_names_the_factory_error() -> None:
    core = core_with(gpu_report("g0"))
    new = ServiceSpec("rm", "pkg.models:rm")
    core.register_service(new, 0.0)
    failed = (PreparedService(name="rm", dop=1, error="ModuleNotFoundError: pkg"),)
    (settled,) = [
        e
        for e in core.node_report(gpu_report("g0", services=failed), 1.0)
        if isinstance(e, ServiceSettled)
    ]
    assert "ModuleNotFoundError: pkg" in settled.error
    assert "'rm'" in settled.error


def test_registration_stops_waiting_for_a_node_that_leaves_and_is_bounded() -> None:
    core = core_with(gpu_report("g0"), gpu_report("g1"), prepare_timeout_s=10.0)
    new = ServiceSpec("rm", "pkg.models:rm")
    core.register_service(new, 0.0)
    core.node_report(gpu_report("g0", services=prepared(new)), 1.0)
    (settled,) = [
        e
        for e in core.node_leaving(NodeLeaving(node_id="g1", incarnation="i0", started=()), 2.0)
        if isinstance(e, ServiceSettled)
    ]
    assert settled.state.prepared_on == ("g0",)
    core.register_service(ServiceSpec("slow", "pkg.models:slow"), 3.0)
    core.node_report(gpu_report("g0", services=prepared(new)), 11.0)  # alive, says nothing of it
    assert not [e for e in core.tick(12.0) if isinstance(e, ServiceSettled)]
    (late,) = [e for e in core.tick(13.5) if isinstance(e, ServiceSettled)]
    assert "not prepared within 10s" in late.error
    assert "g0" in late.error


def test_registration_without_gpu_nodes_answers_at_once() -> None:
    core = core_with(cpu_report(node="c0"))
    (settled,) = [
        e
        for e in core.register_service(ServiceSpec("rm", "p:rm"), 0.0)
        if isinstance(e, ServiceSettled)
    ]
    assert settled.error == ""
    assert settled.state.prepared_on == ()


def test_late_node_and_a_report_missing_a_service_get_prepare() -> None:
    core = core_with(prepare_retry_s=5.0)
    (first,) = [e for e in core.node_report(gpu_report("g0"), 0.0) if isinstance(e, PrepareOnNode)]
    assert first.services == (JUDGE,)
    assert not [e for e in core.node_report(gpu_report("g0"), 1.0) if isinstance(e, PrepareOnNode)]
    (again,) = [e for e in core.node_report(gpu_report("g0"), 6.0) if isinstance(e, PrepareOnNode)]
    assert again.services == (JUDGE,)
    states = core.service_states()
    assert [s.spec.name for s in states] == ["judge"]
    assert states[0].prepared_on == ()
    core.node_report(gpu_report("g0", services=prepared(resident={2: (2, 3)})), 7.0)
    (state,) = core.service_states()
    assert state.prepared_on == ("g0",)
    assert state.resident_on == ("g0:2", "g0:3")
    assert state.footprint_mb == 2048


def test_the_same_registration_again_joins_the_one_under_way_and_keeps_its_deadline() -> None:
    """A client re-sends its request while the nodes prepare: the wait does not start over."""
    core = core_with(gpu_report("g0"), prepare_timeout_s=10.0)
    spec = ServiceSpec("rm", "pkg.models:rm")
    assert [e for e in core.register_service(spec, 0.0) if isinstance(e, PrepareOnNode)]
    assert core.register_service(spec, 8.0) == []  # nothing asked of the nodes again
    core.node_report(gpu_report("g0"), 9.0)  # alive, says nothing of it
    (late,) = [e for e in core.tick(10.5) if isinstance(e, ServiceSettled)]
    assert "not prepared within 10s" in late.error
    changed = ServiceSpec("rm", "pkg.models:rm_v2")  # a new spec starts a new registration
    assert [e for e in core.register_service(changed, 11.0) if isinstance(e, PrepareOnNode)]


def test_status_counts_a_gpu_nodes_gpus_in_use() -> None:
    from services.scheduler.core.status import status_reply

    core = core_with(gpu_report(services=prepared()))
    (row,) = status_reply(core, 1, 0.0).node_rows
    assert (row.gpus, row.free_gpus) == (8, 8)
    core.enqueue(infer("a"), 0.0)
    (run,) = starts(core.schedule(0.0))
    (row,) = status_reply(core, 1, 0.0).node_rows
    assert (row.gpus, row.free_gpus) == (8, 8 - len(run.gpus))


def test_a_call_goes_to_the_node_with_a_free_copy_at_any_of_its_dops() -> None:
    """JUDGE's DoP-2 variant is resident on g1's free GPUs 0-1; g0 has more free GPUs and no
    copy. The call runs on g1's copy (no restore), not restored on g0 because its smallest
    variant (DoP 1) is resident nowhere."""
    slow = DurationHint(t_ori_s=1.0, parallel_fraction=0.5)
    c = core_with(
        gpu_report("g0", gpus=8, services=prepared()),
        gpu_report("g1", gpus=2, services=prepared(resident={2: (0, 1)})),
    )
    c.enqueue(infer("a", hint=slow), 0.0)
    (a,) = starts(c.schedule(0.0))
    assert (a.node_id, a.gpus) == ("g1", (0, 1))
