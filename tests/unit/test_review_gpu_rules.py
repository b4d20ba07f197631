"""Review of the GPU rules of 4f379fb: which chunk a restore takes (gpu.cached / pick) and
which node a call goes to (_choose) under a policy without chunk arrangement."""

from __future__ import annotations

import pytest

from services.scheduler.core import gpu
from services.scheduler.core.books import GpuFacts
from tangram.contract import DurationHint, PreparedService

from .test_scheduler_gpu import core_with, gpu_report, infer, prepared, starts


def test_a_smallest_variant_policy_is_not_sent_to_a_copy_it_will_not_use() -> None:
    """Under ``min`` (every call its smallest variant) a DoP-2 copy is of no use to a DoP-1
    grant: the call should go by free GPUs (g0, 8 free) as before, not to g1 (2 free), where
    it restores its DoP-1 variant over the DoP-2 copy's GPUs anyway."""
    slow = DurationHint(t_ori_s=1.0, parallel_fraction=0.5)
    c = core_with(
        gpu_report("g0", gpus=8, services=prepared()),
        gpu_report("g1", gpus=2, services=prepared(resident={2: (0, 1)})),
        policy="min",
    )
    c.enqueue(infer("a", hint=slow), 0.0)
    (a,) = starts(c.schedule(0.0))
    assert len(a.gpus) == 1
    assert a.node_id == "g0"  # g1: a restore that may evict the warm DoP-2 copy


def test_a_restore_does_not_take_a_chunk_twice_as_slow_to_spare_an_idle_copy() -> None:
    """Four GPUs; 0 and 1 restore through their own links, 2 and 3 share one. Chunk 0-1 holds
    an idle (not in demand) service; 2-3 holds nothing. A DoP-2 restore of 8 GiB takes 2.15 s
    on 0-1 and 4.29 s on 2-3: ``pick`` takes 0-1 (sparing the idle copy is not worth a restore twice
    as long), and ``grant_cost`` prices the chunk a grant gets."""
    facts = GpuFacts(
        gpus=(0, 1, 2, 3),
        restore_gb_per_s=2.0,
        links=(0, 1, 2, 2),
        services={
            ("idle", 1): PreparedService(name="idle", footprint_mb=100, resident=(0, 1)),
            ("big", 2): PreparedService(name="big", dop=2, footprint_mb=8192),
        },
    )
    chunks = gpu.free_chunks([True] * 4)
    held = gpu.cached(facts, set().__contains__)
    chunk = gpu.pick(chunks, 2, frozenset(), held)
    assert chunk is not None
    assert chunk == gpu.Chunk(0, 2)
    priced = gpu.grant_cost(facts, chunks, "big", 2)
    assert gpu.restore_s(facts, "big", 2, chunk) == priced == pytest.approx(8192 * 2**20 / 1e9 / 4)
