"""Scheduler configuration (environment variables ``TANGRAM_SCHEDULER_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from services.scheduler.policy import make_policy
from tangram import config
from tangram.config import MeshConfig


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str = "elastic"  # or fixed-dop:K, min, trajectory-static:K (policy.POLICY_SPECS)
    node_timeout_s: float = 5.0
    dispatch_grace_s: float = 3.0
    reconcile_grace_s: float = 1.0
    tick_s: float = 0.25
    sweep_s: float = 2.0

    def __post_init__(self) -> None:
        # Refused at decode time (a ValidationError there), not when the scheduler starts.
        try:
            make_policy(self.policy)
        except ValueError as exc:
            raise ValueError(f"TANGRAM_SCHEDULER_POLICY: {exc}") from exc


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, SchedulerConfig]:
    return config.service(SchedulerConfig, "TANGRAM_SCHEDULER_", overrides)
