"""The scheduler's prefetch hints: which node gets which queued services, and when one is sent."""

from __future__ import annotations

from typing import Any

from services.scheduler.gpu_shell import PrefetchHints, plan_prefetch
from tangram import subjects
from tangram.contract import ServiceSpec
from tangram.contract.state import Prefetch

from .test_scheduler_gpu import JUDGE, core_with, gpu_report, infer, prepared

OTHER = ServiceSpec("other", "pkg.models:other", dops=(2,))


def test_queued_services_are_hinted_to_the_node_they_will_likely_go_to() -> None:
    judge_warm = prepared(JUDGE, resident={1: (0,)})
    core = core_with(
        gpu_report("g0", gpus=2, services=prepared(JUDGE) + prepared(OTHER)),
        gpu_report("g1", gpus=4, services=prepared(OTHER)),
    )
    core.restore_services([JUDGE, OTHER])
    for i in range(20):  # more than the GPUs: most stay queued
        core.enqueue(infer(f"j{i}"), 0.0)
        core.enqueue(infer(f"o{i}", service="other"), 0.0)
    plan = plan_prefetch(core)
    assert plan["g0"] == (("judge", 1),)  # the only node that prepared it
    assert plan["g1"] == (("other", 2),)  # the most free GPUs
    core.node_report(gpu_report("g0", gpus=2, services=judge_warm + prepared(OTHER)), 1.0)
    assert "g0" not in plan_prefetch(core), "resident on a device there: nothing to move"


class Bus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, Any]] = []

    async def publish(self, subject: str, msg: Any) -> None:
        self.sent.append((subject, msg))


async def test_a_hint_is_sent_once_per_change() -> None:
    core = core_with(gpu_report("g0", gpus=2, services=prepared(JUDGE)))
    now = [0.0]
    hints, bus = PrefetchHints(clock=lambda: now[0]), Bus()
    await hints.after_pass(bus, core, 3)  # type: ignore[arg-type]
    assert bus.sent == [], "nothing queued"
    for i in range(10):
        core.enqueue(infer(f"j{i}"), 0.0)
    await hints.after_pass(bus, core, 3)  # type: ignore[arg-type]
    assert bus.sent == [], "planned at most every PREFETCH_EVERY_S"
    for t in (1.0, 2.0):
        now[0] = t
        await hints.after_pass(bus, core, 3)  # type: ignore[arg-type]
    assert len(bus.sent) == 1, "sent once: the plan did not change"
    subject, msg = bus.sent[0]
    assert subject == subjects.prefetch("g0")
    assert isinstance(msg, Prefetch)
    assert [(i.name, i.dop) for i in msg.services] == [("judge", 1)]
