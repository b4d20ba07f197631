"""Device memory that evicted copies freed, kept for the next restore of the same size (on
torch's CPU device: the stand-in devices of a machine without a GPU).

On CUDA, PyTorch's caching allocator hands a freed block back to the next allocation of its
size, so a restore after an eviction copies into memory that is already mapped. On the CPU
device an allocation of a model's size is a fresh ``mmap``, and the restore's copy faults
each page in (and the kernel zeroes it) on first touch: ~3 GB/s on the development machine,
against ~19 GB/s into mapped memory. This pool does for the stand-ins what the caching
allocator does on a GPU: an evicted copy's arena is kept, unless something still views it
(a tensor a handler kept: reusing the memory would change what it sees), and the next
restore of exactly that many bytes copies into it. Exact sizes only: a copy's measured
footprint is its arena's storage (``host_copy.held_bytes``), so a larger arena would read as
a copy outgrowing its device. The pool holds at most ``limit`` bytes (the devices' budgets),
the oldest let go first. CUDA arenas are never kept (the allocator does it, and memory held
here would be memory a forward pass could not use).

Used on the event loop only (the executor takes an arena before it hands a restore to a
worker thread).
"""

from __future__ import annotations

import torch


def unshared(arena: torch.Tensor) -> bool:
    """Whether ``arena`` is the only tensor on its memory and spans all of it."""
    storage = arena.untyped_storage()
    count = getattr(torch._C, "_storage_Use_Count", None)  # pinned torch; absent: never reuse
    if count is None or storage.nbytes() != arena.numel() * arena.element_size():
        return False
    # the arena's reference, the one ``storage`` holds while we ask, and the base tensor's
    # when the arena is a view of it (a slab cut from an allocation)
    return int(count(storage._cdata)) <= 2 + (arena._base is not None)


class Arenas:
    """Freed CPU arenas by size, most recently freed first; at most ``limit`` bytes held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._kept: list[torch.Tensor] = []  # oldest first
        self.reused = 0  # restores that copied into a kept arena
        self.kept_bytes = 0

    def give(self, arena: torch.Tensor) -> bool:
        """Keep an evicted copy's arena for a later restore; False when it is not kept."""
        if arena.device.type != "cpu" or arena.dtype != torch.uint8 or not unshared(arena):
            return False
        n = arena.numel()
        if n > self.limit:
            return False
        self._kept.append(arena)
        self.kept_bytes += n
        while self.kept_bytes > self.limit:
            self.kept_bytes -= self._kept.pop(0).numel()
        return True

    def take(self, device: torch.device | str, nbytes: int) -> torch.Tensor | None:
        """A kept arena of exactly ``nbytes`` on ``device`` (None: none, allocate afresh)."""
        device = torch.device(device)
        for i in range(len(self._kept) - 1, -1, -1):
            arena = self._kept[i]
            if arena.numel() == nbytes and arena.device == device:
                del self._kept[i]
                self.kept_bytes -= nbytes
                if not unshared(arena):  # cannot happen: nothing else held it when kept
                    continue
                self.reused += 1
                return arena
        return None

    def __len__(self) -> int:
        return len(self._kept)
