"""Host entries of a quota's allow-list: ``host`` or ``host:port``, parsed and normalised.

A hostname is lowercase ASCII LDH labels (IDNs must be listed in their ``xn--`` form); an
IPv4 literal is written as is; an IPv6 literal in brackets (``[::1]:8080``). No wildcards:
every host a quota may reach is listed.
"""

from __future__ import annotations

import ipaddress
import re
from typing import TYPE_CHECKING, Final, NamedTuple
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from tangram.errors import InvalidRequest

MAX_URL_BYTES: Final = 8 * 1024
DEFAULT_PORTS: Final = {"http": 80, "https": 443}
BAD_CHARS: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # control characters but tab
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")
_MAX_HOST = 253


class HostPort(NamedTuple):
    """A parsed entry: ``port`` is None when the entry names no port."""

    host: str
    port: int | None


def parse_port(text: str) -> int:
    """A TCP port 1..65535 written in decimal, or ValueError."""
    if not text.isdigit() or len(text) > 5 or not 1 <= int(text) <= 65535:
        raise ValueError(f"bad port {text!r}")
    return int(text)


def normalise_host(host: str) -> str:
    """``host`` lowercased, without a trailing dot, or ValueError if it is no valid host."""
    host = host.lower().removesuffix(".")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError(f"bad IPv6 literal {host!r}")
        return f"[{ipaddress.IPv6Address(host[1:-1]).compressed}]"
    if not host or len(host) > _MAX_HOST or not all(map(_LABEL.match, host.split("."))):
        raise ValueError(f"bad hostname {host!r}")
    return host


def parse_entry(entry: str) -> HostPort:
    """Parse an allow-list entry ``host`` / ``host:port`` / ``[v6]:port``, or ValueError."""
    if entry.startswith("["):
        host, sep, rest = entry.partition("]")
        if rest and not rest.startswith(":"):
            raise ValueError(f"bad host entry {entry!r}")
        return HostPort(normalise_host(host + sep), parse_port(rest[1:]) if rest else None)
    host, sep, port_text = entry.partition(":")
    port = parse_port(port_text) if sep else None
    return HostPort(normalise_host(host), port)


# --------------------------------------------------------------------------- URLs


class Target(NamedTuple):
    """A URL that passed :func:`check_url`: its scheme, normalised host and effective port."""

    url: str
    scheme: str
    host: str
    port: int


def check_url(url: str, hosts: tuple[str, ...], *, quota: str = "") -> Target:
    """``url`` if a quota allowing ``hosts`` may reach it, else InvalidRequest saying why.

    The one rule, applied by the gateway before an action is durable and by the quota_manager
    before every hop: scheme ``http``/``https`` only; the host listed *exactly* (no subdomains,
    no wildcards; an entry without a port admits the scheme's default port only); no
    userinfo, escapes or backslashes in the authority; ASCII, bounded, no control characters.
    """
    if len(url.encode()) > MAX_URL_BYTES or not url.isascii() or BAD_CHARS.search(url):
        raise _refused("url refused: too long, non-ASCII or with control characters")
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise _refused(f"url refused: {url[:256]!r} is not a valid URL ({exc})") from exc
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise _refused(f"url refused: scheme {scheme or '(none)'!r} is not http or https")
    netloc = parts.netloc
    if "@" in netloc or "%" in netloc or "\\" in url.split("?")[0]:
        raise _refused(
            "url refused: userinfo, escapes or backslashes in the authority"
            " (no credentials in URLs)",
            hint="give credentials through the quota's api_key_env",
        )
    host, port = _authority(netloc, scheme)
    if not allowed(host, port, scheme, hosts):
        who = f"quota {quota!r}" if quota else "this quota"
        listed = ", ".join(hosts) or "none"
        raise _refused(
            f"url refused: host {host}:{port} is not in {who}'s hosts ({listed})",
            hint="add it to the quota's hosts (exact host, or host:port)",
        )
    return Target(url, scheme, host, port)


def allowed(host: str, port: int, scheme: str, hosts: tuple[str, ...]) -> bool:
    """Whether ``host:port`` is listed in ``hosts`` (an entry without a port: the default)."""
    for entry in hosts:
        allowed_host, allowed_port = parse_entry(entry)
        if allowed_host == host and (allowed_port or DEFAULT_PORTS[scheme]) == port:
            return True
    return False


def _authority(netloc: str, scheme: str) -> tuple[str, int]:
    if netloc.startswith("["):
        raw_host, _, rest = netloc.partition("]")
        raw_host += "]"
        port_text = rest[1:] if rest.startswith(":") else ("" if not rest else "x")
    else:
        raw_host, _, port_text = netloc.partition(":")
    try:
        host = normalise_host(raw_host)
        port = parse_port(port_text) if port_text else DEFAULT_PORTS[scheme]
    except ValueError as exc:
        raise _refused(
            f"url refused: not a valid URL: bad host or port in {netloc[:256]!r}"
        ) from exc
    return host, port


def _refused(message: str, *, hint: str = "") -> InvalidRequest:
    # errors imports the contract: imported at call time to keep the import graph a tree
    from tangram.errors import InvalidRequest

    return InvalidRequest(message, hint=hint)
