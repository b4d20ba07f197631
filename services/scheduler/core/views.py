"""How the scheduler core presents queued and running actions to a policy (pure)."""

from __future__ import annotations

from services.scheduler.policies.base import Running, Waiting
from tangram.contract import UnifiedAction


def running(action: UnifiedAction, units: int, started_at: float) -> Running:
    """A running action as a policy sees it."""
    spec = action.spec
    hint = spec.duration
    return Running(
        spec.action_id,
        units,
        started_at,
        trajectory_id=spec.trajectory_id,
        profile=spec.profile,
        t_ori_s=hint.t_ori_s if hint else None,
        parallel_fraction=hint.parallel_fraction if hint else None,
    )


def waiting(act: UnifiedAction) -> Waiting:
    """A queued action as a policy sees it."""
    hint = act.spec.duration
    return Waiting(
        action_id=act.spec.action_id,
        choices=act.demands[0].choices,
        enqueued_at=act.submitted_at,
        profile=act.spec.profile,
        t_ori_s=hint.t_ori_s if hint else None,
        parallel_fraction=hint.parallel_fraction if hint else None,
        trajectory_id=act.spec.trajectory_id,
    )
