"""Gateway configuration (environment variables ``TANGRAM_GATEWAY_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from tangram import config
from tangram.config import MeshConfig


class GatewayConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    max_in_flight: int = 4096
    max_cpus_per_action: int = 256
    max_memory_mb: int = 256 * 1024
    max_batch: int = 512


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, GatewayConfig]:
    return config.service(GatewayConfig, "TANGRAM_GATEWAY_", overrides)
