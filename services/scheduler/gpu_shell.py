"""The scheduler shell's GPU parts: registrations waiting for their answer (``ServiceSettled``
from the core), the registered services in Postgres (the gateway writes them; a restarted
scheduler reads them back), and prefetch hints: after a pass, each GPU node is told which
services the queued calls it is likely to get will need (``plan_prefetch``, pure), so it can
promote them disk -> host -> device before they are granted (plexrl §4.5.1)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import asyncpg

from services.scheduler.core import gpu
from services.scheduler.core.effects import ServiceSettled
from services.scheduler.core.gpu_share import service_of
from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import Services, ServiceSpec, codec
from tangram.contract.state import Prefetch, PrefetchItem
from tangram.errors import InvalidRequest, TangramError

if TYPE_CHECKING:
    from services.scheduler.core.books import Node
    from services.scheduler.core.scheduler import SchedulerCore

log = logging.getLogger(__name__)

PREFETCH_SCAN = 64  # queued calls a plan looks at (the oldest): a pass's cost stays bounded
PREFETCH_EVERY_S = 0.05  # at most one plan per this: a pass under a backlog stays cheap
PREFETCH_PER_NODE = 8  # services hinted to one node at once


class Registrations:
    """Callers waiting for a registration's answer, by service name."""

    def __init__(self) -> None:
        self._waiting: dict[str, list[asyncio.Future[Services]]] = {}

    def wait(self, name: str) -> asyncio.Future[Services]:
        """A future for the next answer about ``name`` (call before the core registers it)."""
        fut: asyncio.Future[Services] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(name, []).append(fut)
        return fut

    def settle(self, e: ServiceSettled) -> None:
        """Answer every caller waiting for ``e.name``: its state, or why no node prepared it."""
        for fut in self._waiting.pop(e.name, []):
            if fut.done():
                continue
            if e.error:
                fut.set_exception(InvalidRequest(e.error))
            else:
                fut.set_result(Services(services=(e.state,)))


async def load_services(pool: asyncpg.Pool) -> list[ServiceSpec]:
    """Every registered service (its latest spec)."""
    rows = await pool.fetch("SELECT spec FROM services ORDER BY name")
    return [codec.decode(r["spec"], ServiceSpec) for r in rows]


Plan = dict[str, tuple[tuple[str, int], ...]]  # node -> (service, dop), most urgent first


def plan_prefetch(core: SchedulerCore) -> Plan:
    """For the services of the oldest queued GPU calls, in order of their first call: the node
    each is likely to go to (none if a node holds it on a device already: placement sends it
    there; else, as placement does, the node with the most free GPUs that prepared it) and its
    smallest variant there. Costs one look per distinct service, not per call."""
    names = dict.fromkeys(
        service_of(act)
        for aid in core.pending.gpu()[:PREFETCH_SCAN]
        if (act := core.queue.get(aid)) is not None
    )
    live = [n for n in core.nodes.values() if n.gpu is not None and not n.draining]
    plan: dict[str, list[tuple[str, int]]] = {}
    for name in names:
        spec = core.gpu.services.get(name)
        where = _likely_node(spec, live) if spec is not None else None
        if where is not None and len(wants := plan.setdefault(where[0], [])) < PREFETCH_PER_NODE:
            wants.append((name, where[1]))
    return {node: tuple(wants) for node, wants in plan.items()}


def _likely_node(spec: ServiceSpec, live: list[Node]) -> tuple[str, int] | None:
    best: tuple[int, str, int] | None = None
    for node in live:
        assert node.gpu is not None
        dops = gpu.ready_dops(node.gpu, spec.name, spec.dops)
        if not dops:
            continue
        if gpu.resident_positions(node.gpu, spec.name, dops[0]):
            return None  # resident there: nothing to move
        if best is None or len(node.free) > best[0]:
            best = (len(node.free), node.node_id, dops[0])
    return None if best is None else (best[1], best[2])


class PrefetchHints:
    """Sends each GPU node its hint when it changed since the last one sent; plans at most
    every ``PREFETCH_EVERY_S`` (a hint is advice: that much late is still ahead of a grant)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.sent: Plan = {}
        self.clock = clock
        self._next_at = 0.0

    async def after_pass(self, bus: BaseBus, core: SchedulerCore, epoch: int) -> None:
        if not core.gpu.services:  # no model services: nothing to plan (the hot path)
            return
        now = self.clock()
        if now < self._next_at:
            return
        self._next_at = now + PREFETCH_EVERY_S
        sent: Plan = {}
        for node_id, wants in plan_prefetch(core).items():
            if self.sent.get(node_id) != wants:
                items = tuple(PrefetchItem(name=n, dop=d) for n, d in wants)
                hint = Prefetch(services=items, epoch=epoch)
                try:
                    await bus.publish(subjects.prefetch(node_id), hint)
                except TangramError as exc:  # tried again at the next pass
                    log.info("prefetch hint to %s not sent: %s", node_id, exc)
                    continue
            sent[node_id] = wants
        self.sent = sent
