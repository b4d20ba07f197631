"""A GPU node's pool as buddy chunks (§5.3, Algorithm 4) and the facts a GPU grant depends on.

Pure. A node's GPUs are laid out in index order; a chunk is a run of ``2**a`` of them starting at
a multiple of ``2**a`` (positions, not indices, so a node whose GPUs are 0, 1, 4, 5 still has
two legal pairs). The free GPUs form maximal free chunks; a grant of ``m`` GPUs takes a chunk of
the smallest level that holds ``2**a >= m`` GPUs and splits it into buddies, exactly the rule
the DP operator of the elastic policy (``ChunkOperator``) assumes, so every grant it arranges
finds its chunk (the geometry is ``tangram.chunks``, shared with the gpu_manager). Among the
chunks of that level the one where the service already resides wins (no restore); its restore
cost otherwise is its footprint over the node's copy bandwidth.

A busy chunk runs one DoP variant of one service (:class:`Shared`): calls to that variant may
share it, up to the service's ``max_batch``, and the agent coalesces them into forward passes.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.core.books import GpuFacts, Node
from tangram.chunks import MAX_CHUNK as MAX_CHUNK
from tangram.chunks import Chunk as Chunk
from tangram.chunks import chunk_counts as chunk_counts
from tangram.chunks import chunk_level, root_chunks
from tangram.chunks import free_chunks as free_chunks

# When an agent did not measure its host->device bandwidth: a PCIe 4.0 x16 link's practical rate.
DEFAULT_RESTORE_GB_PER_S = 20.0
# No real link is slower: a lower figure is not a measurement (and would price a restore at
# years, or past a float's range).
MIN_GB_PER_S = 1e-3


@dataclass(slots=True)
class Shared:
    """What a busy chunk runs: ``calls`` calls of the ``dop`` variant of ``service``; open to
    more calls of it unless ``closed`` (a cancelled call is still on it: it may be stuck)."""

    service: str
    dop: int
    calls: int = 0
    closed: bool = False

    def takes(self, service: str, dops: Iterable[int], max_batch: int) -> bool:
        """Whether a call of ``service`` that may run as any of ``dops`` can join it."""
        return (
            not self.closed
            and self.service == service
            and self.dop in dops
            and self.calls < max_batch
        )


def usable(facts: GpuFacts, free: set[int]) -> tuple[bool, ...]:
    """Per position: free and not down."""
    return tuple(g in free and g not in facts.down for g in facts.gpus)


@functools.lru_cache(maxsize=4096)
def free_chunks_of(ok: tuple[bool, ...]) -> tuple[Chunk, ...]:
    """``free_chunks``, remembered: a pass asks it of the same few free sets again and
    again (chunks are immutable, so the answer is shared)."""
    return tuple(free_chunks(ok))


@functools.lru_cache(maxsize=1024)
def positions_of(gpus: tuple[int, ...]) -> dict[int, int]:
    """GPU index -> position on a node of ``gpus`` (shared: never to be changed)."""
    return {g: p for p, g in enumerate(gpus)}


def candidates(chunks: Sequence[Chunk], units: int) -> list[Chunk]:
    """The chunks of ``2**a >= units`` GPUs the buddy rule may grant: the aligned sub-chunks of
    the free chunks of the smallest level that holds them (empty when none does)."""
    size = 1 << chunk_level(units)
    fitting = [c for c in chunks if c.size >= size]
    if not fitting:
        return []
    level = min(c.size for c in fitting)
    return [
        Chunk(s, size)
        for c in fitting
        if c.size == level
        for s in range(c.start, c.start + c.size, size)
    ]


def pick(
    chunks: Sequence[Chunk], units: int, resident: frozenset[int], held: Held | None = None
) -> Chunk | None:
    """The chunk a grant of ``units`` gets: one that holds the service already (all its
    positions in ``resident``) if any is free, at any level (a restore costs more than
    a split); else the buddy rule (the smallest level that holds it), and among the chunks
    of that level the best by ``held.rank`` (none given: the first)."""
    for chunk in _aligned(chunks, 1 << chunk_level(units)):
        if resident.issuperset(chunk.positions()):
            return chunk  # no restore: worth more than keeping a larger chunk whole
    cands = candidates(chunks, units)
    if not cands or held is None:
        return cands[0] if cands else None
    return min(cands, key=held.rank)  # min keeps the first of equals


@dataclass(frozen=True, slots=True)
class Held:
    """What a restore onto a chunk of a node costs besides its own bytes, per position: the
    MiB of copies of services in demand (``hot``) and of all (``every``) that it may evict,
    and the host link each device restores through."""

    hot: tuple[float, ...]
    every: tuple[float, ...]
    links: tuple[int, ...]

    def rank(self, chunk: Chunk) -> tuple[int, float, float]:
        """Sooner restored first (its busiest link carries the fewest slices), then the
        fewest MiB of in-demand copies evicted, then of any copies."""
        pos = [p for p in chunk.positions() if p < len(self.hot)]
        busiest = max(Counter(_links_of(self.links, chunk)).values())
        return busiest, sum(self.hot[p] for p in pos), sum(self.every[p] for p in pos)


def cached(facts: GpuFacts, hot: Callable[[str], bool]) -> Held:
    """What a restore on each position may evict: the MiB of the copies it holds (a copy's
    share of its variant's footprint, what it would cost to restore that share again), of
    services ``hot`` (calls queued or running: their copies would be restored again soon)
    and of all. An eviction-on-execution node frees the least recently used copies of a
    device to make room (§5.3), so among chunks as quick to restore onto, the one holding
    the least of what is in demand keeps the copies the next calls will look for (Figure
    8(b): restores fall)."""
    at = positions_of(facts.gpus)
    warm, every = [0.0] * len(facts.gpus), [0.0] * len(facts.gpus)
    for (name, dop), entry in facts.services.items():
        if entry.error or not entry.resident:
            continue
        share = entry.footprint_mb / max(1, dop)
        for g in entry.resident:
            p = at.get(g)
            if p is not None:
                every[p] += share
                warm[p] += share if hot(name) else 0.0
    return Held(tuple(warm), tuple(every), facts.links)


def _aligned(chunks: Sequence[Chunk], size: int) -> list[Chunk]:
    """Every legal chunk of ``size`` GPUs inside the free chunks."""
    return [
        Chunk(s, size)
        for c in chunks
        if c.size >= size
        for s in range(c.start, c.start + c.size, size)
    ]


def resident_positions(facts: GpuFacts, service: str, dop: int) -> frozenset[int]:
    """The positions of the GPUs the node reports holding a copy of the ``dop`` variant of
    ``service`` (``PreparedService.resident``: every GPU holding one; copies sit on aligned
    chunks, so a free chunk all of whose GPUs are listed holds a copy)."""
    entry = facts.services.get((service, dop))
    if entry is None or entry.error:
        return frozenset()
    where = positions_of(facts.gpus)
    return frozenset(where[g] for g in entry.resident if g in where)


def restore_cost(
    mb: float, links: Sequence[int], gb_per_s: float, gather_gb_per_s: float = 0.0
) -> float:
    """Seconds to restore ``mb`` MiB (2**20 bytes) onto a chunk whose devices copy through
    ``links`` (one id per device, in chunk order; equal ids share one host link, -1 counts as
    one shared link), at ``gb_per_s`` and ``gather_gb_per_s`` in decimal GB (1e9 bytes) a
    second, as the gpu_manager measures them (``bandwidth.py``) and reports them.

    The gpu_manager restores a chunk of ``k`` devices as ``k`` equal slices, slice ``i``
    through device ``i``'s link, all at once: the busiest link carries ``busiest`` slices, so
    the load takes ``mb * busiest / k`` over one link's ``gb_per_s`` -- ``mb / (min(k, links)
    * gb_per_s)`` when the links are shared evenly (CPU stand-ins: one link, the whole model
    through it; NVML devices: one each, ``k`` times less per link). Where the agent reports a
    gather (``gather_gb_per_s`` > 0: CUDA, the model runs on the chunk's first device), the
    ``(k - 1) / k`` of the bytes loaded through the other devices then cross to it device to
    device; counted after the load, not overlapped with it (an upper bound: the agent starts
    each slice's gather when that slice is loaded). Finite and never negative, whatever it is
    given (a rate below ``MIN_GB_PER_S`` is taken as that; no bandwidth: the default)."""
    k = max(1, len(links))
    gb = max(0.0, mb) * (2**20 / 1e9) if math.isfinite(mb) else 0.0  # MiB -> decimal GB
    rate = max(MIN_GB_PER_S, gb_per_s) if gb_per_s > 0 else DEFAULT_RESTORE_GB_PER_S
    busiest = max(Counter(links).values()) if links else 1
    load = gb * busiest / k / rate
    gather = gb * (k - 1) / k / max(MIN_GB_PER_S, gather_gb_per_s) if gather_gb_per_s > 0 else 0.0
    return load + gather


def chunk_links(facts: GpuFacts, chunk: Chunk) -> tuple[int, ...]:
    """The host link of each device of ``chunk`` (-1 where the node reported none)."""
    return _links_of(facts.links, chunk)


def restore_s(facts: GpuFacts, service: str, dop: int, chunk: Chunk | None = None) -> float:
    """Seconds to bring the ``dop`` variant of ``service`` onto ``chunk`` of this node (when
    not given: onto its slowest chunk of that size, by how its devices share links)."""
    entry = facts.services.get((service, dop))
    footprint = entry.footprint_mb if entry is not None else 0
    if chunk is not None:
        links = chunk_links(facts, chunk)
    else:
        links = _slowest_links(facts.links, len(facts.gpus), 1 << chunk_level(dop))
    return restore_cost(footprint, links, facts.restore_gb_per_s, facts.gather_gb_per_s)


def _links_of(links: tuple[int, ...], chunk: Chunk) -> tuple[int, ...]:
    return tuple(links[p] if p < len(links) else -1 for p in chunk.positions())


@functools.lru_cache(maxsize=1024)
def _slowest_links(links: tuple[int, ...], n: int, size: int) -> tuple[int, ...]:
    """The links of the chunk of ``size`` on a node of ``n`` GPUs whose busiest link carries
    the most of its slices (a node smaller than the chunk: one link, never granted anyway)."""
    chunks = _aligned(root_chunks(n), size)
    if not chunks:
        return (-1,) * size
    return max((_links_of(links, c) for c in chunks), key=lambda ls: max(Counter(ls).values()))


def grant_cost(facts: GpuFacts, chunks: Sequence[Chunk], service: str, dop: int) -> float:
    """The restore part of a grant's duration: 0 when the chunk the buddy rule would pick
    holds the service already."""
    resident = resident_positions(facts, service, dop)
    chunk = pick(chunks, dop, resident, _links_only(facts))  # as quick to restore as a grant's
    if chunk is not None and resident.issuperset(chunk.positions()):
        return 0.0
    return restore_s(facts, service, dop, chunk)


def ready_dops(facts: GpuFacts, service: str, dops: Iterable[int]) -> tuple[int, ...]:
    """The variants of ``service`` this node prepared and can hold (not above its GPUs)."""
    top = min(len(facts.gpus), MAX_CHUNK)
    out = []
    for d in dops:
        entry = facts.services.get((service, d))
        if d <= top and entry is not None and not entry.error:
            out.append(d)
    return tuple(out)


def gpus_of(facts: GpuFacts, chunk: Chunk) -> tuple[int, ...]:
    return tuple(facts.gpus[p] for p in chunk.positions())


def hrrs_score(wait_s: float, exec_s: float, setup_s: float) -> float:
    """plexrl Algorithm 1 (Eq. 4): the response ratio with the setup cost in the service time,
    so that calls to a resident service (no setup) go first until a cold one has waited long
    enough; higher is sooner."""
    service_s = max(exec_s + setup_s, 1e-6)
    return (max(0.0, wait_s) + service_s) / service_s


def is_gpu(node: Node) -> bool:
    return node.gpu is not None


def _links_only(facts: GpuFacts) -> Held:
    """A ``Held`` that ranks chunks by how quick a restore onto them is, and nothing else."""
    none = (0.0,) * len(facts.gpus)
    return Held(none, none, facts.links)
