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

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.core.books import GpuFacts, Node
from tangram.chunks import MAX_CHUNK as MAX_CHUNK
from tangram.chunks import Chunk as Chunk
from tangram.chunks import chunk_counts as chunk_counts
from tangram.chunks import chunk_level
from tangram.chunks import free_chunks as free_chunks

# When an agent did not measure its host->device bandwidth: a PCIe 4.0 x16 link's practical rate.
DEFAULT_RESTORE_GB_PER_S = 20.0


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


def usable(facts: GpuFacts, free: set[int]) -> list[bool]:
    """Per position: free and not down."""
    return [g in free and g not in facts.down for g in facts.gpus]


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


def pick(chunks: Sequence[Chunk], units: int, resident: frozenset[int]) -> Chunk | None:
    """The chunk a grant of ``units`` gets: one that holds the service already (all its
    positions in ``resident``) if any is free, at any level (a restore costs more than
    a split); else the buddy rule (the smallest level that holds it)."""
    for chunk in _aligned(chunks, 1 << chunk_level(units)):
        if resident.issuperset(chunk.positions()):
            return chunk  # no restore: worth more than keeping a larger chunk whole
    cands = candidates(chunks, units)
    return cands[0] if cands else None


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
    where = {g: p for p, g in enumerate(facts.gpus)}
    return frozenset(where[g] for g in entry.resident if g in where)


def restore_s(facts: GpuFacts, service: str, dop: int) -> float:
    """Seconds to bring the ``dop`` variant of ``service`` onto a chunk of this node."""
    entry = facts.services.get((service, dop))
    footprint = entry.footprint_mb if entry is not None else 0
    rate = facts.restore_gb_per_s if facts.restore_gb_per_s > 0 else DEFAULT_RESTORE_GB_PER_S
    return footprint / 1024.0 / rate


def grant_cost(facts: GpuFacts, chunks: Sequence[Chunk], service: str, dop: int) -> float:
    """The restore part of a grant's duration: 0 when the chunk the buddy rule would pick
    holds the service already."""
    resident = resident_positions(facts, service, dop)
    chunk = pick(chunks, dop, resident)
    if chunk is not None and resident.issuperset(chunk.positions()):
        return 0.0
    return restore_s(facts, service, dop)


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
