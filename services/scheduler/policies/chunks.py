"""GPU buddy chunks (§5.3): sizes 1, 2, 4, 8 and the smallest-fit split rule of Algorithm 4.

Kept apart from ``dparrange`` (whose kernels compile) so the scheduler core can use the rule
without importing the compiled code."""

from __future__ import annotations

from collections.abc import Sequence

from services.scheduler.policies.base import Waiting

CHUNK_SIZES = (1, 2, 4, 8)


def chunk_level(units: int) -> int:
    """The level a of the chunk 2**a that serves ``units`` GPUs (2**(a-1) < units ≤ 2**a)."""
    if not 1 <= units <= CHUNK_SIZES[-1]:
        raise ValueError(f"a GPU request must be 1..{CHUNK_SIZES[-1]} units, got {units}")
    return (units - 1).bit_length()


def take_chunk(counts: tuple[int, ...], level: int) -> tuple[int, ...] | None:
    """Free-chunk counts after taking a 2**level chunk by the smallest-fit buddy rule."""
    for b in range(level, len(counts)):
        if counts[b] > 0:
            out = list(counts)
            out[b] -= 1
            for lv in range(level, b):  # splitting 2**b leaves one free buddy per lower level
                out[lv] += 1
            return tuple(out)
    return None


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
