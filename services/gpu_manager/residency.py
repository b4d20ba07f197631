"""Which services are resident on which devices, and who runs where: the EOE core (§5.3).

Pure and synchronous; the shell passes the clock's ``now``. An action asks for ``units`` devices
for a service that needs ``nbytes`` on each. The core takes a free chunk by the buddy rule (the
smallest level that holds the request; among chunks of that level, the one already caching the
service, then the one with most free memory), marks its devices busy, and plans the evictions
(least recently used first) that make room for a restore without ever exceeding a device's
budget. Eviction never writes back: the host copy is invariant, so the shell just frees memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tangram.chunks import CHUNK_SIZES, Chunk, chunk_level, root_chunks
from tangram.errors import InternalError, InvalidRequest


@dataclass(frozen=True, slots=True)
class Placement:
    """A service resident on a chunk (``nbytes`` on each of its devices)."""

    service: str
    chunk: Chunk


@dataclass(slots=True)
class Cached:
    nbytes: int
    last_used: float
    seq: int  # breaks ties between equal clock readings, in use order


@dataclass(frozen=True, slots=True)
class Grant:
    """What the shell must do for an action: free ``evict``, restore if ``restore``, then run."""

    action_id: str
    placement: Placement
    evict: tuple[Placement, ...]
    restore: bool


class ChunkPool:
    """Free buddy chunks of one node: taken by smallest fit, merged back with their buddies."""

    def __init__(self, n_devices: int) -> None:
        self.free: set[Chunk] = set(root_chunks(n_devices))

    def take(self, level: int, key: Callable[[Chunk], tuple[float, ...]]) -> Chunk | None:
        """A chunk of ``level``: from the smallest free level ≥ it, best by ``key``."""
        levels = [c.level for c in self.free if c.level >= level]
        if not levels:
            return None
        best = max((c for c in self.free if c.level == min(levels)), key=key)
        self.free.remove(best)
        while best.level > level:  # split; keep the better buddy, free the other
            lo, hi = best.halves()
            best = hi if key(hi) > key(lo) else lo
            self.free.add(lo if best is hi else hi)
        return best

    def take_exact(self, chunk: Chunk) -> bool:
        """Take exactly ``chunk`` (splitting the free chunk around it); False if not free."""
        outer = next((c for c in self.free if c.holds(chunk)), None)
        if outer is None:
            return False
        self.free.remove(outer)
        while outer != chunk:
            lo, hi = outer.halves()
            outer, other = (lo, hi) if lo.holds(chunk) else (hi, lo)
            self.free.add(other)
        return True

    def give(self, chunk: Chunk) -> None:
        """Return a chunk, merging it with its buddy while the buddy is free."""
        parent = chunk.parent()
        while parent is not None:
            buddy = next(h for h in parent.halves() if h != chunk)
            if buddy not in self.free:
                break
            self.free.remove(buddy)
            chunk, parent = parent, parent.parent()
        self.free.add(chunk)


def units_level(units: int) -> int:
    """The chunk level serving ``units`` devices (2**(a-1) < units ≤ 2**a)."""
    try:
        return chunk_level(units)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


@dataclass
class Residency:
    """Per-device residency and exclusivity of one node's devices."""

    budgets: tuple[int, ...]
    pool: ChunkPool = field(init=False)
    cached: dict[Placement, Cached] = field(default_factory=dict)
    busy: dict[int, str] = field(default_factory=dict)  # device -> action id
    running: dict[str, Grant] = field(default_factory=dict)
    _seq: int = 0

    def __post_init__(self) -> None:
        self.pool = ChunkPool(len(self.budgets))

    def used(self, device: int) -> int:
        """Bytes held on ``device`` by resident services."""
        return sum(c.nbytes for p, c in self.cached.items() if device in p.chunk.positions())

    def resident(self, service: str) -> list[Chunk]:
        """The chunks where ``service`` is resident."""
        return sorted(p.chunk for p in self.cached if p.service == service)

    def acquire(
        self,
        action_id: str,
        service: str,
        units: int,
        nbytes: int,
        now: float,
        chunk: Chunk | None = None,
    ) -> Grant | None:
        """Grant a chunk (``chunk`` if given) for one action; None while none is free."""
        self._check(action_id, units, nbytes, chunk)
        got = self._take(service, units_level(units), nbytes, chunk)
        if got is None:
            return None
        placement = Placement(service, got)
        held = self.cached.get(placement)
        # a copy cached before the service was re-measured grows in place: room for the rest
        grow = nbytes if held is None else nbytes - held.nbytes
        evict = self._make_room(got, grow, placement) if grow > 0 else ()
        restore = held is None
        self._touch(placement, nbytes, now)
        grant = Grant(action_id, placement, evict, restore)
        self.running[action_id] = grant
        self.busy.update(dict.fromkeys(got.positions(), action_id))
        return grant

    def warm(
        self, action_id: str, service: str, units: int, nbytes: int, now: float
    ) -> Grant | None:
        """Grant a free chunk to restore ``service`` ahead of its calls (a prefetch): only if
        it is resident nowhere yet and fits beside what the chunk caches -- nothing is
        evicted, so nothing a running action uses; None otherwise. Release it as an action."""
        if self.resident(service) or action_id in self.running or nbytes > max(self.budgets):
            return None
        level = units_level(units)
        got = self.pool.take(level, self._preference(service, CHUNK_SIZES[level], nbytes))
        if got is None:
            return None
        if any(self.used(d) + nbytes > self.budgets[d] for d in got.positions()):
            self.pool.give(got)
            return None
        grant = Grant(action_id, Placement(service, got), (), True)
        self._touch(grant.placement, nbytes, now)
        self.running[action_id] = grant
        self.busy.update(dict.fromkeys(got.positions(), action_id))
        return grant

    def release(self, action_id: str, now: float, *, resident: bool = True) -> Grant:
        """End an action; ``resident=False`` when its restore failed (nothing stays cached)."""
        grant = self.running.pop(action_id)
        for d in grant.placement.chunk.positions():
            del self.busy[d]
        self.pool.give(grant.placement.chunk)
        if resident:
            self._touch(grant.placement, self.cached[grant.placement].nbytes, now)
        else:
            self.cached.pop(grant.placement, None)
        return grant

    def remeasure(self, placement: Placement, nbytes: int) -> int:
        """Record that ``placement`` holds ``nbytes`` on each of its devices (a run showed it:
        it only grows); returns by how many bytes the fullest of them is over its budget now
        (0: none is)."""
        entry = self.cached[placement]
        entry.nbytes = max(entry.nbytes, nbytes)
        return max(0, *(self.used(d) - self.budgets[d] for d in placement.chunk.positions()))

    def _check(self, action_id: str, units: int, nbytes: int, chunk: Chunk | None) -> None:
        if action_id in self.running:
            raise InternalError(f"action {action_id} already holds a chunk")
        if chunk is not None and chunk.level != units_level(units):
            raise InvalidRequest(f"chunk {chunk} does not serve {units} units")
        if nbytes > max(self.budgets):
            raise InvalidRequest(
                f"{nbytes} bytes per device exceed every device budget",
                hint="use a variant with a higher DoP or a larger device",
            )

    def _take(self, service: str, level: int, nbytes: int, chunk: Chunk | None) -> Chunk | None:
        if chunk is not None:
            got = chunk if self.pool.take_exact(chunk) else None
        else:
            got = self.pool.take(level, self._preference(service, CHUNK_SIZES[level], nbytes))
        if got is not None and nbytes > min(self.budgets[d] for d in got.positions()):
            self.pool.give(got)
            raise InvalidRequest(f"{nbytes} bytes per device exceed the budget of {got}")
        return got

    def _preference(
        self, service: str, size: int, nbytes: int
    ) -> Callable[[Chunk], tuple[float, ...]]:
        """Chunks caching the service first (§5.3), then those with room, then the most room."""

        def key(c: Chunk) -> tuple[float, ...]:
            caching = sum(1 for p in self.cached if p.service == service and _fits(p, c, size))
            room = min(self.budgets[d] - self.used(d) for d in c.positions())
            return (caching, room >= nbytes, room, -c.start)

        return key

    def _make_room(self, chunk: Chunk, nbytes: int, target: Placement) -> tuple[Placement, ...]:
        evicted: list[Placement] = []
        for d in chunk.positions():
            while self.used(d) + nbytes > self.budgets[d]:
                victim = min(
                    (p for p in self.cached if d in p.chunk.positions() and p != target),
                    key=lambda p: (self.cached[p].last_used, self.cached[p].seq),
                )
                if any(g.placement == victim for g in self.running.values()):
                    raise InternalError(f"cannot evict {victim}: it is in use")
                del self.cached[victim]
                evicted.append(victim)
        return tuple(evicted)

    def _touch(self, placement: Placement, nbytes: int, now: float) -> None:
        self._seq += 1
        entry = self.cached.get(placement)
        if entry is None:
            self.cached[placement] = Cached(nbytes, now, self._seq)
        else:
            entry.last_used, entry.seq = now, self._seq
            entry.nbytes = max(entry.nbytes, nbytes)


def _fits(p: Placement, c: Chunk, size: int) -> bool:
    return p.chunk.size == size and c.holds(p.chunk)


def snapshot(r: Residency) -> dict[str, list[tuple[int, int]]]:
    """Service -> resident chunks as (start, size): what the agent reports to the scheduler."""
    out: dict[str, list[tuple[int, int]]] = {}
    for p in sorted(r.cached, key=lambda p: (p.service, p.chunk)):
        out.setdefault(p.service, []).append((p.chunk.start, p.chunk.size))
    return out
