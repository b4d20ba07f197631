"""Formulate http and lease actions against the declared quotas, or say exactly what is wrong.

Pure: the quota specs are passed in. An http action costs one unit of ``quota:NAME``, a lease its
``units``; neither needs an environment. The URL check here is the first of two: scheme http or
https, and the host (and port: an entry without one admits only the scheme's default port)
listed exactly in the quota's ``hosts``. The quota_manager checks again, after DNS and on every
redirect.
"""

from __future__ import annotations

from collections.abc import Mapping

from tangram.contract import (
    ActionSpec,
    Demand,
    HttpAction,
    LeaseAction,
    QuotaSpec,
    UnifiedAction,
)
from tangram.contract.hosts import check_url
from tangram.errors import InvalidRequest


def resource(quota: str) -> str:
    """The scheduler's resource name of a quota."""
    return f"quota:{quota}"


def quota_of(spec: ActionSpec) -> str | None:
    """The quota an http or lease action spends (None for other kinds)."""
    act = spec.action
    return act.quota if isinstance(act, HttpAction | LeaseAction) else None


def formulate_quota(
    spec: ActionSpec,
    quotas: Mapping[str, QuotaSpec],
    *,
    now: float,
    reply_subject: str = "",
    traceparent: str = "",
) -> UnifiedAction:
    """The unified action of an http or lease ``spec`` under its declared quota."""
    act = spec.action
    if not isinstance(act, HttpAction | LeaseAction):
        raise InvalidRequest("not an http or lease action")
    quota = declared(quotas, act.quota)
    units, tokens = (1, act.tokens) if isinstance(act, HttpAction) else (act.units, act.tokens)
    check_fits(quota, units, tokens)
    if isinstance(act, HttpAction):
        check_url(act.url, quota.hosts, quota=quota.name)
    name = resource(act.quota)
    return UnifiedAction(
        spec=spec,
        demands=(Demand(resource=name, choices=(units,)),),
        key_resource=name,
        env_memory_mb=0,
        submitted_at=now,
        reply_subject=reply_subject,
        traceparent=traceparent,
    )


def declared(quotas: Mapping[str, QuotaSpec], name: str) -> QuotaSpec:
    """The spec of quota ``name``, or InvalidRequest naming the declared ones."""
    quota = quotas.get(name)
    if quota is None:
        known = ", ".join(sorted(quotas)) or "none"
        raise InvalidRequest(
            f"unknown quota {name!r} (declared: {known})", hint="declare it with set_quota"
        )
    return quota


def check_fits(quota: QuotaSpec, units: int, tokens: int) -> None:
    """Refuse a demand no grant could ever satisfy: over a limit on its own."""
    asks = {"concurrency": units, "per_minute": units, "per_day": units}
    asks["tokens_per_minute"] = tokens
    for field, limit in quota.limits().items():
        amount = asks.get(field)  # per_second below one a second still admits one call
        if amount is not None and amount > limit:
            raise InvalidRequest(
                f"quota {quota.name!r}: {amount} exceeds {field}={limit:g}",
                hint="a single call or lease can never be granted more than the limit",
            )
