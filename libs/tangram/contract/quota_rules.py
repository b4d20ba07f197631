"""The rules an http call or a lease must meet under its quota, beyond what decoding checks.

One copy, applied where the request is accepted and again where it is carried out: the gateway
refuses a request that breaks one before it is durable (no quota unit is ever spent on it); the
scheduler's limiter applies :func:`check_fits` when it grants, the quota_manager
:func:`check_headers` before it sends (its headers then carry the API key it added). The URL's
rule is :func:`tangram.contract.hosts.check_url`. All pure; a broken rule raises
``InvalidRequest`` (``invalid_request`` on the wire).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from tangram.contract.hosts import BAD_CHARS

if TYPE_CHECKING:
    from tangram.contract.resources import QuotaSpec
    from tangram.errors import InvalidRequest

MAX_HEADERS: Final = 64
MAX_HEADER_BYTES: Final = 16 * 1024

# Headers the quota_manager owns: framing, routing and proxy credentials.
RESERVED_HEADERS: Final = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "te",
        "trailer",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
    }
)
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse too many or too large headers, bad names/values and the ones the shell owns."""
    if len(headers) > MAX_HEADERS:
        raise _refused(f"too many headers ({len(headers)} > {MAX_HEADERS})")
    size = sum(len(k) + len(v) + 4 for k, v in headers.items())
    if size > MAX_HEADER_BYTES:
        raise _refused(f"headers too large ({size} > {MAX_HEADER_BYTES} bytes)")
    for name, value in headers.items():
        if not _TOKEN.match(name) or BAD_CHARS.search(value) or not value.isascii():
            raise _refused(f"bad header {name[:64]!r}: invalid name or value")
        if name.lower() in RESERVED_HEADERS:
            raise _refused(f"header {name!r} is set by tangram, not by the caller")


def window_capacity(limit: float) -> float:
    """The most units one grant may take of a request window declared as ``limit`` per span.

    The limiter counts sends in sliding windows: no span may hold more than ``limit``, so a
    grant of more units than that could never be made (``per_second=2.5`` admits 2 units at
    once, not 3). Below one per span the window stretches instead (one send per
    ``span / limit``), so it still admits one unit."""
    return max(limit, 1.0)


def check_fits(quota: QuotaSpec, units: int, tokens: int) -> None:
    """Refuse a grant of ``units`` requests and ``tokens`` reserved tokens that no moment could
    ever satisfy under ``quota``: over one of its limits on its own (the AIMD factor aside:
    an empty window always admits a grant that fits its declared limit)."""
    if units < 1 or tokens < 0:
        raise _refused(f"units must be >= 1 and tokens >= 0 (got {units}, {tokens})")
    asks = [(field, window_capacity(n), units) for field, n, _ in quota.windows()]
    if quota.concurrency is not None:
        asks.append(("concurrency", quota.concurrency, units))
    if quota.tokens_per_minute is not None:
        asks.append(("tokens_per_minute", quota.tokens_per_minute, tokens))
    for field, limit, amount in asks:
        if amount > limit:
            declared = quota.limits()[field]
            raise _refused(
                f"quota {quota.name!r}: {amount} exceeds {field}={declared:g}",
                hint="a single call or lease can never be granted more than the limit",
            )


def _refused(message: str, *, hint: str = "") -> InvalidRequest:
    # errors imports the contract: imported at call time to keep the import graph a tree
    from tangram.errors import InvalidRequest

    return InvalidRequest(message, hint=hint)
