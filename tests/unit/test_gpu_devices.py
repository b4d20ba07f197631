"""Device inventory and the buddy chunks (``tangram.chunks``) both sides share."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gpu_manager.devices import MB, DevicesConfig, cpu_inventory, discover
from services.scheduler.core import gpu
from services.scheduler.policies import dparrange
from tangram.chunks import (
    CHUNK_SIZES,
    Chunk,
    chunk_counts,
    chunk_of,
    free_chunks,
    root_chunks,
)
from tangram.errors import Unavailable


def test_the_scheduler_and_the_agent_share_one_chunk_geometry() -> None:
    assert dparrange.CHUNK_SIZES is CHUNK_SIZES
    assert (gpu.Chunk, gpu.free_chunks, gpu.chunk_counts) == (Chunk, free_chunks, chunk_counts)


@pytest.mark.parametrize(("start", "size"), [(1, 2), (2, 4), (0, 3), (0, 16), (-2, 2)])
def test_illegal_chunks_are_refused(start: int, size: int) -> None:
    with pytest.raises(ValueError, match="illegal chunk"):
        Chunk(start, size)


@given(st.integers(1, 40))
def test_roots_tile_the_node_with_legal_maximal_chunks(n: int) -> None:
    roots = root_chunks(n)
    assert [d for c in roots for d in c.positions()] == list(range(n))
    for a, b in itertools.pairwise(roots):  # maximal: no two roots are buddies
        assert a.size != b.size or a.parent() is None or a.parent() != b.parent()


def test_split_and_parent_are_buddies() -> None:
    lo, hi = Chunk(8, 8).halves()
    assert (lo, hi) == (Chunk(8, 4), Chunk(12, 4))
    assert lo.parent() == hi.parent() == Chunk(8, 8)
    assert Chunk(0, 8).parent() is None
    assert Chunk(6, 2).level == 1


def test_chunk_counts_are_the_chunk_operator_state() -> None:
    assert chunk_counts(root_chunks(8)) == (0, 0, 0, 1)
    assert chunk_counts(root_chunks(7)) == (1, 1, 1, 0)
    dparrange.ChunkOperator(chunk_counts(root_chunks(7)))  # accepted as is


@pytest.mark.parametrize(
    ("gpus", "chunk"),
    [
        ((0,), Chunk(0, 1)),
        ((2, 3), Chunk(2, 2)),
        ((0, 1, 2, 3), Chunk(0, 4)),
        ((4, 5, 6, 7), None),  # past the last of 6 GPUs
        ((1, 2), None),  # misaligned
        ((0, 2), None),  # not contiguous
        ((0, 1, 2), None),  # not a chunk size
        ((6, 7), None),  # past the last of 6 GPUs
        ((-2, -1), None),
        ((), None),
    ],
)
def test_chunk_of_names_only_legal_chunks(gpus: tuple[int, ...], chunk: Chunk | None) -> None:
    assert chunk_of(gpus, 6) == chunk


def test_cpu_inventory_from_config() -> None:
    inv = cpu_inventory(DevicesConfig(cpu_devices=3, cpu_budget_mb=256))
    assert inv.kind == "cpu"
    assert [d.torch_device for d in inv.devices] == ["cpu"] * 3
    assert {d.budget_bytes for d in inv.devices} == {256 * MB}
    assert inv.roots == (Chunk(0, 2), Chunk(2, 1))
    assert inv.describe() == "3 cpu device(s), budget 256 MB"


def test_auto_falls_back_to_cpu_without_nvml() -> None:
    assert discover(DevicesConfig(cpu_devices=2)).kind == "cpu"


def test_nvml_backend_without_gpu_is_unavailable() -> None:
    with pytest.raises(Unavailable):
        discover(DevicesConfig(backend="nvml"))


@pytest.mark.parametrize(
    "raw", [{"cpu_device": 2}, {"cpu_devices": 0}, {"cpu_budget_mb": -1}, {"backend": "tpu"}]
)
def test_config_typos_and_absurd_values_fail(raw: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(raw, DevicesConfig)
