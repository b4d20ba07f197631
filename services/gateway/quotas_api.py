"""Quotas at the gateway: declare one (durable first, then the scheduler's limiter takes it),
list them as the scheduler sees them, release a lease, and the cache of specs that http and
lease actions are formulated against.

The cache is loaded at start and updated on every SetQuota this gateway serves; another
gateway's SetQuota is picked up by a reload (at most once a second) when the cache refuses an
http or lease action (a quota it does not know, a host or a limit its cached spec does not
allow): the action is formulated once, and once more only after such a reload.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import asyncpg

from services.gateway import services_api
from services.gateway.quota_formulation import quota_of
from tangram import subjects
from tangram.bus import BaseBus
from tangram.contract import (
    ActionSpec,
    Done,
    LeaseEnd,
    QuotaCmd,
    Quotas,
    QuotaSpec,
    ReleaseLease,
    UnifiedAction,
    checked_quota,
    codec,
    encode,
)
from tangram.errors import InvalidRequest

FORWARD_TIMEOUT_S = 5.0
RELOAD_EVERY_S = 1.0

_UPSERT = """
INSERT INTO quotas (name, spec) VALUES ($1, $2)
ON CONFLICT (name) DO UPDATE SET spec = excluded.spec, updated_at = now()
"""


class QuotaBook:
    """The declared quotas, as this gateway last read or wrote them."""

    def __init__(self, pool: asyncpg.Pool, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.clock = clock
        self.specs: dict[str, QuotaSpec] = {}
        self._loaded_at = -RELOAD_EVERY_S

    async def load(self) -> None:
        rows = await self.pool.fetch("SELECT spec FROM quotas")
        self.specs = {s.name: s for s in (codec.decode(r["spec"], QuotaSpec) for r in rows)}
        self._loaded_at = self.clock()

    async def formulated(
        self, spec: ActionSpec, build: Callable[[Mapping[str, QuotaSpec]], UnifiedAction]
    ) -> UnifiedAction:
        """``build(specs)``: the unified action of ``spec`` formulated against the cached
        specs; if they refuse an http or lease action, once more after a reload (another
        gateway may have declared or widened its quota since)."""
        try:
            return build(self.specs)
        except InvalidRequest:
            if quota_of(spec) is None or self.clock() - self._loaded_at < RELOAD_EVERY_S:
                raise
        await self.load()
        return build(self.specs)

    async def set(self, bus: BaseBus, spec: QuotaSpec) -> Done:
        """Validate, make durable, cache, and hand to the scheduler's limiter."""
        spec = checked_quota(spec)
        await self.pool.execute(_UPSERT, spec.name, encode(spec))
        self.specs[spec.name] = spec
        await bus.request(subjects.SCHED_ACTIONS, QuotaCmd(spec=spec), timeout=FORWARD_TIMEOUT_S)
        return Done(detail=f"quota {spec.name!r} set")


async def list_quotas(bus: BaseBus) -> Quotas:
    """Every quota with what the scheduler's limiter learned (rate, use, queue, 429s)."""
    return Quotas(quotas=(await services_api.resources(bus)).quotas)


async def release_lease(bus: BaseBus, req: ReleaseLease) -> Done:
    """End a lease (an unknown or expired one: nothing to do), feeding its report."""
    end = LeaseEnd(
        lease_id=req.lease_id,
        tokens_used=req.tokens_used,
        status=req.status,
        retry_after_s=req.retry_after_s,
    )
    await bus.request(subjects.SCHED_ACTIONS, end, timeout=FORWARD_TIMEOUT_S)
    return Done()
