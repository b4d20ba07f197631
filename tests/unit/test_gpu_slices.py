"""A restore onto k devices as k slices: the split covers the state exactly once, the restored
copy is bit-exact whatever k (both host-copy kinds, threaded or not), and the agent reports its
links truthfully (CPU stand-ins: one shared; NVML: by PCIe switch)."""

from __future__ import annotations

import itertools
import random
import threading

import pytest
import torch

from services.gpu_manager import devices, examples, slices
from services.gpu_manager.bandwidth import measure_bandwidth, measure_gather
from services.gpu_manager.host_copy import ALIGN, OVERLAP_BYTES, HostCopy
from services.gpu_manager.state.copy import StoredCopy
from services.gpu_manager.state.manager import StateConfig, StateManager
from tangram.contract import ServiceSpec

from ..support import eventually
from .test_gpu_agent import EX, direct, started

X = torch.randn(3, 8)


def _out(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(X)


@pytest.mark.parametrize("nbytes", [0, 1, ALIGN - 1, ALIGN, 10 * ALIGN + 7, 1 << 20])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_split_tiles_the_arena_with_aligned_boundaries(nbytes: int, k: int) -> None:
    ranges = slices.split(nbytes, k)
    assert len(ranges) == k
    assert ranges[0][0] == 0
    assert ranges[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert all(lo <= hi for lo, hi in ranges)
    assert all(hi % ALIGN == 0 for _, hi in ranges[:-1] if hi < nbytes)
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= -(-nbytes // k) + ALIGN  # balanced to within alignment


def test_cut_covers_every_byte_of_every_span_exactly_once() -> None:
    rng = random.Random(7)
    for _ in range(200):
        spans, at = [], 0
        for _ in range(rng.randint(0, 12)):
            at += rng.choice([0, ALIGN, rng.randint(0, 3 * ALIGN)])  # gaps: alignment padding
            n = rng.randint(0, 5 * ALIGN)
            spans.append((at, at + n))
            at += n
        rng.shuffle(spans)  # a layout groups entries by dtype: not in offset order
        k = rng.randint(1, 8)
        parts = slices.cut(spans, slices.split(at, k))
        seen = [0] * at
        assert all(c.dst <= d.dst for part in parts for c, d in itertools.pairwise(part))
        for c in (c for part in parts for c in part):
            a, b = spans[c.span]
            assert c.dst == a + c.start
            assert c.dst + c.nbytes <= b
            for i in range(c.dst, c.dst + c.nbytes):
                seen[i] += 1
        inside = {i for a, b in spans for i in range(a, b)}
        assert all(seen[i] == (1 if i in inside else 0) for i in range(at))


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_k_slice_restore_is_bit_exact(k: int) -> None:
    model = examples.tied_lm()
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        ref = model(tokens)
    copy = HostCopy(model)
    resident = copy.restore("cpu", paths=["cpu"] * k)
    assert torch.equal(resident.arena, copy.host)  # every byte, padding included
    assert resident.model.head.weight is resident.model.emb.weight
    with torch.inference_mode():
        assert torch.equal(resident.model(tokens), ref)


def test_a_large_sliced_restore_runs_a_thread_per_slice_and_stays_exact() -> None:
    model = examples.mlp(examples.MlpConfig(hidden=1500, layers=3))
    ref = _out(model)
    copy = HostCopy(model)
    assert copy.nbytes > OVERLAP_BYTES  # the threaded path
    resident = copy.restore("cpu", paths=["cpu"] * 4)
    assert torch.equal(resident.arena, copy.host)
    assert torch.equal(_out(resident.model), ref)


def test_a_failing_slice_fails_the_restore() -> None:
    copy = HostCopy(examples.mlp(examples.MlpConfig(hidden=1500, layers=3)))
    parts = slices.plan([copy.host], [(0, copy.nbytes)], 3, copy.nbytes)
    too_small = torch.empty(copy.nbytes // 2, dtype=torch.uint8)
    with pytest.raises((IndexError, RuntimeError)):  # raised in a slice thread, re-raised
        slices.start(parts, too_small, ["cpu"] * 3)()


@pytest.mark.parametrize("k", [1, 4])
def test_a_sliced_restore_from_the_tiers_is_bit_exact(k: int) -> None:
    """Keyed tensors of three dtypes (entries out of offset order), a tie, k slices."""
    mgr = StateManager(StateConfig(pin=False))
    mgr.start()
    model = examples.tied_lm()
    tokens = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        ref = model(tokens)
    copy = mgr.capture("m", model)
    held = mgr.acquire("m")
    try:
        resident = copy.restore("cpu", paths=["cpu"] * k)
    finally:
        mgr.release(held)
    assert resident.model.head.weight is resident.model.emb.weight
    with torch.inference_mode():
        assert torch.equal(resident.model(tokens), ref)


def test_cpu_devices_report_one_shared_link_and_its_bandwidth() -> None:
    inv = devices.cpu_inventory(devices.DevicesConfig(cpu_devices=4))
    assert inv.links == 1
    offer = inv.offer(9.5)
    assert [g.link for g in offer.gpus] == [0, 0, 0, 0]
    assert offer.restore_gb_per_s == 9.5
    assert offer.gather_gb_per_s == 0.0
    assert measure_bandwidth(inv) > 0  # one link: one copy measured
    assert measure_gather(inv) == 0.0  # the slices land in the arena: nothing to gather


def test_nvml_links_follow_the_pcie_switches() -> None:
    """GPUs sharing a PCIe switch (a common ancestor at MULTIPLE or closer) share its uplink;
    the others have a link each."""
    switch = {0: "a", 1: "a", 2: "b", 3: "c", 4: "c", 5: "c"}

    def ancestor(i: int, j: int) -> int:
        return 20 if switch[i] == switch[j] else 40  # MULTIPLE, else NODE

    assert devices.shared_links(6, ancestor) == (0, 0, 2, 3, 3, 3)
    assert devices.shared_links(3, lambda i, j: 30) == (0, 1, 2)  # HOSTBRIDGE: each its own


async def test_the_agent_reports_its_links_and_serves_exactly_after_a_two_slice_restore() -> None:
    async with started() as node:
        report = (await eventually(node.scheduler.reports, what="registration"))[0]
        assert [g.link for g in report.inventory.gpus] == [0, 0]  # CPU stand-ins: one link
        await node.prepare(ServiceSpec("ok", f"{EX}:mlp_service", dops=(1, 2)))
        await node.call("a", "ok", [0.25] * 8, gpus=(0, 1))
        out = await node.outcome("a")
        assert out.restore_s > 0
        assert out.output == direct(examples.mlp_service, [0.25] * 8)  # bit-exact


# ---------------------------------------------------------------- review (R2): no slice outlives
# its restore, exact after an eviction whatever k, NVML topology read through a fake NVML


def _slice_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("restore-slice")]


def _held_copies(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Slice threads that copy only once the returned event is set (a slow link)."""
    go = threading.Event()
    copy_pieces = slices._copy_pieces

    def slow(pieces: list[slices.Piece], arena: torch.Tensor) -> None:
        go.wait(10)
        copy_pieces(pieces, arena)

    monkeypatch.setattr(slices, "_copy_pieces", slow)
    return go


def _large() -> torch.nn.Module:
    return examples.mlp(examples.MlpConfig(hidden=1500, layers=3))  # past OVERLAP_BYTES


@pytest.mark.parametrize("tiered", [False, True])
def test_a_failed_rebuild_leaves_no_slice_copying(
    monkeypatch: pytest.MonkeyPatch, tiered: bool
) -> None:
    """The model is rebuilt while the slices copy: when that fails, the restore fails only
    after every slice ended (on CUDA an arena freed under a copy stream is memory another
    tensor may be given while the copy still writes it)."""
    if tiered:
        mgr = StateManager(StateConfig(pin=False))
        mgr.start()
        copy: HostCopy | StoredCopy = mgr.capture("m", _large())
    else:
        copy = HostCopy(_large())
    module = "services.gpu_manager.host_copy._bind"  # both kinds rebuild through it
    go = _held_copies(monkeypatch)

    def broken(*_: object) -> None:
        go.set()  # the slices may copy now: the failure comes while they do
        raise MemoryError("no room for the model")

    monkeypatch.setattr(module, broken)
    with pytest.raises(MemoryError):
        copy.restore("cpu", paths=["cpu"] * 4)
    assert not _slice_threads()


def test_a_slice_that_cannot_start_leaves_none_running(monkeypatch: pytest.MonkeyPatch) -> None:
    copy = HostCopy(_large())
    go = _held_copies(monkeypatch)
    started = 0
    real = threading.Thread.start

    def start(self: threading.Thread) -> None:
        nonlocal started
        started += 1
        if started == 3:
            go.set()
            raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    with pytest.raises(RuntimeError, match="can't start"):
        copy.restore("cpu", paths=["cpu"] * 4)
    monkeypatch.undo()
    assert not _slice_threads()


@pytest.mark.parametrize("tiered", [False, True])
def test_exact_after_eviction_and_a_restore_with_another_k(tiered: bool) -> None:
    """k = 4, the arena written over by the handler, evicted, then k = 2 and k = 3 (a chunk of
    other devices): the host bytes were never touched, every byte comes back."""
    model = _large()
    ref = _out(model)
    if tiered:
        mgr = StateManager(StateConfig(pin=False))
        mgr.start()
        copy: HostCopy | StoredCopy = mgr.capture("m", model)
    else:
        copy = HostCopy(model)
    first = copy.restore("cpu", paths=["cpu"] * 4)
    first.arena.fill_(0xFF)  # everything a handler could do to its device copy
    arena = copy.evict(first)
    for k in (2, 3):
        again = copy.restore("cpu", arena, paths=["cpu"] * k)
        assert torch.equal(_out(again.model), ref)
        arena = copy.evict(again)
        arena.fill_(0)


class _FakeNvmlError(Exception):
    pass


class _FakeNvml:
    """Four GPUs: 0 and 1 behind one PCIe switch, 2 alone, 3 whose topology NVML cannot say."""

    NVMLError = _FakeNvmlError

    def __init__(self, fail_init: bool = False) -> None:
        self.fail_init = fail_init
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise _FakeNvmlError("driver not loaded")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        if 3 in (a, b):
            raise _FakeNvmlError("not supported")
        return devices.NVML_TOPOLOGY_MULTIPLE if {a, b} == {0, 1} else 40

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"GPU"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> object:
        return type("Mem", (), {"total": 4096 * devices.MB})()


def test_nvml_topology_gives_the_links_and_errors_fall_back_as_before() -> None:
    nvml = _FakeNvml()
    got = devices._query(nvml, devices.DevicesConfig(gpu_reserve_mb=1024))
    assert [(d.index, d.link, d.torch_device) for d in got] == [
        (0, 0, "cuda:0"),
        (1, 0, "cuda:1"),
        (2, 2, "cuda:2"),
        (3, 3, "cuda:3"),  # topology unknown: a link of its own
    ]
    assert all(d.budget_bytes == 3072 * devices.MB for d in got)
    assert nvml.shut
    assert devices._query(_FakeNvml(fail_init=True), devices.DevicesConfig()) == ()
