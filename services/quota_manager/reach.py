"""The SSRF guard: which hosts and addresses a quota's HTTP calls may reach, on every hop.

The rule: scheme ``http`` or ``https`` only; the URL's host must be listed in the quota's
``hosts`` *exactly* (no subdomains, no wildcards: ``api.example.com`` does not admit
``x.api.example.com``); an entry without a port admits only the scheme's default port (80/443),
``host:port`` admits exactly that port. An IP literal is reachable only when listed, so
``127.0.0.1`` or ``169.254.169.254`` are refused unless the quota names them. URLs with
userinfo, percent-encoded or non-ASCII hosts are refused rather than interpreted. A redirect
target is checked by the same rule (:func:`tangram.contract.hosts.check_url`, which the gateway
applies too, as it does the header rule :func:`tangram.contract.check_headers`). All pure:
resolving names is the shell's job, which then calls :func:`check_address` so a listed name that
resolves to a private address is refused too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Final
from urllib.parse import urljoin, urlsplit

from tangram.contract.hosts import Target, allowed, check_url
from tangram.errors import InvalidRequest

MAX_REDIRECTS: Final = 5


def check_redirect(location: str, current: str, hosts: tuple[str, ...]) -> Target:
    """The target of a redirect from ``current`` to ``location``, by the same rule; never from
    https down to http (what the request carries would leave in the clear)."""
    target = check_url(urljoin(current, location.strip()), hosts)
    # the scheme as parsed (urlsplit, like yarl, drops leading blanks and tabs), not a prefix
    if urlsplit(current).scheme.lower() == "https" and target.scheme != "https":
        raise InvalidRequest(f"redirect refused: from https down to {target.scheme}")
    return target


# Sent to the first target only: a redirect to another origin (scheme, host, port) drops them,
# as browsers and ``requests`` do, so a key never reaches a host it was not meant for.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "cookie"})


def for_origin(headers: Mapping[str, str], first: Target, target: Target) -> Mapping[str, str]:
    """The headers of a hop to ``target``: all of them on the first target's origin, none of
    the credentials elsewhere."""
    if (target.scheme, target.host, target.port) == (first.scheme, first.host, first.port):
        return headers
    return {k: v for k, v in headers.items() if k.lower() not in CREDENTIAL_HEADERS}


def check_address(target: Target, address: str, hosts: tuple[str, ...]) -> None:
    """Refuse a resolved ``address`` that is private/loopback/link-local, unless listed."""
    ip = ipaddress.ip_address(address)
    if ip.is_global or allowed(_host_of(ip), target.port, target.scheme, hosts):
        return
    raise InvalidRequest(f"url refused: {target.host} resolves to non-public address {address}")


def _host_of(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    return ip.compressed if ip.version == 4 else f"[{ip.compressed}]"
