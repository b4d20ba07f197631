"""Gateway → scheduler: the unified action of §4.1 and the scheduler's own requests."""

from __future__ import annotations

from tangram.contract.base import Timestamp, _Msg
from tangram.contract.client import ActionSpec


class Demand(_Msg):
    """One entry of the cost vector: any of ``choices`` units of ``resource`` (sorted, unique)."""

    resource: str
    choices: tuple[int, ...]

    @property
    def min(self) -> int:
        return self.choices[0]

    @property
    def max(self) -> int:
        return self.choices[-1]


class UnifiedAction(_Msg):
    """The formulated action of §4.1 that the gateway hands to the scheduler."""

    spec: ActionSpec
    demands: tuple[Demand, ...]
    key_resource: str
    env_memory_mb: int
    submitted_at: Timestamp
    reply_subject: str = ""
    traceparent: str = ""
    attempt: int = 0


# --------------------------------------------------------------------------- scheduler


class Enqueue(_Msg, tag="enqueue"):
    action: UnifiedAction


class CloseEnvCmd(_Msg, tag="close_env"):
    trajectory_id: str


class CancelCmd(_Msg, tag="cancel"):
    action_id: str


class StatusQuery(_Msg, tag="status"):
    pass


SchedulerRequest = Enqueue | CloseEnvCmd | CancelCmd | StatusQuery


class SchedulerStatus(_Msg, tag="scheduler_status"):
    epoch: int
    policy: str
    queued: int
    running: int
    nodes: int
    envs: int
    free_cores: int
