"""Formulate http and lease actions against the declared quotas, or say exactly what is wrong.

Pure: the quota specs are passed in. An http action costs one unit of ``quota:NAME``, a lease its
``units``; neither needs an environment. The checks here are the first of two, by the contract's
rules, so a request that breaks one is refused before it is durable and before it spends a unit:
the demand fits the quota's limits (``check_fits``, which the scheduler's limiter applies too);
the URL's scheme is http or https and its host (and port: an entry without one admits only the
scheme's default port) listed exactly in the quota's ``hosts``; the headers are within their caps
and set none the quota_manager owns (``check_headers``). The quota_manager checks the URL and the
headers again, after DNS and on every redirect.
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
    check_fits,
    check_headers,
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
        check_headers(act.headers)
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
