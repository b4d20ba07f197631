"""The gpu_manager agent (runtime + GPU executor on CPU devices) on the in-memory bus, with a
fake scheduler: registration, Prepare, calls, eviction and restore, batching, failures."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import torch

from services.gpu_manager import examples
from services.gpu_manager.batching import Output, fault_of
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.executor import GpuExecutor
from services.gpu_manager.outcomes import outcome_of
from services.gpu_manager.service import node_agent
from tangram import subjects
from tangram.agent import Agent
from tangram.contract import (
    Ack,
    ActionSpec,
    Completion,
    Dispatch,
    ErrorKind,
    ExecAction,
    InferAction,
    Kill,
    NodeMessage,
    NodeReport,
    Outcome,
    Prepare,
    PreparedService,
    ServiceSpec,
    UnifiedAction,
)
from tangram.membus import MemoryBroker

from .. import gpu_models
from ..support import eventually, unbatched

M = "tests.gpu_models"
EX = "services.gpu_manager.examples"


class FakeScheduler:
    """Hears what the agent says and acks it."""

    def __init__(self) -> None:
        self.heard: list[NodeMessage] = []

    async def on_node(self, msg: NodeMessage, _raw: Any) -> Ack:
        self.heard += unbatched(msg)
        return Ack()

    def reports(self) -> list[NodeReport]:
        return [m for m in self.heard if isinstance(m, NodeReport)]

    def outcome(self, action_id: str) -> Outcome | None:
        done = [m for m in self.heard if isinstance(m, Completion) and m.action_id == action_id]
        return done[0].outcome if done else None

    def service(self, name: str) -> PreparedService | None:
        reports = self.reports()
        found = [s for s in reports[-1].services if s.name == name] if reports else []
        return found[0] if found else None


class Node:
    def __init__(self, agent: Agent, scheduler: FakeScheduler, sbus: Any) -> None:
        self.agent, self.scheduler, self.sbus = agent, scheduler, sbus

    @property
    def executor(self) -> GpuExecutor:
        assert isinstance(self.agent.executor, GpuExecutor)
        return self.agent.executor

    async def send(self, cmd: Any) -> None:
        await self.sbus.request(subjects.node("g0"), cmd, timeout=5)

    async def prepare(self, *specs: ServiceSpec) -> None:
        await self.send(Prepare(services=specs, epoch=1))
        for s in specs:
            await eventually(lambda s=s: self.scheduler.service(s.name), what=f"{s.name} report")

    async def call(
        self, aid: str, service: str, payload: Any, gpus: tuple[int, ...] = (0,)
    ) -> None:
        await self.send(infer(aid, service, payload, gpus))

    async def outcome(self, aid: str) -> Outcome:
        return await eventually(lambda: self.scheduler.outcome(aid), what=f"outcome of {aid}")


def infer(
    aid: str,
    service: str,
    payload: Any,
    gpus: tuple[int, ...] = (0,),
    spec: ServiceSpec | None = None,
    action: Any = None,
    incarnation: str = "inc",
) -> Dispatch:
    a = ActionSpec(
        action_id=aid,
        job_id="j",
        trajectory_id="",
        action=action or InferAction(service=service, payload=payload),
        timeout_s=30,
    )
    ua = UnifiedAction(
        spec=a, demands=(), key_resource="gpu", env_memory_mb=0, submitted_at=0.0, attempt=1
    )
    return Dispatch(action=ua, epoch=1, incarnation=incarnation, gpus=gpus, service=spec)


@contextlib.asynccontextmanager
async def started(**cfg: Any) -> AsyncIterator[Node]:
    """A GPU agent ``g0`` on CPU devices of 1 MB (``cfg`` overrides) and its fake scheduler."""
    broker = MemoryBroker()
    scheduler, sbus = FakeScheduler(), broker.connect("scheduler")
    sbus.serve(subjects.SCHED_NODES, scheduler.on_node, max_in_flight=100)
    await sbus.start()
    bus = broker.connect("agent")
    cfg = {"node_id": "g0", "backend": "cpu", "cpu_budget_mb": 1, "heartbeat_s": 0.05} | cfg
    agent = node_agent(bus, GpuManagerConfig(**cfg), incarnation="inc")
    await agent.start()
    try:
        yield Node(agent, scheduler, sbus)
    finally:
        gpu_models.GATE.set()
        gpu_models.BLOCK.set()
        await agent.stop(1.0)
        await bus.close()
        await sbus.close()


@pytest.fixture
async def node() -> AsyncIterator[Node]:
    async with started() as n:
        yield n


def direct(factory: Any, payload: Any) -> Any:
    model, handle = factory()
    return handle(model, [payload])[0]


async def test_registers_cpu_devices_with_measured_bandwidth(node: Node):
    report = await eventually(node.scheduler.reports, what="registration")
    inv = report[0].inventory
    assert inv.kind == "gpu"
    assert [(g.index, g.memory_mb) for g in inv.gpus] == [(0, 1), (1, 1)]
    assert inv.restore_gb_per_s > 0


async def test_prepare_reports_ready_and_failed_services_and_the_agent_lives_on(node: Node):
    ok = ServiceSpec("ok", f"{EX}:mlp_service", dops=(1, 2))
    bad = ServiceSpec("bad", f"{M}:raising_service")
    gone = ServiceSpec("gone", "no_such_module_xyz:factory")
    await node.prepare(ok, bad, gone)
    assert [(s.dop, s.error) for s in node.scheduler.reports()[-1].services if s.name == "ok"] == [
        (1, ""),
        (2, ""),
    ]
    assert node.scheduler.service("ok").footprint_mb >= 1  # type: ignore[union-attr]
    assert "no such checkpoint" in node.scheduler.service("bad").error  # type: ignore[union-attr]
    assert "cannot be imported" in node.scheduler.service("gone").error  # type: ignore[union-attr]
    await node.call("a1", "bad", [0.0] * 8)
    out = await node.outcome("a1")
    assert out.failure is ErrorKind.INVALID_REQUEST
    assert "no such checkpoint" in out.detail
    await node.call("a2", "ok", [0.0] * 8)
    assert (await node.outcome("a2")).output == direct(examples.mlp_service, [0.0] * 8)


async def test_a_factory_that_never_returns_fails_at_the_timeout_and_others_still_prepare():
    gpu_models.BLOCK.clear()
    async with started(prepare_timeout_s=0.3) as node:
        stuck = ServiceSpec("stuck", f"{M}:blocked_service")
        await node.prepare(stuck)  # answered: the report names the timeout
        error = node.scheduler.service("stuck").error  # type: ignore[union-attr]
        assert "did not return within the prepare timeout of 0.3s" in error
        await node.prepare(ServiceSpec("ok", f"{EX}:mlp_service"))  # the stuck thread blocks on
        await node.call("a", "ok", [0.0] * 8)
        assert (await node.outcome("a")).exit_code == 0
        gpu_models.BLOCK.set()  # the abandoned build returns now: its result is dropped
        await eventually(lambda: gpu_models.BLOCKED == ["returned"], what="the late build")
        await node.prepare(stuck)
        assert node.executor.catalog.get("stuck").error == error  # type: ignore[union-attr]


async def test_outputs_equal_the_model_called_directly_also_after_eviction(node: Node):
    a = ServiceSpec("a", f"{M}:wide_a")
    b = ServiceSpec("b", f"{M}:wide_b")
    await node.prepare(a, b)
    x = [0.5] * 8
    for aid, svc in [("c1", "a"), ("c2", "a"), ("c3", "b"), ("c4", "a")]:
        await node.call(aid, svc, x)
        await node.outcome(aid)
    o1, o2, o3, o4 = [node.scheduler.outcome(f"c{i}") for i in range(1, 5)]
    assert None not in (o1, o2, o3, o4)
    assert o1 and o2 and o3 and o4  # noqa: PT018 (narrows the types)
    assert o1.output == o2.output == o4.output == direct(gpu_models.wide_a, x)  # bit-exact
    assert o3.output == direct(gpu_models.wide_b, x)
    assert o1.restore_s > 0
    assert o2.restore_s == 0  # resident
    assert o4.restore_s > 0  # b evicted a: one device of 1 MB holds one of them
    await eventually(lambda: node.scheduler.service("a").resident == (0,), what="a resident")  # type: ignore[union-attr]
    assert node.scheduler.service("b").resident == ()  # type: ignore[union-attr]


async def test_a_calls_execution_is_timed_in_the_worker_not_across_the_hops(node: Node):
    """started / finished come from the worker thread around the restore and the forward
    pass: the hops to and from the event loop are the system's overhead, not the call's."""
    loop_thread = threading.current_thread()
    worker_times: list[float] = []

    def clock() -> float:
        now = time.time()
        if threading.current_thread() is not loop_thread:
            worker_times.append(now)
        return now

    node.executor.clock = clock
    await node.prepare(ServiceSpec("a", f"{M}:wide_a"))
    for aid in ("t1", "t2"):  # restored, then resident
        await node.call(aid, "a", [0.5] * 8)
        done = await node.outcome(aid)
        assert done.started_at in worker_times
        assert done.finished_at in worker_times
        assert done.started_at is not None
        assert done.finished_at is not None
        assert done.finished_at - done.started_at >= done.restore_s


async def test_a_restore_after_an_eviction_copies_into_the_memory_it_freed(node: Node):
    """On CPU devices an evicted copy's arena is kept and the next restore of its size copies
    into it (arenas.py: what CUDA's caching allocator does), outputs unchanged."""
    await node.prepare(ServiceSpec("a", f"{M}:wide_a"), ServiceSpec("b", f"{M}:wide_b"))
    x = [0.25] * 8
    for i, svc in enumerate("abab"):  # one 1 MB device: each call evicts the other service
        await node.call(f"r{i}", svc, x)
        done = await node.outcome(f"r{i}")
        assert done.restore_s > 0
        assert done.output == direct(gpu_models.wide_a if svc == "a" else gpu_models.wide_b, x)
    assert node.executor.arenas.reused == 3  # every restore but the first


async def test_memory_a_handler_still_views_is_not_reused(node: Node):
    await node.prepare(ServiceSpec("c", f"{M}:clinging_service"), ServiceSpec("b", f"{M}:wide_b"))
    gpu_models.KEPT.clear()
    await node.call("k1", "c", [0.5] * 8)
    await node.outcome("k1")
    kept = gpu_models.KEPT[0].clone()
    await node.call("k2", "b", [0.5] * 8)  # evicts c, whose handle holds one of its tensors
    await node.outcome("k2")
    await node.call("k3", "c", [0.5] * 8)  # evicts b: b's arena is free to reuse
    await node.outcome("k3")
    assert node.executor.arenas.reused == 1  # k3 took b's; k2 allocated afresh
    assert torch.equal(gpu_models.KEPT[0], kept)  # what the handle kept was never written over


async def test_a_service_that_outgrows_its_device_is_re_measured_and_fits_once_room_is_made(
    node: Node,
):
    await node.prepare(
        ServiceSpec("a", f"{M}:wide_a"), ServiceSpec("grow", f"{M}:growing_service", dops=(1, 2))
    )
    prepared = node.executor.catalog.get("grow").nbytes  # type: ignore[union-attr]
    await node.call("w", "a", [0.0] * 8)  # ~0.66 MB resident on device 0 (1 MB)
    assert (await node.outcome("w")).exit_code == 0
    await node.call("g1", "grow", [0.0] * 8)  # fits as measured; its pass adds 0.6 MB
    oom = await node.outcome("g1")
    assert oom.failure is ErrorKind.DEVICE_OOM, oom
    assert "over their budget" in oom.detail
    grown = node.executor.catalog.get("grow").nbytes  # type: ignore[union-attr]
    assert grown >= prepared + gpu_models.GROWN_BYTES  # re-measured
    assert node.executor.residency.resident("grow/1") == []  # its copy dropped
    await node.call("g2", "grow", [0.0] * 8, gpus=(0, 1))  # the scheduler's retry: a larger chunk
    ok = await node.outcome("g2")
    assert ok.exit_code == 0, ok
    assert ok.output == direct(examples.mlp_service, [0.0] * 8)
    r = node.executor.residency
    assert r.resident("a/1") == []  # evicted for the re-measured copy
    assert all(r.used(d) <= r.budgets[d] for d in range(2))
    await node.call("g3", "grow", [1.0] * 8, gpus=(1,))  # re-measured: room made at once
    assert (await node.outcome("g3")).exit_code == 0


async def test_concurrent_calls_are_coalesced_into_one_batch(node: Node):
    await node.prepare(ServiceSpec("slow", f"{M}:slow_service", max_batch=3))
    gpu_models.BATCH_SIZES.clear()
    gpu_models.GATE.clear()
    await node.call("s0", "slow", [0.0] * 8)
    await eventually(lambda: gpu_models.BATCH_SIZES == [1], what="the first batch to run")
    for i in range(1, 6):
        await node.call(f"s{i}", "slow", [float(i)] * 8)
    await eventually(lambda: len(node.executor.former) == 5, what="the calls to queue")
    assert node.executor.residency.busy == {0: node.executor.residency.busy[0]}  # one device
    gpu_models.GATE.set()
    outs = [await node.outcome(f"s{i}") for i in range(6)]
    assert gpu_models.BATCH_SIZES == [1, 3, 2]
    assert all(o.exit_code == 0 for o in outs)
    ran = await eventually(
        lambda: (s := node.scheduler.service("slow")) and s.batches == 3 and s, what="counts"
    )
    assert ran.calls == 6  # reported in heartbeats: 6 calls in 3 forward passes


async def test_a_call_past_its_timeout_fails_and_a_queued_one_never_runs(node: Node):
    await node.prepare(ServiceSpec("slow", f"{M}:slow_service", max_batch=1))
    gpu_models.BATCH_SIZES.clear()
    gpu_models.GATE.clear()
    await node.send(timed(infer("r", "slow", [0.0] * 8), 0.3))  # runs, stuck in its handler
    await eventually(lambda: gpu_models.BATCH_SIZES == [1], what="the first batch to run")
    await node.send(timed(infer("q", "slow", [1.0] * 8), 0.3))  # queued behind it
    for aid in ("r", "q"):
        late = await node.outcome(aid)
        assert late.failure is ErrorKind.EXEC_TIMEOUT
        assert late.detail == "no output within the action's timeout of 0.3s"
    assert len(node.executor.former) == 0  # the queued call left the queue
    gpu_models.GATE.set()
    await node.call("after", "slow", [2.0] * 8)
    assert (await node.outcome("after")).exit_code == 0
    assert gpu_models.BATCH_SIZES == [1, 1]  # the stuck batch and "after": "q" never ran
    done = [m for m in node.scheduler.heard if isinstance(m, Completion)]
    assert [c.action_id for c in done].count("r") == 1  # its batch's late output: not sent


def timed(d: Dispatch, timeout_s: float) -> Dispatch:
    spec = msgspec.structs.replace(d.action.spec, timeout_s=timeout_s)
    return msgspec.structs.replace(d, action=msgspec.structs.replace(d.action, spec=spec))


async def test_a_queued_call_is_cancelled_by_kill_and_a_running_one_finishes(node: Node):
    await node.prepare(ServiceSpec("slow", f"{M}:slow_service"))
    gpu_models.GATE.clear()
    await node.call("k0", "slow", [0.0] * 8)
    await eventually(lambda: node.executor.residency.busy, what="k0 to run")
    await node.call("k1", "slow", [0.0] * 8)
    await eventually(lambda: len(node.executor.former) == 1, what="k1 to queue")
    await node.send(Kill(action_id="k1", epoch=1))
    await node.send(Kill(action_id="k0", epoch=1))
    k1 = await node.outcome("k1")
    assert k1.failure is ErrorKind.CANCELLED
    gpu_models.GATE.set()
    k0 = await node.outcome("k0")
    assert k0.failure is ErrorKind.CANCELLED  # it ran to its end; the kill is what is reported


async def test_a_handler_exception_is_the_calls_own_failure_and_spares_its_batch(node: Node):
    await node.prepare(ServiceSpec("picky", f"{M}:picky_service"))
    await node.call("p0", "picky", "bad")
    await node.call("p1", "picky", [1.0] * 8)
    bad, good = await node.outcome("p0"), await node.outcome("p1")
    assert bad.failure is None
    assert bad.exit_code == 1
    assert "is not a feature vector" in bad.stderr
    assert "Traceback" in bad.stderr
    assert good.exit_code == 0


@pytest.mark.parametrize(
    ("factory", "kind", "words"),
    [
        ("chatty_service", ErrorKind.INVALID_REQUEST, "exceeds max_output_bytes=65536"),
        ("unencodable_service", None, "not a msgpack value"),
    ],
)
async def test_bad_outputs_fail_clearly(node: Node, factory: str, kind: ErrorKind, words: str):
    await node.prepare(ServiceSpec("s", f"{M}:{factory}"))
    await node.call("o", "s", 1)
    out = await node.outcome("o")
    assert out.failure is kind
    assert words in out.detail


@pytest.mark.parametrize(
    ("dispatch", "words"),
    [
        (infer("u", "nope", 1), "'nope' is not prepared here"),
        (infer("g", "m", 1, gpus=(1, 2)), "not a chunk"),
        (infer("h", "m", 1, gpus=(7,)), "not a chunk"),
        (infer("d", "m", 1, gpus=(0, 1)), "no DoP-2 variant"),
        (infer("e", "m", 1, action=ExecAction(command="ls")), "runs infer actions, not exec"),
    ],
)
async def test_bad_dispatches_are_refused_as_invalid(node: Node, dispatch: Dispatch, words: str):
    await node.prepare(ServiceSpec("m", f"{EX}:mlp_service"))
    await node.send(dispatch)
    out = await node.outcome(dispatch.action.spec.action_id)
    assert out.failure is ErrorKind.INVALID_REQUEST
    assert words in out.detail


async def test_a_service_replaced_while_a_batch_runs_serves_its_new_model_next(node: Node):
    await node.prepare(ServiceSpec("swap", f"{M}:slow_service"))
    gpu_models.GATE.clear()
    await node.call("s0", "swap", [0.0] * 8)
    await eventually(lambda: node.executor.residency.busy, what="s0 to run")
    new = ServiceSpec("swap", f"{EX}:tiny_service")
    await node.send(Prepare(services=(new,), epoch=1))
    await eventually(lambda: node.executor.catalog.get("swap").spec == new, what="the new spec")
    gpu_models.GATE.set()
    assert (await node.outcome("s0")).failure is None
    await node.call("s1", "swap", [1.0] * 4)
    assert (await node.outcome("s1")).output == direct(examples.tiny_service, [1.0] * 4)


async def test_a_dispatch_carrying_an_unprepared_spec_prepares_it_first(node: Node):
    spec = ServiceSpec("late", f"{EX}:tiny_service")
    await node.send(infer("l", "late", [1.0] * 4, spec=spec))
    assert (await node.outcome("l")).output == direct(examples.tiny_service, [1.0] * 4)


@pytest.mark.parametrize(
    ("exc", "fault"),
    [
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"), "oom"),
        (MemoryError(), "oom"),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), "device"),
        (RuntimeError("NVML_SUCCESS == r INTERNAL ASSERT FAILED"), "device"),
        (ValueError("bad payload"), "handler"),
    ],
)
def test_failures_are_told_apart(exc: BaseException, fault: str):
    assert fault_of(exc) == fault


def test_device_failures_map_to_their_kinds():
    spec = ServiceSpec("s", f"{EX}:mlp_service")
    times = {"started": 1.0, "finished": 2.0, "restore_s": 0.0}
    oom = outcome_of(Output("a", error="oom", fault="oom"), spec, **times)
    lost = outcome_of(Output("a", error="gone", fault="device"), spec, **times)
    assert (oom.failure, lost.failure) == (ErrorKind.DEVICE_OOM, ErrorKind.DEVICE_LOST)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_a_call_runs_on_a_cuda_device():  # pragma: no cover - needs a GPU
    broker = MemoryBroker()
    scheduler, sbus = FakeScheduler(), broker.connect("scheduler")
    sbus.serve(subjects.SCHED_NODES, scheduler.on_node, max_in_flight=100)
    await sbus.start()
    bus = broker.connect("agent")
    agent = node_agent(bus, GpuManagerConfig(node_id="g0", backend="nvml"), incarnation="inc")
    await agent.start()
    try:
        node = Node(agent, scheduler, sbus)
        assert node.executor.devices.kind == "cuda"
        await node.prepare(ServiceSpec("m", f"{EX}:mlp_service"))
        await node.call("c", "m", [0.0] * 8)
        out = await node.outcome("c")
        assert out.exit_code == 0
        assert out.restore_s > 0
    finally:
        await agent.stop(1.0)
        await bus.close()
        await sbus.close()
