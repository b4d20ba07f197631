"""quota_manager configuration (environment variables ``TANGRAM_QUOTA_*``)."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from tangram import config
from tangram.config import MeshConfig

PREFIX = "TANGRAM_QUOTA_"


def _default_node_id() -> str:
    return f"quota-{socket.gethostname().split('.')[0]}"


class QuotaManagerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    node_id: str = msgspec.field(default_factory=_default_node_id)
    heartbeat_s: float = 1.0
    # upstream connections in use at once, all quotas together (idle keep-alive ones aside)
    max_connections: Annotated[int, msgspec.Meta(ge=1)] = 1024
    connect_timeout_s: float = 10.0  # within the action's own timeout


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, QuotaManagerConfig]:
    """The mesh config and the agent's: ``overrides`` over ``TANGRAM_QUOTA_*`` over defaults."""
    own = {k: v for k, v in (overrides or {}).items() if k in QuotaManagerConfig.__struct_fields__}
    return config.mesh(overrides), config.load(QuotaManagerConfig, PREFIX, own)
