"""The quota core's rebuild from Postgres at scheduler start.

What is persisted, and so survives a restart: the quota specs (``quotas``, written by the
gateway); every grant of an http call (its ``running`` transition in ``action_events``, one per
attempt, at the grant time); every lease (its ``succeeded`` result, carrying the ``LeaseGrant``).
From these the windows are rebuilt over the last day (the longest window): no limit is exceeded
across a restart. What is not persisted: the true-up of tokens (the rebuilt token window counts
the reservations), a lease's release (a lease granted before the restart holds its units again
until its TTL runs out; a ``ReleaseLease`` after the restart frees it as usual), and the learned
AIMD factor and pause (a quota restarts from its declared rates and learns again from the next
429). Calls in flight (``running`` http actions) and live leases hold their unit until their
agent reports (or the lease ends) and count in the windows until then, besides their rebuilt grant
(when they were sent is unknown: counted twice for one window, never too little).
"""

from __future__ import annotations

import asyncpg

from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.quota_books import ask_of
from tangram.contract import ActionResult, QuotaSpec, UnifiedAction, codec

HISTORY_S = 86_400.0  # the longest window (per_day)

_HISTORY = """
SELECT a.spec, e.at FROM action_events e JOIN actions a USING (action_id)
WHERE a.kind IN ('http', 'lease') AND e.at > $1
  AND e.status = CASE a.kind WHEN 'http' THEN 'running' ELSE 'succeeded' END
ORDER BY e.at
"""

_LEASES = """
SELECT result FROM actions
WHERE kind = 'lease' AND status = 'succeeded' AND finished_at > $1 AND result IS NOT NULL
"""


async def load_quotas(pool: asyncpg.Pool) -> list[QuotaSpec]:
    rows = await pool.fetch("SELECT spec FROM quotas ORDER BY name")
    return [codec.decode(r["spec"], QuotaSpec) for r in rows]


async def rebuild(pool: asyncpg.Pool, core: QuotaCore, now: float) -> None:
    """Quotas, the grants of the last day (oldest first) and the leases still live."""
    for spec in await load_quotas(pool):
        core.set_quota(spec, now)
    for row in await pool.fetch(_HISTORY, now - HISTORY_S):
        ask = ask_of(codec.decode(row["spec"], UnifiedAction))
        if ask is not None:
            core.record(ask.quota, ask.units, ask.tokens, float(row["at"]))
    for row in await pool.fetch(_LEASES, now - HISTORY_S):
        result = codec.decode(row["result"], ActionResult)
        if result.lease is not None:
            core.restore_lease(result.lease, now)
