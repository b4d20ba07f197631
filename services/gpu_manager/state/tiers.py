"""Which tensors live in host memory and on disk, and what must move: the StateManager's core.

Pure and synchronous (the shell in ``manager.py`` does the I/O and holds the lock). Tensors are
known by their logical key (a content hash, ``keys.py``); a service references a set of keys,
so a tensor shared by several services (DoP variants, fine-tunes of one base) is one entry in
each tier. Rules:

- a tier never holds more than its budget (``0``: unbounded);
- with the disk tier on, a key enters host memory only once it is on disk, so evicting it from
  the host never loses it (a copy below; device arenas are copies of the host's);
- a key pinned (a restore is reading it) is never evicted; nor is one the current plan needs;
- eviction is least recently used first; host keys no service references go before any other;
- disk keeps every referenced key; unreferenced ones (an old spec, a restart's leftovers) are
  dropped, oldest first, only when room is needed.

A plan that cannot fit raises :class:`TierFull`: the caller refuses (a demand) or skips (a
prefetch) -- it never exceeds a budget.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from tangram.errors import InvalidRequest


class TierFull(InvalidRequest):
    """The keys a plan needs do not fit the tier's budget beside what cannot be evicted."""


@dataclass(frozen=True, slots=True)
class Promotion:
    """Free ``evict`` from host memory, then load ``load`` from disk (in that order)."""

    evict: tuple[str, ...]
    load: tuple[str, ...]


@dataclass
class Tier:
    """One tier's keys in use order (oldest first) and its budget in bytes (0: unbounded)."""

    budget: int
    keys: dict[str, None] = field(default_factory=dict)  # insertion order = LRU order
    used: int = 0

    def holds(self, key: str) -> bool:
        return key in self.keys

    def add(self, key: str, nbytes: int) -> None:
        if key not in self.keys:
            self.used += nbytes
        self.keys.pop(key, None)
        self.keys[key] = None

    def remove(self, key: str, nbytes: int) -> None:
        if self.keys.pop(key, 0) is None:
            self.used -= nbytes

    def touch(self, key: str) -> None:
        if key in self.keys:
            self.keys[key] = self.keys.pop(key)

    def room(self, nbytes: int) -> int:
        """Bytes to free before ``nbytes`` more fit (0: they fit)."""
        return 0 if self.budget <= 0 else max(0, self.used + nbytes - self.budget)


@dataclass
class Tiers:
    """Host and disk residency of every key, and the services referencing them."""

    host: Tier
    disk: Tier | None  # None: no disk tier, host memory is the bottom
    sizes: dict[str, int] = field(default_factory=dict)
    refs: dict[str, frozenset[str]] = field(default_factory=dict)  # service -> keys
    pins: Counter[str] = field(default_factory=Counter)

    # ------------------------------------------------------------------ services

    def referenced(self) -> set[str]:
        return set().union(*self.refs.values()) if self.refs else set()

    def reference(self, service: str, sizes: Mapping[str, int]) -> None:
        """``service`` (re)defined as these keys: an older definition's keys lose its reference."""
        self.sizes.update(sizes)
        self.refs[service] = frozenset(sizes)

    def forget(self, service: str) -> tuple[str, ...]:
        """Drop ``service``; returns the host keys nobody references now (the caller frees them;
        disk keeps them until room is needed)."""
        self.refs.pop(service, None)
        live = self.referenced()
        gone = tuple(k for k in self.host.keys if k not in live and not self.pins[k])
        for k in gone:
            self.host.remove(k, self.sizes[k])
        return gone

    def missing_host(self, service: str) -> tuple[str, ...]:
        """The keys of ``service`` not in host memory now."""
        return tuple(k for k in self.refs.get(service, ()) if not self.host.holds(k))

    # ------------------------------------------------------------------ disk

    def admit_disk(self, keys: Iterable[str]) -> tuple[str, ...]:
        """Plan writing ``keys`` (those not on disk yet): returns the unreferenced disk keys to
        delete first. Raises TierFull if the referenced keys alone exceed the disk budget."""
        assert self.disk is not None, "no disk tier"
        new = [k for k in dict.fromkeys(keys) if not self.disk.holds(k)]
        need = self.disk.room(sum(self.sizes[k] for k in new))
        live = self.referenced()
        victims = _victims(
            self.disk, need, self.sizes, lambda k: k not in live and k not in self.host.keys
        )
        if victims is None:
            raise TierFull(
                f"disk tier full: {need} more bytes needed and every key on disk is in use",
                hint="raise TANGRAM_GPU_DISK_BUDGET_MB or register fewer services",
            )
        for k in victims:
            self.disk.remove(k, self.sizes[k])
        return victims

    def on_disk(self, key: str) -> None:
        """``key`` is on disk now (written and renamed; or found at start)."""
        assert self.disk is not None, "no disk tier"
        self.disk.add(key, self.sizes[key])

    # ------------------------------------------------------------------ host

    def promote(self, service: str, keep: Iterable[str] = ()) -> Promotion:
        """Plan bringing every key of ``service`` into host memory without exceeding its budget:
        evict (least recently used, unreferenced first; never pinned, never ``keep`` or the
        service's own keys, never one without a copy on disk). The planned keys count as held
        from now (``loaded`` confirms, ``abandon`` undoes). Raises TierFull if they cannot fit."""
        load = self.missing_host(service)
        need = self.host.room(sum(self.sizes[k] for k in load))
        protected = set(self.refs.get(service, ())) | set(keep)
        live = self.referenced()

        def evictable(k: str) -> bool:
            below = self.disk is not None and self.disk.holds(k)
            return k not in protected and not self.pins[k] and below

        victims = _victims(self.host, need, self.sizes, evictable, last=lambda k: k in live)
        if victims is None:
            raise TierFull(
                f"host tier full: service {service!r} needs {need} more bytes and nothing "
                "evictable is left (in use, or no copy on disk)",
                hint="raise TANGRAM_GPU_HOST_BUDGET_MB, or turn the disk tier on",
            )
        for k in victims:
            self.host.remove(k, self.sizes[k])
        for k in load:
            self.host.add(k, self.sizes[k])
        self.touch(service)
        return Promotion(victims, load)

    def abandon(self, keys: Iterable[str]) -> None:
        """Loads that failed: their room is free again."""
        for k in keys:
            self.host.remove(k, self.sizes[k])

    def touch(self, service: str) -> None:
        for k in self.refs.get(service, ()):
            self.host.touch(k)
            if self.disk is not None:
                self.disk.touch(k)

    def pin(self, service: str) -> frozenset[str]:
        """Pin the keys of ``service`` (a restore reads them); returns them for ``unpin``."""
        keys = self.refs.get(service, frozenset())
        self.pins.update(keys)
        return keys

    def unpin(self, keys: Iterable[str]) -> None:
        self.pins.subtract(keys)
        self.pins = +self.pins  # drop the zeros

    # ------------------------------------------------------------------ facts

    def violations(self) -> list[str]:
        """Broken invariants (empty: none); the tests check it after every step."""
        out: list[str] = []
        for name, tier in (("host", self.host), ("disk", self.disk)):
            if tier is None:
                continue
            if tier.budget > 0 and tier.used > tier.budget:
                out.append(f"{name} holds {tier.used} > budget {tier.budget}")
            if tier.used != sum(self.sizes[k] for k in tier.keys):
                out.append(f"{name} books {tier.used} bytes, its keys hold another amount")
        if self.disk is not None:
            below = self.disk.keys
            out += [f"host key {k} has no copy on disk" for k in self.host.keys if k not in below]
        return out


def _victims(
    tier: Tier,
    need: int,
    sizes: Mapping[str, int],
    evictable: Callable[[str], bool],
    last: Callable[[str], bool] = lambda _: False,
) -> tuple[str, ...] | None:
    """The least recently used evictable keys freeing ``need`` bytes (those ``last`` says go
    after the others); None if the evictable ones cannot free that much."""
    if need <= 0:
        return ()
    order = sorted((k for k in tier.keys if evictable(k)), key=last)  # stable: LRU kept
    out: list[str] = []
    freed = 0
    for k in order:
        if freed >= need:
            break
        out.append(k)
        freed += sizes[k]
    return tuple(out) if freed >= need else None
