"""Host entries of a quota's allow-list: ``host`` or ``host:port``, parsed and normalised.

A hostname is lowercase ASCII LDH labels (IDNs must be listed in their ``xn--`` form); an
IPv4 literal is written as is; an IPv6 literal in brackets (``[::1]:8080``). No wildcards:
every host a quota may reach is listed.
"""

from __future__ import annotations

import ipaddress
import re
from typing import NamedTuple

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
