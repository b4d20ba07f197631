"""What users declare once for the whole mesh: quotas (``QuotaSpec``) and model services
(``ServiceSpec``). Both travel on the wire and are stored in Postgres, so they follow the
message rules (``omit_defaults``, unknown fields allowed); ``name`` is the one positional field
(``QuotaSpec("search", per_second=5)``, ``ServiceSpec("judge", "pkg.models:judge")``).

msgspec checks constraints only when decoding: a spec built in Python goes through
:func:`checked_quota` / :func:`checked_service` before it is sent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Final, TypeVar

import msgspec
from msgspec import Meta, Struct

from tangram.contract.hosts import parse_entry

S = TypeVar("S", bound=Struct)

MAX_HOSTS: Final = 64

QuotaName = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z0-9][a-z0-9._-]*$")]
HostEntry = Annotated[
    str, Meta(min_length=1, max_length=262, pattern=r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+)(:\d+)?$")
]
EnvName = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Concurrency = Annotated[int, Meta(ge=1, le=1_000_000)]
PerSecond = Annotated[float, Meta(gt=0, le=1_000_000)]
Count = Annotated[int, Meta(ge=1, le=10**12)]


class _QuotaName(Struct, omit_defaults=True):
    name: QuotaName


class QuotaSpec(_QuotaName, kw_only=True, omit_defaults=True):
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


def decode_quota(data: bytes) -> QuotaSpec:
    """A QuotaSpec from JSON, or InvalidRequest naming the bad field."""
    return _checked(QuotaSpec, lambda: msgspec.json.decode(data, type=QuotaSpec), "quota")


def checked_quota(spec: QuotaSpec) -> QuotaSpec:
    """``spec`` validated as if decoded (msgspec checks constraints only when decoding, so a
    spec built in Python goes through this before it is sent or stored)."""
    return _checked(QuotaSpec, lambda: _reconvert(spec, QuotaSpec), "quota")


# --------------------------------------------------------------------------- services

ServiceName = Annotated[
    str, Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
]
Factory = Annotated[
    str,
    Meta(
        min_length=3,
        max_length=256,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*$",
    ),
]
Dop = Annotated[int, Meta(ge=1, le=64)]
MAX_SERVICE_OUTPUT: Final = 256 * 1024


class _ServiceId(Struct, omit_defaults=True):
    name: ServiceName
    factory: Factory


class ServiceSpec(_ServiceId, kw_only=True, omit_defaults=True):
    """A model service over the GPU pool. ``factory`` (``"module:callable"``, importable where
    the gpu_manager runs) returns ``(model, handle)``: a ``torch.nn.Module`` whose parameters
    and buffers are the state moved between host and device, and ``handle(model, payloads:
    list) -> list`` returning one output per payload. ``dops`` are the GPU counts (powers of
    two) it may run on, each a distinct service on the devices (§5.3); calls to a resident
    service are batched up to ``max_batch`` per forward pass."""

    dops: Annotated[tuple[Dop, ...], Meta(min_length=1, max_length=7)] = (1,)
    max_batch: Annotated[int, Meta(ge=1, le=4096)] = 8
    max_output_bytes: Annotated[int, Meta(ge=1, le=MAX_SERVICE_OUTPUT)] = 64 * 1024

    def __post_init__(self) -> None:
        if any(d & (d - 1) for d in self.dops):
            raise ValueError(f"dops must be powers of two (GPU chunk sizes), got {self.dops}")
        self.dops = tuple(sorted(set(self.dops)))


def checked_service(spec: ServiceSpec) -> ServiceSpec:
    """``spec`` validated as if decoded, or InvalidRequest naming the bad field."""
    return _checked(ServiceSpec, lambda: _reconvert(spec, ServiceSpec), "service")


def _reconvert(spec: Struct, typ: type[S]) -> S:
    return msgspec.convert(msgspec.to_builtins(spec), typ)


def _checked(typ: type[S], make: Callable[[], S], what: str) -> S:
    # errors imports the contract: imported here, at call time, to keep the import graph a tree
    from tangram.errors import InvalidRequest

    try:
        return make()
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise InvalidRequest(f"bad {what} spec: {exc}") from exc
