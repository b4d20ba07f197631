"""The restore price the scheduler core counts in a GPU action's duration (and the simulator
charges, through the same function): a chunk of k GPUs restores k slices at once, one through
each GPU's host link, so the busiest link sets the time."""

from __future__ import annotations

import math

import msgspec
import pytest

from services.scheduler.core import gpu, gpu_sched
from services.scheduler.core.books import GpuFacts
from services.scheduler.core.effects import StartOnNode
from tangram.chunks import Chunk
from tangram.contract import (
    DurationHint,
    GpuDevice,
    Inventory,
    NodeReport,
    PreparedService,
    encode,
)

from .test_scheduler_gpu import core_with, infer, prepared

MB = 8192.0  # 8 GiB
GB = MB * 2**20 / 1e9  # the same bytes in decimal GB (8.59), the unit of a GB/s rate
ONE_LINK_S = GB / 2.0  # 8 GiB through one link at 2 GB/s: 4.29 s


def test_a_restore_prices_mib_against_decimal_gb_per_s() -> None:
    """Footprints are MiB (2**20 bytes); the agents measure bandwidth in GB (1e9 bytes) a
    second (``bandwidth.py``, ``bench/gpu.py``): 1000 MiB are 1.048576 GB, 1 s at that rate."""
    assert gpu.restore_cost(1000, (0,), 1.048576) == pytest.approx(1.0)
    assert gpu.restore_cost(1000, (0, 1), 0.524288) == pytest.approx(1.0)  # a slice per link
    assert gpu.restore_cost(1000, (0, 1), 1e6, 0.262144) == pytest.approx(2.0, rel=1e-5)


@pytest.mark.parametrize(
    ("links", "busiest_share"),
    [
        ((0,), 1.0),  # one GPU: the whole model through its link
        ((0, 0, 0, 0), 1.0),  # CPU stand-ins: one memory system, no gain
        ((-1, -1), 1.0),  # not reported: an older agent restores through one device
        ((0, 1, 2, 3), 0.25),  # a link per GPU: k times less per link
        ((0, 1, 2, 3, 4, 5, 6, 7), 0.125),
        ((0, 0, 1, 1), 0.5),  # two per PCIe switch: min(k, links) = 2
        ((0, 0, 0, 1), 0.75),  # uneven: the busiest link carries three slices of four
    ],
)
def test_the_busiest_link_sets_the_restore_time(
    links: tuple[int, ...], busiest_share: float
) -> None:
    assert gpu.restore_cost(MB, links, 2.0) == pytest.approx(busiest_share * ONE_LINK_S)


def test_a_gather_adds_the_bytes_loaded_through_the_other_devices() -> None:
    # 8 GiB over 4 links at 2 GB/s, then 3/4 of it device to device at 24 GB/s
    both = GB / 4 / 2.0 + GB * 3 / 4 / 24.0
    assert gpu.restore_cost(MB, (0, 1, 2, 3), 2.0, 24.0) == pytest.approx(both)
    assert gpu.restore_cost(MB, (0,), 2.0, 24.0) == pytest.approx(ONE_LINK_S)  # no gather


def test_an_unmeasured_bandwidth_falls_back_to_a_pcie_link() -> None:
    assert gpu.restore_cost(MB, (0,), 0.0) == pytest.approx(GB / gpu.DEFAULT_RESTORE_GB_PER_S)


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
    assert gpu.restore_s(facts, "judge", 4, Chunk(0, 4)) == pytest.approx(ONE_LINK_S / 4)
    assert gpu.restore_s(facts, "judge", 4, Chunk(4, 4)) == pytest.approx(ONE_LINK_S)
    assert gpu.restore_s(facts, "judge", 4) == pytest.approx(ONE_LINK_S)  # unknown: slowest
    old = gpu_sched.new_facts(Inventory(kind="gpu", gpus=(GpuDevice(index=0, memory_mb=1),)))
    assert old.links == (-1,)
    assert old.gather_gb_per_s == 0.0


def _report(links: tuple[int, ...]) -> NodeReport:
    devices = tuple(GpuDevice(index=i, memory_mb=16_000, link=g) for i, g in enumerate(links))
    inv = Inventory(kind="gpu", gpus=devices, restore_gb_per_s=2.0)
    return NodeReport(node_id="g0", incarnation="i0", inventory=inv, full=True, services=prepared())


def test_a_dispatch_predicts_its_end_with_the_sliced_restore() -> None:
    """The same cold call on 4 GPUs: with a link per GPU its restore (8 GiB at 2 GB/s per
    link) takes 1.07 s, with one shared link 4.29 s; the core's predicted end moves by the
    difference."""
    hint = DurationHint(t_ori_s=100.0, parallel_fraction=1.0)
    ends = []
    for links in [(0, 1, 2, 3, 4, 5, 6, 7), (0,) * 8]:
        core = core_with(_report(links))
        core.enqueue(infer("a", hint=hint), 0.0)
        (start,) = [e for e in core.schedule(0.0) if isinstance(e, StartOnNode)]
        assert len(start.gpus) == 4
        ends.append(core.gpu._ends["a"])
    assert ends[1] - ends[0] == pytest.approx(ONE_LINK_S * 3 / 4)


# ---------------------------------------------------------------- review (R2): prices from a
# hostile or an older agent, chunk positions against GPU indices


def test_an_older_agents_price_is_the_whole_model_through_one_link() -> None:
    """No link reported (-1 each) and no gather: the price before sliced restores, for every
    chunk size and whether the chunk is known or not."""
    for n in (1, 2, 4, 8):
        facts = _facts((-1,) * 8)
        facts.services[("judge", n)] = PreparedService(name="judge", dop=n, footprint_mb=8192)
        assert gpu.restore_s(facts, "judge", n, Chunk(0, n)) == pytest.approx(ONE_LINK_S)
        assert gpu.restore_s(facts, "judge", n) == pytest.approx(ONE_LINK_S)


@pytest.mark.parametrize("rate", [5e-324, 1e-300, 0.0, -3.0, float("nan"), float("inf")])
def test_a_restore_price_is_finite_and_never_negative(rate: float) -> None:
    for mb, gather in [(16 * 1024 * 1024, rate), (8192, 24.0), (-8192, rate), (float("nan"), 0)]:
        cost = gpu.restore_cost(mb, (0, 1, 2, 3), rate, gather)
        assert math.isfinite(cost)
        assert cost >= 0


@pytest.mark.parametrize(
    "raw",
    [
        {"gather_gb_per_s": float("nan")},
        {"gather_gb_per_s": -1.0},
        {"gather_gb_per_s": float("inf")},
        {"restore_gb_per_s": float("nan")},
        {"restore_gb_per_s": -2.0},
        {"restore_gb_per_s": float("inf")},
        {"gpus": [{"index": 0, "memory_mb": 1, "link": -2}]},
        {"gpus": [{"index": 0, "memory_mb": 1, "link": 1 << 40}]},
    ],
)
def test_a_hostile_inventory_is_refused_when_decoded(raw: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"kind": "gpu", **raw}), type=Inventory)


@pytest.mark.parametrize("footprint", [-1, -(1 << 40), 1 << 60])
def test_a_hostile_footprint_is_refused_when_decoded(footprint: int) -> None:
    raw = {"name": "judge", "dop": 1, "footprint_mb": footprint}
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=PreparedService)


def test_an_older_agents_inventory_decodes_with_the_defaults() -> None:
    raw = {"kind": "gpu", "gpus": [{"index": 3, "memory_mb": 80}], "restore_gb_per_s": 11.5}
    inv = msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=Inventory)
    assert inv.gpus[0].link == -1
    assert inv.gather_gb_per_s == 0.0
    assert msgspec.msgpack.decode(encode(_report((0, 1))), type=NodeReport) == _report((0, 1))


def test_a_dispatch_is_priced_on_its_granted_chunk_by_position_not_index() -> None:
    """GPUs 10..17, the first four behind one switch and GPU 10 down: the 4-GPU grant goes to
    14..17, a link each (1.07 s), not to the slowest chunk of the node (4.29 s)."""
    hint = DurationHint(t_ori_s=100.0, parallel_fraction=1.0)
    ends = []
    for links in [(4, 4, 4, 4, 0, 1, 2, 3), (0,) * 8]:
        devices = tuple(
            GpuDevice(index=10 + i, memory_mb=16_000, link=g) for i, g in enumerate(links)
        )
        inv = Inventory(kind="gpu", gpus=devices, restore_gb_per_s=2.0)
        report = NodeReport(
            node_id="g0", incarnation="i0", inventory=inv, full=True, services=prepared()
        )
        core = core_with(report)
        facts = core.nodes["g0"].gpu
        assert facts is not None
        facts.down.add(10)
        core.enqueue(infer("a", hint=hint), 0.0)
        (start,) = [e for e in core.schedule(0.0) if isinstance(e, StartOnNode)]
        assert start.gpus == (14, 15, 16, 17)
        ends.append(core.gpu._ends["a"])
    assert ends[1] - ends[0] == pytest.approx(ONE_LINK_S * 3 / 4)
