"""Formulate http and lease actions against the declared quotas, or say exactly what is wrong.

Pure: the quota specs are passed in. An http action costs one unit of ``quota:NAME``, a lease its
``units``; neither needs an environment. The URL check here is the first of two: scheme http or
https, and the host (and port: an entry without one admits only the scheme's default port)
listed exactly in the quota's ``hosts``. The quota_manager checks again, after DNS and on every
redirect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from tangram.contract import (
    ActionSpec,
    Demand,
    HttpAction,
    LeaseAction,
    QuotaSpec,
    UnifiedAction,
)
from tangram.contract.hosts import normalise_host, parse_entry, parse_port
from tangram.errors import InvalidRequest

DEFAULT_PORTS: Final = {"http": 80, "https": 443}


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
        check_url(act.url, quota)
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


def check_url(url: str, quota: QuotaSpec) -> None:
    """Refuse a URL whose scheme is not http/https or whose host:port the quota does not list."""
    scheme = url.partition(":")[0].lower() if "://" in url else ""
    if scheme not in DEFAULT_PORTS:
        raise InvalidRequest(f"url refused: scheme {scheme or '(none)'!r} is not http or https")
    try:
        parts = urlsplit(url)
        raw = parts.hostname or ""
        host = normalise_host(f"[{raw}]" if ":" in raw else raw)  # urlsplit drops the brackets
        port = parts.port
    except ValueError as exc:
        raise InvalidRequest(f"url refused: {url[:256]!r} is not a valid URL ({exc})") from exc
    if parts.username is not None or parts.password is not None:
        raise InvalidRequest("url refused: credentials in the URL (use the quota's api_key_env)")
    port = DEFAULT_PORTS[scheme] if port is None else parse_port(str(port))
    for entry in quota.hosts:
        allowed_host, allowed_port = parse_entry(entry)
        if allowed_host == host and (allowed_port or DEFAULT_PORTS[scheme]) == port:
            return
    listed = ", ".join(quota.hosts) or "none"
    raise InvalidRequest(
        f"url refused: host {host}:{port} is not in quota {quota.name!r}'s hosts ({listed})",
        hint="add it to the quota's hosts (exact host, or host:port)",
    )
