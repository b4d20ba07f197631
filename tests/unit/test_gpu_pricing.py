"""The restore price the scheduler core counts in a GPU action's duration (and the simulator
charges, through the same function): a chunk of k GPUs restores k slices at once, one through
each GPU's host link, so the busiest link sets the time."""

from __future__ import annotations

import pytest

from services.scheduler.core import gpu, gpu_sched
from services.scheduler.core.books import GpuFacts
from services.scheduler.core.effects import StartOnNode
from tangram.chunks import Chunk
from tangram.contract import DurationHint, GpuDevice, Inventory, NodeReport, PreparedService

from .test_scheduler_gpu import core_with, infer, prepared

MB = 8192.0  # 8 GiB


@pytest.mark.parametrize(
    ("links", "seconds"),
    [
        ((0,), 4.0),  # one GPU: the whole model through its link
        ((0, 0, 0, 0), 4.0),  # CPU stand-ins: one memory system, no gain
        ((-1, -1), 4.0),  # not reported: an older agent restores through one device
        ((0, 1, 2, 3), 1.0),  # a link per GPU: k times less per link
        ((0, 1, 2, 3, 4, 5, 6, 7), 0.5),
        ((0, 0, 1, 1), 2.0),  # two per PCIe switch: min(k, links) = 2
        ((0, 0, 0, 1), 3.0),  # uneven: the busiest link carries three slices of four
    ],
)
def test_the_busiest_link_sets_the_restore_time(links: tuple[int, ...], seconds: float) -> None:
    assert gpu.restore_cost(MB, links, 2.0) == pytest.approx(seconds)


def test_a_gather_adds_the_bytes_loaded_through_the_other_devices() -> None:
    # 8 GiB over 4 links at 2 GB/s, then 3/4 of it device to device at 24 GB/s
    assert gpu.restore_cost(MB, (0, 1, 2, 3), 2.0, 24.0) == pytest.approx(1.0 + 6.0 / 24.0)
    assert gpu.restore_cost(MB, (0,), 2.0, 24.0) == pytest.approx(4.0)  # nothing to gather


def test_an_unmeasured_bandwidth_falls_back_to_a_pcie_link() -> None:
    assert gpu.restore_cost(MB, (0,), 0.0) == pytest.approx(8.0 / gpu.DEFAULT_RESTORE_GB_PER_S)


def _facts(links: tuple[int, ...], footprint: int = 8192) -> GpuFacts:
    inv = Inventory(
        kind="gpu",
        gpus=tuple(GpuDevice(index=i, memory_mb=80_000, link=g) for i, g in enumerate(links)),
        restore_gb_per_s=2.0,
    )
    facts = gpu_sched.new_facts(inv)
    facts.services[("judge", 4)] = PreparedService(name="judge", dop=4, footprint_mb=footprint)
    return facts


def test_the_core_prices_a_chunk_by_its_own_links_else_the_slowest() -> None:
    facts = _facts((0, 1, 2, 3, 4, 4, 4, 4))  # the upper half behind one switch
    assert facts.links == (0, 1, 2, 3, 4, 4, 4, 4)
    assert gpu.restore_s(facts, "judge", 4, Chunk(0, 4)) == pytest.approx(1.0)
    assert gpu.restore_s(facts, "judge", 4, Chunk(4, 4)) == pytest.approx(4.0)
    assert gpu.restore_s(facts, "judge", 4) == pytest.approx(4.0)  # chunk unknown: slowest
    old = gpu_sched.new_facts(Inventory(kind="gpu", gpus=(GpuDevice(index=0, memory_mb=1),)))
    assert old.links == (-1,)
    assert old.gather_gb_per_s == 0.0


def _report(links: tuple[int, ...]) -> NodeReport:
    devices = tuple(GpuDevice(index=i, memory_mb=16_000, link=g) for i, g in enumerate(links))
    inv = Inventory(kind="gpu", gpus=devices, restore_gb_per_s=2.0)
    return NodeReport(node_id="g0", incarnation="i0", inventory=inv, full=True, services=prepared())


def test_a_dispatch_predicts_its_end_with_the_sliced_restore() -> None:
    """The same cold call on 4 GPUs: with a link per GPU its restore (8 GiB at 2 GB/s per
    link) takes 1 s, with one shared link 4 s; the core's predicted end moves by the 3 s."""
    hint = DurationHint(t_ori_s=100.0, parallel_fraction=1.0)
    ends = []
    for links in [(0, 1, 2, 3, 4, 5, 6, 7), (0,) * 8]:
        core = core_with(_report(links))
        core.enqueue(infer("a", hint=hint), 0.0)
        (start,) = [e for e in core.schedule(0.0) if isinstance(e, StartOnNode)]
        assert len(start.gpus) == 4
        ends.append(core.gpu._ends["a"])
    assert ends[1] - ends[0] == pytest.approx(4.0 - 1.0)
