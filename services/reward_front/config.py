"""Reward front configuration (``TANGRAM_REWARD_FRONT_*``; the service it scores with and
the job it bills come from ``TANGRAM_REWARD_*``, as for the library adapters)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from tangram import config
from tangram.config import MeshConfig
from tangram.integrations import config as reward_config
from tangram.integrations.config import RewardConfig


class FrontConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8470  # 0: any free port
    # Requests being scored at once; one more is answered 503 with Retry-After.
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = 1024
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 16 * 1024 * 1024
    reward: RewardConfig = msgspec.field(default_factory=RewardConfig)


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, FrontConfig]:
    mesh, front = config.service(FrontConfig, "TANGRAM_REWARD_FRONT_", overrides)
    return mesh, msgspec.structs.replace(front, reward=reward_config.load())
