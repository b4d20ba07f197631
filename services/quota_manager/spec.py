"""``QuotaSpec``: a named quota as the user declares it, validated at decode time.

It travels on the wire (client -> quota_manager) and is stored in Postgres, so it follows the
message rules: ``kw_only`` limits, ``omit_defaults``, unknown fields allowed. ``name`` is the one
positional field (``QuotaSpec("search", per_second=5)``). Weights belong to jobs, not quotas:
the fair queue holds them.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import Meta, Struct

from services.quota_manager.hosts import parse_entry
from tangram.errors import InvalidRequest

MAX_HOSTS: Final = 64

QuotaName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")]
HostEntry = Annotated[
    str, Meta(min_length=1, max_length=262, pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d+)?$")
]
EnvName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Concurrency = Annotated[int, Meta(ge=1, le=1_000_000)]
PerSecond = Annotated[float, Meta(gt=0, le=1_000_000)]
Count = Annotated[int, Meta(ge=1, le=10**12)]


class _Named(Struct, omit_defaults=True):
    name: QuotaName


class QuotaSpec(_Named, kw_only=True, omit_defaults=True):
    """A quota: any of a concurrency limit, request windows and a token window, plus the hosts
    ``client.http`` may reach under it and the env var holding its API key (the name only)."""

    concurrency: Concurrency | None = None
    per_second: PerSecond | None = None
    per_minute: Count | None = None
    per_day: Count | None = None
    tokens_per_minute: Count | None = None
    hosts: Annotated[tuple[HostEntry, ...], Meta(max_length=MAX_HOSTS)] = ()
    api_key_env: EnvName | None = None

    def __post_init__(self) -> None:
        if not self.limits():
            raise ValueError("a quota needs at least one limit (concurrency or a window)")
        self.hosts = tuple(_normalised(h) for h in self.hosts)

    def limits(self) -> dict[str, float]:
        """The limits this quota declares, by field name."""
        values = {
            "concurrency": self.concurrency,
            "per_second": self.per_second,
            "per_minute": self.per_minute,
            "per_day": self.per_day,
            "tokens_per_minute": self.tokens_per_minute,
        }
        return {f: float(v) for f, v in values.items() if v is not None}

    def windows(self) -> tuple[tuple[str, float, float], ...]:
        """The request windows as ``(field, limit, window_s)``, shortest window first."""
        spans = (
            ("per_second", self.per_second, 1.0),
            ("per_minute", self.per_minute, 60.0),
            ("per_day", self.per_day, 86_400.0),
        )
        return tuple((f, float(n), w) for f, n, w in spans if n is not None)


def _normalised(entry: str) -> str:
    host, port = parse_entry(entry)
    return host if port is None else f"{host}:{port}"


def decode_spec(data: bytes) -> QuotaSpec:
    """A QuotaSpec from JSON, or InvalidRequest naming the bad field."""
    try:
        return msgspec.json.decode(data, type=QuotaSpec)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad quota spec: {exc}") from exc


def checked(spec: QuotaSpec) -> QuotaSpec:
    """``spec`` validated as if decoded (msgspec checks constraints only when decoding, so a
    spec built in Python goes through this before it is sent or stored)."""
    try:
        return msgspec.convert(msgspec.to_builtins(spec), QuotaSpec)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad quota spec: {exc}") from exc
