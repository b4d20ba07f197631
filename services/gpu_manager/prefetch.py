"""Scheduler-directed prefetch (plexrl §4.5.1): the scheduler names the services its next grants
on this node will need, most urgent first; the node promotes them disk -> host and, where a
device has room and no call waits, host -> device, before the calls arrive.

Hints are advice: a newer one replaces the rest of an older one; a service that does not fit
without evicting pinned state is skipped; a failure is logged and counted, never raised. The
services hinted together stop at what the host tier holds beside the services with calls queued
or running here, whose state a prefetch never evicts (nor its own earlier services'). One loop
at a time, owned here and cancelled by ``close``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from services.gpu_manager.catalog import Prepared
from services.gpu_manager.state.manager import StateManager

log = logging.getLogger(__name__)


class Warms(Protocol):
    """What the prefetcher needs of the executor."""

    state: StateManager

    def entry(self, name: str) -> Prepared | None: ...

    def busy(self) -> set[str]:
        """The services whose calls are queued or running here."""
        ...

    async def warm(self, name: str, dop: int) -> bool: ...


class Prefetcher:
    """The node's side of prefetch hints (see the module docstring)."""

    def __init__(self, node: Warms, *, enabled: bool) -> None:
        self.node = node
        self.enabled = enabled
        self.hints = 0  # hints received (counted when disabled too)
        self.host = 0  # services promoted into host memory by a hint
        self.device = 0  # services restored onto a device by a hint
        self.failures = 0
        self._next: list[tuple[str, int]] | None = None
        self._task: asyncio.Task[None] | None = None

    def hint(self, items: Sequence[tuple[str, int]]) -> list[str]:
        """Take a hint; returns the names it gave that are not prepared here (ignored)."""
        self.hints += 1
        unknown = [n for n, _ in items if self._ready(n) is None]
        if not self.enabled:
            return unknown
        self._next = [(n, d) for n, d in items if n not in unknown]
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="prefetch")
        return unknown

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _ready(self, name: str) -> Prepared | None:
        entry = self.node.entry(name)
        return entry if entry is not None and entry.copy is not None and entry.state_id else None

    async def _loop(self) -> None:
        while self._next:
            items, self._next = self._next, None
            busy = {n: e for n in self.node.busy() if (e := self._ready(n)) is not None}
            room = self.node.state.tiers.host.budget or float("inf")
            room -= sum(e.nbytes for n, e in busy.items() if n not in dict(items))
            for name, dop in items:
                entry = self._ready(name)
                if self._next is not None or entry is None:
                    break  # a newer hint, or a spec gone meanwhile
                room -= entry.nbytes
                if room < 0:
                    break  # further ones would evict those hinted before them
                try:
                    await self._one(name, dop, entry, [e.state_id for e in busy.values()])
                except Exception:
                    self.failures += 1
                    log.warning("prefetch of %s failed", name, exc_info=True)

    async def _one(self, name: str, dop: int, entry: Prepared, keep: list[str]) -> None:
        state = self.node.state
        if not state.in_host(entry.state_id):
            if not await asyncio.to_thread(state.prefetch, entry.state_id, keep):
                return
            self.host += 1
        if await self.node.warm(name, dop):
            self.device += 1
