"""The invariant host copy: one slab, a faithful layout, bit-exact restores, no write-back."""

from __future__ import annotations

import itertools

import pytest
import torch

from services.gpu_manager import examples
from services.gpu_manager.host_copy import (
    ALIGN,
    OVERLAP_BYTES,
    HostCopy,
    copy_chunked,
    held_bytes,
    measure_headroom,
)

TOKENS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])


def _outputs(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(x)


def test_mlp_restore_is_bit_exact() -> None:
    model = examples.mlp()
    x = torch.randn(5, 8)
    ref = _outputs(model, x)
    resident = HostCopy(model).restore("cpu")
    assert torch.equal(_outputs(resident.model, x), ref)


def test_ties_buffers_and_dtypes_survive() -> None:
    model = examples.tied_lm()
    ref = _outputs(model, TOKENS)
    copy = HostCopy(model)
    assert set(copy.layout.regions) == {torch.float32, torch.float16, torch.int64}
    restored = copy.restore("cpu").model
    assert isinstance(restored, examples.TiedLM)
    assert restored.head.weight is restored.emb.weight
    assert not restored.training
    assert torch.equal(_outputs(restored, TOKENS), ref)


def test_capture_frees_the_model_and_keeps_one_entry_per_tie() -> None:
    model = examples.tied_lm()
    copy = HostCopy(model)
    assert all(t.device.type == "meta" for t in model.state_dict().values())
    names = [e.name for e in copy.layout.entries]
    assert "emb.weight" in names
    assert "head.weight" not in names
    assert "scale" in names  # non-persistent buffers are state too


def test_layout_is_aligned_disjoint_and_grouped_by_dtype() -> None:
    layout = HostCopy(examples.tied_lm()).layout
    spans = sorted((e.offset, e.offset + e.nbytes) for e in layout.entries)
    assert all(a % ALIGN == 0 for a, _ in spans)
    assert all(end <= nxt for (_, end), (nxt, _) in itertools.pairwise(spans))
    for dtype, (start, size) in layout.regions.items():
        for e in layout.entries:
            inside = start <= e.offset < start + size
            assert inside == (e.dtype == dtype)
    assert layout.nbytes == sum(size for _, size in layout.regions.values())


def test_mutating_a_resident_model_leaves_the_host_copy_intact() -> None:
    model = examples.tied_lm()
    ref = _outputs(model, TOKENS)
    copy = HostCopy(model)
    host_before = copy.host.clone()
    first = copy.restore("cpu").model.train()
    first(TOKENS)  # updates batch-norm running stats in the arena
    with torch.no_grad():
        first.mix.weight.mul_(2)
    again = copy.restore("cpu").model  # evict (drop) and restore
    assert torch.equal(copy.host, host_before)
    assert torch.equal(_outputs(again, TOKENS), ref)


def test_two_residents_are_independent() -> None:
    copy = HostCopy(examples.mlp())
    a, b = copy.restore("cpu"), copy.restore("cpu")
    assert a.arena.data_ptr() != b.arena.data_ptr()
    with torch.no_grad():
        next(a.model.parameters()).zero_()
    x = torch.randn(3, 8)
    assert not torch.equal(_outputs(a.model, x), _outputs(b.model, x))


def test_restore_into_a_preallocated_arena() -> None:
    model = examples.mlp()
    x = torch.randn(2, 8)
    ref = _outputs(model, x)
    copy = HostCopy(model)
    arena = torch.full((copy.nbytes + 1000,), 7, dtype=torch.uint8)
    resident = copy.restore("cpu", arena)
    assert resident.arena.data_ptr() == arena.data_ptr()
    assert torch.equal(_outputs(resident.model, x), ref)


@pytest.mark.parametrize(
    "arena",
    [torch.empty(16, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.float32)],
)
def test_unfit_arena_is_refused(arena: torch.Tensor) -> None:
    with pytest.raises(ValueError, match="arena"):
        HostCopy(examples.mlp()).restore("cpu", arena)


def test_chunked_copy_covers_every_byte() -> None:
    src = torch.randint(0, 255, (1000,), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    copy_chunked(src, dst, chunk_bytes=77)
    assert torch.equal(src, dst)


def test_headroom_is_zero_where_unmeasurable() -> None:
    resident = HostCopy(examples.mlp()).restore("cpu")
    assert measure_headroom(resident, examples.mlp_handle, [[0.0] * 8]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_restore_from_pinned_host_copy() -> None:  # pragma: no cover - needs a GPU
    model = examples.mlp()
    x = torch.randn(4, 8)
    ref = _outputs(model, x)
    copy = HostCopy(model)
    assert copy.host.is_pinned()
    resident = copy.restore("cuda:0")
    assert torch.allclose(_outputs(resident.model, x.cuda()).cpu(), ref, atol=1e-5)
    assert measure_headroom(resident, examples.mlp_handle, [[0.0] * 8] * 64) > 0


def test_large_restore_overlaps_the_copy_and_stays_exact() -> None:
    model = examples.mlp(examples.MlpConfig(hidden=1500, layers=3))
    x = torch.randn(3, 8)
    ref = _outputs(model, x)
    copy = HostCopy(model)
    assert copy.nbytes > OVERLAP_BYTES  # takes the threaded path
    assert torch.equal(_outputs(copy.restore("cpu").model, x), ref)


def test_evicted_model_is_recycled_without_write_back() -> None:
    model = examples.tied_lm()
    ref = _outputs(model, TOKENS)
    copy = HostCopy(model)
    host_before = copy.host.clone()
    first = copy.restore("cpu")
    with torch.no_grad():
        first.model.mix.weight.zero_()
    copy.evict(first)
    assert all(t.device.type == "meta" for t in first.model.state_dict().values())
    again = copy.restore("cpu")
    assert again.model is first.model  # the shell is reused, its state is fresh
    assert again.model.head.weight is again.model.emb.weight
    assert torch.equal(copy.host, host_before)
    assert torch.equal(_outputs(again.model, TOKENS), ref)


def test_held_bytes_counts_the_arena_and_what_a_handler_added() -> None:
    resident = HostCopy(examples.mlp()).restore("cpu")
    arena = resident.arena.untyped_storage().nbytes()
    assert held_bytes(resident) == arena  # every parameter is a view of the arena
    resident.model.register_buffer("cache", torch.zeros(1000))
    resident.model[0].register_buffer("same", resident.model.get_buffer("cache")[:10])
    assert held_bytes(resident) == arena + 4000  # the cache once, though two hold it
