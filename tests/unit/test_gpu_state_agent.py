"""The state tiers in the GPU agent: calls restored through disk equal direct calls, hits are
counted and reported, prefetch hints promote ahead of calls and never evict what runs, and bad
hints get a clear error while the agent keeps serving."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from services.gateway.formulation import formulate_infer
from services.gpu_manager.residency import Residency
from tangram import subjects
from tangram.bus import decode_reply
from tangram.chunks import Chunk
from tangram.contract import Ack, ActionSpec, Dispatch, ErrorKind, InferAction, ServiceSpec
from tangram.contract.state import Prefetch, PrefetchItem
from tangram.errors import InvalidRequest

from .. import gpu_models
from ..support import eventually
from .test_gpu_agent import Node, direct, started

M = "tests.gpu_models"
A = ServiceSpec("wa", f"{M}:wide_a")
B = ServiceSpec("wb", f"{M}:wide_b")
X = [0.5] * 8


def infer(aid: str, service: str, gpus: tuple[int, ...]) -> Dispatch:
    spec = ActionSpec(
        action_id=aid,
        job_id="j",
        trajectory_id="",
        action=InferAction(service=service, payload=X),
        timeout_s=30,
    )
    action = msgspec.structs.replace(formulate_infer(spec, now=0.0), attempt=1)
    return Dispatch(action=action, epoch=1, incarnation="inc", gpus=gpus)


async def run(node: Node, aid: str, service: str, gpu: int) -> Any:
    await node.send(infer(aid, service, (gpu,)))
    out = await node.outcome(aid)
    assert out.failure is None, out
    assert out.exit_code == 0, out
    return out.output


def tiered(tmp_path: Path, **more: Any) -> Any:
    """An agent whose host tier holds one wide service, over a disk tier."""
    return started(state_dir=str(tmp_path / "store"), host_budget_mb=1, **more)


async def hits(node: Node, name: str, calls: int) -> tuple[int, int]:
    report = await eventually(
        lambda: (s := node.scheduler.service(name)) is not None and s.calls == calls and s,
        what=f"{name}: {calls} calls reported",
    )
    return report.device_hits, report.host_hits


async def test_calls_through_disk_equal_direct_calls_and_are_counted(tmp_path: Path) -> None:
    async with tiered(tmp_path, prefetch=False) as node:
        await node.prepare(A, B)  # B's capture evicted A from host memory (to disk)
        state = node.executor.state
        assert not state.in_host(node.executor.catalog.entries["wa"].state_id)
        assert await run(node, "a1", "wa", 0) == direct(gpu_models.wide_a, X)  # disk -> device
        assert await run(node, "b1", "wb", 1) == direct(gpu_models.wide_b, X)  # disk again
        assert await run(node, "a2", "wa", 0) == direct(gpu_models.wide_a, X)  # on device
        assert await hits(node, "wa", 2) == (1, 0)  # a1 from disk; a2 on device, host evicted
        assert await hits(node, "wb", 1) == (0, 0)
        assert not state.violations()
        assert state.report().host_bytes <= state.tiers.host.budget
        disk = state.tiers.disk
        assert disk is not None
        for p in node.executor.catalog.loaded:  # on a device: a copy below, on disk
            copy = node.executor.catalog.entries[p.service.rpartition("/")[0]].copy
            assert copy is not None
            assert all(disk.holds(k) for k in getattr(copy, "keys", ()))


async def test_a_prefetch_hint_makes_the_next_call_a_device_hit(tmp_path: Path) -> None:
    async with tiered(tmp_path) as node:
        await node.prepare(A, B)
        entry = node.executor.catalog.entries["wa"]
        hint = Prefetch(services=(PrefetchItem(name="wa"),), epoch=1)
        await node.sbus.request(subjects.prefetch("g0"), hint, timeout=5)
        await eventually(lambda: node.executor.residency.resident("wa/1"), what="wa warmed")
        assert node.executor.state.in_host(entry.state_id)
        gpu = node.executor.residency.resident("wa/1")[0].start
        assert await run(node, "a1", "wa", gpu) == direct(gpu_models.wide_a, X)
        assert await hits(node, "wa", 1) == (1, 1)
        assert node.executor.prefetcher.device == 1


async def test_prefetch_never_evicts_what_a_running_call_uses(tmp_path: Path) -> None:
    slow = ServiceSpec("slow", f"{M}:slow_service")
    async with tiered(tmp_path, cpu_devices=1) as node:
        await node.prepare(A, slow)
        gpu_models.GATE.clear()  # slow's handler blocks: its call holds the only device
        await node.send(infer("s1", "slow", (0,)))
        await eventually(lambda: node.executor.residency.busy, what="slow running")
        hint = Prefetch(services=(PrefetchItem(name="wa"),), epoch=1)
        await node.sbus.request(subjects.prefetch("g0"), hint, timeout=5)
        await eventually(lambda: not node.executor.prefetcher._next, what="hint taken")
        assert node.executor.residency.resident("slow/1"), "the running call's copy stays"
        assert not node.executor.residency.resident("wa/1")
        gpu_models.GATE.set()
        assert (await node.outcome("s1")).exit_code == 0


def test_warm_takes_only_free_room() -> None:
    r = Residency((1000, 1000))
    assert r.acquire("run", "s", 1, 800, 0.0, Chunk(0, 1)) is not None
    r.release("run", 1.0)
    r.acquire("run2", "t", 1, 800, 2.0, Chunk(1, 1))  # both devices hold 800 bytes
    assert r.warm("w", "u", 1, 300, 3.0) is None, "would need an eviction"
    w = r.warm("w", "u", 1, 150, 3.0)
    assert w is not None
    assert w.placement.chunk == Chunk(0, 1)
    assert w.evict == ()
    r.release("w", 4.0)
    assert r.warm("w2", "u", 1, 150, 5.0) is None, "resident already"
    assert {p.service for p in r.cached} == {"s", "t", "u"}


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        (b"\xc1garbage", "malformed"),
        ({"type": "prefetch", "services": [{"name": "wa", "dop": 0}]}, "dop"),
        ({"type": "prefetch", "services": [{"name": "../x"}]}, "name"),
        ({"type": "prefetch", "services": [{"name": "wa"}] * 65}, "length"),
        ({"type": "prefetch", "services": [{"name": "nope"}]}, "not prepared here: nope"),
    ],
)
async def test_bad_hints_are_refused_and_the_agent_keeps_serving(
    tmp_path: Path, payload: Any, error: str
) -> None:
    async with tiered(tmp_path) as node:
        await node.prepare(A)
        raw = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
        subject = subjects.prefetch("g0").subject
        with pytest.raises(InvalidRequest, match=error):
            decode_reply(subject, await node.sbus._ask(subject, raw, None, 5), Ack)
        assert await run(node, "a1", "wa", 0) == direct(gpu_models.wide_a, X)
        assert (await node.outcome("a1")).failure is not ErrorKind.DEVICE_LOST
