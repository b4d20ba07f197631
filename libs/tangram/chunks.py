"""Buddy chunks of a GPU node (§5.3, Algorithm 4): the one implementation the scheduler and
the gpu_manager share, so a chunk the scheduler grants is one the agent accepts.

A node's GPUs are laid out in order (positions ``0..n-1``). A chunk is a run of ``2**a`` of them
(``a`` in 0..3) that starts at a multiple of ``2**a``. The free GPUs form maximal free chunks; a
grant of ``m`` GPUs takes a chunk of the smallest level ``a`` with ``2**a >= m`` (the smallest
free level that holds it, split into buddies) and gives it back merged with its free buddy.
Pure, no dependencies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

CHUNK_SIZES = (1, 2, 4, 8)
MAX_CHUNK = CHUNK_SIZES[-1]


def chunk_level(units: int) -> int:
    """The level a of the chunk 2**a that serves ``units`` GPUs (2**(a-1) < units ≤ 2**a)."""
    if not 1 <= units <= MAX_CHUNK:
        raise ValueError(f"a GPU request must be 1..{MAX_CHUNK} units, got {units}")
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


@dataclass(frozen=True, slots=True, order=True)
class Chunk:
    """A legal chunk: ``size`` GPUs from position ``start`` of its node's GPU list."""

    start: int
    size: int

    def __post_init__(self) -> None:
        if self.size not in CHUNK_SIZES or self.start < 0 or self.start % self.size:
            raise ValueError(f"illegal chunk start={self.start} size={self.size}")

    @property
    def level(self) -> int:
        return self.size.bit_length() - 1

    def positions(self) -> range:
        return range(self.start, self.start + self.size)

    def halves(self) -> tuple[Chunk, Chunk]:
        """The two buddies this chunk splits into."""
        half = self.size // 2
        return Chunk(self.start, half), Chunk(self.start + half, half)

    def parent(self) -> Chunk | None:
        """The chunk this one merges into with its buddy (None at the top level)."""
        if self.size == MAX_CHUNK:
            return None
        size = self.size * 2
        return Chunk(self.start - self.start % size, size)

    def holds(self, inner: Chunk) -> bool:
        """Whether ``inner`` lies within this chunk."""
        return self.start <= inner.start and inner.start + inner.size <= self.start + self.size


def free_chunks(ok: Sequence[bool]) -> list[Chunk]:
    """The maximal free legal chunks (largest first) of GPUs free where ``ok``: a chunk is kept
    when all its GPUs are free and no larger free chunk holds it."""
    out: list[Chunk] = []
    covered = [False] * len(ok)
    for size in reversed(CHUNK_SIZES):
        for start in range(0, len(ok) - size + 1, size):
            span = range(start, start + size)
            if all(ok[p] and not covered[p] for p in span):
                out.append(Chunk(start, size))
                for p in span:
                    covered[p] = True
    return out


def root_chunks(n: int) -> tuple[Chunk, ...]:
    """The largest legal chunks that tile GPUs ``0..n-1`` (a node starts as these), in order."""
    return tuple(sorted(free_chunks([True] * n)))


def chunk_counts(chunks: Iterable[Chunk]) -> tuple[int, int, int, int]:
    """Free chunks per size 1, 2, 4, 8: the state of Algorithm 4."""
    sizes = [c.size for c in chunks]
    return sizes.count(1), sizes.count(2), sizes.count(4), sizes.count(8)


def chunk_of(positions: Sequence[int], n: int) -> Chunk | None:
    """The chunk ``positions`` name on a node of ``n`` GPUs, or None if they name none (not
    contiguous, not a legal size or alignment, or past the last GPU)."""
    if not positions or len(positions) not in CHUNK_SIZES or positions[0] < 0:
        return None
    if positions[0] % len(positions):
        return None
    start = positions[0]
    if list(positions) != list(range(start, start + len(positions))) or positions[-1] >= n:
        return None
    return Chunk(start, len(positions))
