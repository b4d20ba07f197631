"""Dashboard configuration (environment variables ``TANGRAM_DASHBOARD_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Final

import msgspec

from tangram import config
from tangram.config import MeshConfig

DEFAULT_PORT: Final = 8265


class DashboardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    # Loopback only by default: the pages show commands and outputs of every action.
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = DEFAULT_PORT
    # The token every page asks for (services/dashboard/guard.py): ``token`` if set, else the
    # contents of ``token_file`` (`tangram up` and compose name the keyring's), else one made for
    # this run and logged with the URL (as Jupyter does).
    token: str = ""
    token_file: str = ""
    # Spans kept: none older than retention_s, and at most max_spans rows (the oldest go).
    retention_s: Annotated[float, msgspec.Meta(gt=0)] = 24 * 3600.0
    max_spans: Annotated[int, msgspec.Meta(ge=1000)] = 500_000
    prune_every_s: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    write_every_s: Annotated[float, msgspec.Meta(gt=0)] = 0.5
    # Spans waiting for their COPY while Postgres is away; beyond it new ones are dropped.
    max_pending: Annotated[int, msgspec.Meta(ge=1)] = 100_000


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, DashboardConfig]:
    return config.service(DashboardConfig, "TANGRAM_DASHBOARD_", overrides)
