"""Settings of the reward adapters (environment variables ``TANGRAM_REWARD_*``).

Framework code loads an adapter by import path, so there is no caller to pass settings:
they come from here, and every adapter also takes them as arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec

from tangram import config


class RewardConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Which registered model service scores, and the job its calls are counted under."""

    service: str = "reward"
    job_id: str = "rewards"
    timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 300.0


def load(overrides: Mapping[str, Any] | None = None) -> RewardConfig:
    return config.load(RewardConfig, "TANGRAM_REWARD_", overrides)
