"""The StateManager: the node's one authority over where model state lives (plexrl §4.5).

Device arenas stay the residency core's (``residency.py``); this owns the tiers below them:
host memory (keyed tensors, a budget) and disk (``disk.py``, optional). Decisions are the pure
``Tiers``; this shell holds the tensors, does the I/O and is thread-safe: every method is
blocking and runs in a worker thread (prepare, a device's runner, a prefetch), never on the
event loop. Moves that evict or load run one at a time (``_io``: the disk is one device anyway);
the book is behind a short lock, so a restore reading pinned keys never waits on a load.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import torch

from services.gpu_manager.state.copy import Captured, StoredCopy, capture
from services.gpu_manager.state.disk import DiskStore
from services.gpu_manager.state.tiers import Tier, TierFull, Tiers

log = logging.getLogger(__name__)

MB = 1 << 20
WAIT_S = 30.0  # a restore waits this long for others to unpin what it must evict


class StateConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``disk_dir`` empty: no disk tier (host memory is the bottom); budgets in MB, 0 unbounded."""

    host_budget_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    disk_dir: str = ""
    disk_budget_mb: Annotated[int, msgspec.Meta(ge=0)] = 0
    verify_on_start: bool = False  # hash every stored file at start (slow; lengths always)
    pin: bool | None = None  # pinned host memory; None: when CUDA is present


@dataclass(frozen=True, slots=True)
class Held:
    """Keys pinned for a restore, and whether the service was all in host memory already."""

    keys: frozenset[str]
    was_host: bool


class StateReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """The tiers now: bytes held and budgets, and what dedupe saves."""

    host_bytes: int = 0
    host_budget: int = 0
    disk_bytes: int = 0
    disk_budget: int = 0
    logical_bytes: int = 0  # the services' state, each counted whole
    stored_bytes: int = 0  # their distinct tensors, each once
    promotions: int = 0  # disk -> host loads of a service
    loaded_bytes: int = 0


class StateManager:
    """Host and disk tiers of one node (see the module docstring)."""

    def __init__(self, cfg: StateConfig) -> None:
        self.cfg = cfg
        disk = Tier(cfg.disk_budget_mb * MB) if cfg.disk_dir else None
        self.tiers = Tiers(Tier(cfg.host_budget_mb * MB), disk)
        self.disk = DiskStore(Path(cfg.disk_dir)) if cfg.disk_dir else None
        self.host: dict[str, torch.Tensor] = {}
        self.pin_memory = torch.cuda.is_available() if cfg.pin is None else cfg.pin
        self.promotions = 0
        self.loaded_bytes = 0
        self._lock = threading.Lock()  # the book and ``host``: short sections only
        self._io = threading.Lock()  # moves that evict or load, one at a time
        self._unpinned = threading.Condition(self._lock)  # a restore released its pins
        self._released = 0

    def start(self) -> int:
        """Find what the disk holds (deleting unfinished or corrupt files); returns the count.
        Nothing references them yet: they are kept until room is needed, and a service whose
        tensors are there already is not written again."""
        if self.disk is None or self.tiers.disk is None:
            return 0
        found = self.disk.scan(verify=self.cfg.verify_on_start)
        with self._lock:
            self.tiers.sizes.update(found)
            for key in found:
                self.tiers.on_disk(key)
        return len(found)

    # ------------------------------------------------------------------ services

    def capture(self, service: str, model: torch.nn.Module) -> StoredCopy:
        """Take ``model``'s state into the tiers under ``service`` (replacing an older definition
        of that name): written to disk where missing, kept in host memory if it fits (else cold
        on disk). TierFull when it cannot be kept at all; the model is then gone to ``meta``."""
        got = capture(model)
        copy = StoredCopy(got, self.host)
        sizes = copy.sizes()
        with self._io:
            with self._lock:
                self._drop(self.tiers.forget(service))
                self.tiers.reference(service, sizes)
            try:
                self._check_fits(service, sum(sizes.values()))
                self._write(got)
                self._keep(service, got)
            except BaseException:
                with self._lock:
                    self._drop(self.tiers.forget(service))
                raise
        return copy

    def forget(self, service: str) -> None:
        """``service`` is gone: host bytes nobody else references are freed."""
        with self._io, self._lock:
            self._drop(self.tiers.forget(service))

    def _check_fits(self, service: str, nbytes: int) -> None:
        for name, tier in (("host", self.tiers.host), ("disk", self.tiers.disk)):
            if tier is not None and 0 < tier.budget < nbytes:
                raise TierFull(
                    f"service {service!r} holds {nbytes} bytes of state, more than the whole "
                    f"{name} tier ({tier.budget} bytes)",
                    hint=f"raise TANGRAM_GPU_{name.upper()}_BUDGET_MB",
                )

    def _write(self, got: Captured) -> None:
        """Put the keys not on disk yet there (deleting unreferenced files if room is needed)."""
        if self.disk is None:
            return
        with self._lock:
            victims = self.tiers.admit_disk(got.keys)
            todo = {k: d for k, d in zip(got.keys, got.data, strict=True) if not self._on_disk(k)}
        for key in victims:
            self.disk.delete(key)
        for key, data in todo.items():
            self.disk.write(key, data)
            with self._lock:
                self.tiers.on_disk(key)

    def _on_disk(self, key: str) -> bool:
        return self.tiers.disk is not None and self.tiers.disk.holds(key)

    def _keep(self, service: str, got: Captured) -> None:
        """Into host memory from the captured bytes (no read), if they fit; else (disk on)
        the service stays cold until a call or a prefetch promotes it."""
        by_key = dict(zip(got.keys, got.data, strict=True))
        with self._lock:
            try:
                plan = self.tiers.promote(service)
            except TierFull:
                if self.disk is None:
                    raise
                log.info("service %s: host tier full, kept on disk only", service)
                return
            self._drop(plan.evict)
        kept = {k: by_key[k].pin_memory() if self.pin_memory else by_key[k] for k in plan.load}
        with self._lock:
            self.host.update(kept)

    # ------------------------------------------------------------------ moves

    def acquire(self, service: str, wait_s: float = WAIT_S) -> Held:
        """Bring ``service`` into host memory (from disk where needed) and pin it for a
        restore; ``release`` the result after. While other restores pin what it would evict,
        it waits for them (up to ``wait_s``; then TierFull)."""
        deadline = time.monotonic() + wait_s
        while True:
            seen = self._released
            try:
                return self._acquire(service)
            except TierFull:
                if not self._wait_release(seen, deadline):
                    raise

    def _wait_release(self, seen: int, deadline: float) -> bool:
        with self._unpinned:
            while self._released == seen:
                left = deadline - time.monotonic()
                if left <= 0 or not self._unpinned.wait(left):
                    return False
            return True

    def _acquire(self, service: str, keep: Iterable[str] = ()) -> Held:
        with self._io:
            with self._lock:
                was_host = not self.tiers.missing_host(service)
                if was_host:
                    self.tiers.touch(service)
                    return Held(self.tiers.pin(service), True)
            self._promote(service, keep)
            with self._lock:
                return Held(self.tiers.pin(service), False)

    def release(self, held: Held) -> None:
        with self._lock:
            self.tiers.unpin(held.keys)
            self._released += 1
            self._unpinned.notify_all()

    def prefetch(self, service: str, keep: Iterable[str] = ()) -> bool:
        """Promote ``service`` if it fits without evicting pinned keys or those of the services
        ``keep`` names (their calls are queued or running); False if it does not (a hint is
        never an error)."""
        try:
            self.release(self._acquire(service, keep))
        except TierFull as exc:
            log.info("prefetch of %s skipped: %s", service, exc.message)
            return False
        return True

    def in_host(self, service: str) -> bool:
        """Whether every tensor of ``service`` is in host memory now."""
        with self._lock:
            return service in self.tiers.refs and not self.tiers.missing_host(service)

    def _promote(self, service: str, keep: Iterable[str] = ()) -> None:
        """Under ``_io``: plan, evict, read the missing keys from disk, keep them."""
        with self._lock:
            kept = [k for name in keep for k in self.tiers.refs.get(name, ())]
            plan = self.tiers.promote(service, kept)
            self._drop(plan.evict)
            sizes = {k: self.tiers.sizes[k] for k in plan.load}
        if not plan.load:
            return
        assert self.disk is not None, "keys missing from host memory live on disk"
        try:
            loaded = {k: self.disk.read(k, n, pin=self.pin_memory) for k, n in sizes.items()}
        except BaseException:
            with self._lock:
                self.tiers.abandon(plan.load)
            raise
        with self._lock:
            self.host.update(loaded)
        self.promotions += 1
        self.loaded_bytes += sum(sizes.values())

    def _drop(self, keys: tuple[str, ...]) -> None:
        for key in keys:
            self.host.pop(key, None)

    # ------------------------------------------------------------------ facts

    def report(self) -> StateReport:
        with self._lock:
            t = self.tiers
            sizes = t.sizes
            logical = sum(sizes[k] for keys in t.refs.values() for k in keys)
            return StateReport(
                host_bytes=t.host.used,
                host_budget=t.host.budget,
                disk_bytes=t.disk.used if t.disk is not None else 0,
                disk_budget=t.disk.budget if t.disk is not None else 0,
                logical_bytes=logical,
                stored_bytes=sum(sizes[k] for k in t.referenced()),
                promotions=self.promotions,
                loaded_bytes=self.loaded_bytes,
            )

    def violations(self) -> list[str]:
        """Broken invariants, the book's and the held tensors' (empty: none)."""
        with self._lock:
            out = self.tiers.violations()
            if set(self.host) != set(self.tiers.host.keys):
                out.append("host tensors differ from the keys booked in host memory")
            return out
