"""Typed configuration. Environment variables are read here and nowhere else.

Every config is a msgspec Struct with ``forbid_unknown_fields``, so a typo fails loudly.
Values come from, in order of precedence: explicit overrides (CLI flags), ``TANGRAM_*``
environment variables, then the Struct's defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

import msgspec

from tangram.errors import InvalidRequest

C = TypeVar("C", bound=msgspec.Struct)


class MeshConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Where the mesh's servers are and how every service behaves on shutdown."""

    nats_url: str = "nats://127.0.0.1:4222"
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    otel_endpoint: str | None = None
    stored_traces_per_s: float = 10.0  # traces started a second for the dashboard (0: off)
    drain_s: float = 10.0
    # How often a gateway or scheduler publishes its heartbeat (TANGRAM_HEARTBEAT_S; tangram.beats)
    heartbeat_s: Annotated[float, msgspec.Meta(gt=0, le=60)] = 1.0
    # Each process's ops endpoint (/metrics, /healthz, /readyz; tangram.ops_http): loopback
    # only by default; port 0 takes any free port (`tangram up` gives each service its own).
    ops_host: str = "127.0.0.1"
    ops_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0


def env_overrides(
    typ: type[msgspec.Struct], prefix: str, environ: Mapping[str, str]
) -> dict[str, str]:
    """Fields of ``typ`` found in ``environ`` as ``PREFIX_FIELD``."""
    found = {}
    for name in typ.__struct_fields__:
        value = environ.get(f"{prefix}{name.upper()}")
        if value is not None:
            found[name] = value
    return found


def load(
    typ: type[C],
    prefix: str,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> C:
    """Build ``typ`` from the environment and ``overrides``; bad values raise InvalidRequest."""
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = env_overrides(typ, prefix, environ)
    raw.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return msgspec.convert(raw, typ, strict=False)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad {typ.__name__}: {exc}") from exc


def service(
    typ: type[C], prefix: str, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, C]:
    """A service's mesh config and its own: each takes the ``overrides`` that name its fields."""
    own = {k: v for k, v in (overrides or {}).items() if k in typ.__struct_fields__}
    return mesh(overrides), load(typ, prefix, own)


def mesh(overrides: Mapping[str, Any] | None = None) -> MeshConfig:
    """The mesh config; OTel's standard variable names the collector."""
    extra = {k: v for k, v in (overrides or {}).items() if k in MeshConfig.__struct_fields__}
    extra.setdefault("otel_endpoint", os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return load(MeshConfig, "TANGRAM_", extra)
