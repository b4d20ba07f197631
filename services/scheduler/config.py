"""Scheduler configuration (environment variables ``TANGRAM_SCHEDULER_*``).

The core's settings are a nested :class:`CoreConfig` whose fields keep their flat names
(``TANGRAM_SCHEDULER_NODE_TIMEOUT_S``, ``TANGRAM_SCHEDULER_KILL_GRACE_S``, ...).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from services.scheduler.core.quota_books import QuotaConfig, parse_weights
from services.scheduler.core.scheduler import CoreConfig, PositiveFloat
from services.scheduler.leadership import LeadConfig
from services.scheduler.policies.spec import PolicySpec, parse_policy
from tangram import config
from tangram.config import MeshConfig
from tangram.health import HealthConfig

PREFIX = "TANGRAM_SCHEDULER_"
# The live scheduler pipelines grants to full nodes (core/pipeline.py); the core's own default
# (the simulator's, whose virtual agents start what they get at once) does not.
LIVE_DEFAULTS = {f"{PREFIX}PIPELINE": "true", f"{PREFIX}NODE_TIMEOUTS": "false"}
# The live scheduler's health detector (services/scheduler/health.py) declares silent or
# stuck nodes failed, not the core's own node timeout (see LIVE_DEFAULTS).
HEALTH_PREFIX = "TANGRAM_HEALTH_"


class SchedulerConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    policy: str = "elastic"  # or fixed-dop:K, min, trajectory-static:K (spec.POLICY_SPECS)
    reconcile_grace_s: PositiveFloat = 1.0
    tick_s: PositiveFloat = 0.25
    sweep_s: PositiveFloat = 2.0
    job_weights: str = ""  # quotas' fair share across jobs: "job=2,other=0.5" (unlisted: 1)
    lead_check_s: PositiveFloat = 1.0  # the leader checks its lead lock this often
    lead_lost_s: PositiveFloat = 5.0  # without its lead lock this long, a leader stops
    standby_wait_s: PositiveFloat = 30.0  # a standby re-issues its wait for the lock this often
    # a standby cut off from Postgres contends once the lock stayed free this long (leadership)
    standby_grace_s: PositiveFloat = 3.0
    core: CoreConfig = CoreConfig()
    health: HealthConfig = HealthConfig()

    def __post_init__(self) -> None:
        # Refused at decode time (a ValidationError there), not when the scheduler starts;
        # parsed as data, so checking a name never builds the policy or compiles its kernels.
        try:
            parse_policy(self.policy)
        except ValueError as exc:
            raise ValueError(f"{PREFIX}POLICY: {exc}") from exc
        try:
            parse_weights(self.job_weights)
        except ValueError as exc:
            raise ValueError(f"{PREFIX}JOB_WEIGHTS: {exc}") from exc

    def policy_spec(self) -> PolicySpec:
        return parse_policy(self.policy)

    def lead_config(self) -> LeadConfig:
        return LeadConfig(
            self.lead_check_s, self.lead_lost_s, self.standby_wait_s, self.standby_grace_s
        )

    def quota_config(self) -> QuotaConfig:
        """The quota core's settings: the node core's timings, and the job weights."""
        c = self.core
        return QuotaConfig(
            node_timeout_s=c.node_timeout_s,
            node_timeouts=c.node_timeouts,
            dispatch_grace_s=c.dispatch_grace_s,
            kill_grace_s=c.kill_grace_s,
            weights=parse_weights(self.job_weights),
        )


def load(overrides: Mapping[str, Any] | None = None) -> tuple[MeshConfig, SchedulerConfig]:
    """The mesh's config and the scheduler's, its core's fields read under their flat names."""
    mesh, cfg = config.service(SchedulerConfig, PREFIX, overrides)
    own = {k: v for k, v in (overrides or {}).items() if k in CoreConfig.__struct_fields__}
    core = config.load(CoreConfig, PREFIX, own, environ={**LIVE_DEFAULTS, **os.environ})
    health = config.load(HealthConfig, HEALTH_PREFIX, {}, environ=os.environ)
    return mesh, msgspec.structs.replace(cfg, core=core, health=health)
