"""GPU buddy chunks for the policies (§5.3): the rule of Algorithm 4 (``tangram.chunks``, shared
with the gpu_manager) and the FCFS prefix a pool's chunks can hold.

Kept apart from ``dparrange`` (whose kernels compile) so the scheduler core can use the rule
without importing the compiled code."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.policies.base import Waiting
from tangram.chunks import CHUNK_SIZES, chunk_level, take_chunk

__all__ = ["CHUNK_SIZES", "chunk_level", "fits_chunks_at_min", "take_chunk"]


def fits_chunks_at_min(waiting: Sequence[Waiting], free_chunks: tuple[int, ...]) -> int:
    """Longest FCFS prefix whose minimum GPU requests the buddy chunks can all hold."""
    counts: tuple[int, ...] | None = free_chunks
    n = 0
    for w in waiting:
        counts = take_chunk(counts, chunk_level(w.min)) if counts is not None else None
        if counts is None:
            break
        n += 1
    return n
