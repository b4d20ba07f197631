"""Where each idle trajectory environment should live: the pure tiering policy (plexrl §4.5).

An environment is ``running`` (its container runs, its memory is reserved), ``paused`` (its
container frozen by ``docker pause``: no CPU, memory kept, back in milliseconds) or on ``disk``
(its work directory saved in one snapshot file, the container removed, its memory released;
back by a cold container start plus an unpack). Two rules move an idle environment down, never
one that has an action running or arriving:

- idle time: running and idle ``pause_after_s`` -> paused; idle ``disk_after_s`` -> disk;
- memory pressure: while the memory of running and paused environments exceeds
  ``budget_mb``, the longest-idle ones (idle at least ``pressure_min_idle_s``) go to disk.

Moving up is never decided here: the next action of an environment on disk or paused brings it
back (``tiering.Tiering.wake``). No I/O and no clock: ``now`` is passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


class Tier(enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class TierPolicy:
    """The thresholds (``DockerConfig.tier_*`` fields); 0 switches a rule off."""

    pause_after_s: float = 30.0
    disk_after_s: float = 600.0
    budget_mb: int = 0
    pressure_min_idle_s: float = 5.0


@dataclass(frozen=True, slots=True)
class EnvView:
    """What the policy knows of one environment."""

    trajectory_id: str
    tier: Tier
    last_used: float
    memory_mb: int
    busy: bool  # an action runs in it or is on its way


@dataclass(frozen=True, slots=True)
class Move:
    trajectory_id: str
    to: Tier


def plan(envs: Iterable[EnvView], now: float, policy: TierPolicy) -> list[Move]:
    """The moves down to make now: to disk first (they release memory), then pauses."""
    views = list(envs)
    idle = _oldest_first(e for e in views if not e.busy and e.tier is not Tier.DISK)
    to_disk = _idle_for(idle, now, policy.disk_after_s) | pressure_victims(views, now, policy)
    pause = _idle_for([e for e in idle if e.tier is Tier.RUNNING], now, policy.pause_after_s)
    moves = [Move(e.trajectory_id, Tier.DISK) for e in idle if e.trajectory_id in to_disk]
    return moves + [
        Move(e.trajectory_id, Tier.PAUSED)
        for e in idle
        if e.trajectory_id in pause and e.trajectory_id not in to_disk
    ]


def _idle_for(envs: Iterable[EnvView], now: float, after_s: float) -> set[str]:
    if after_s <= 0:
        return set()
    return {e.trajectory_id for e in envs if now - e.last_used >= after_s}


def pressure_victims(envs: Iterable[EnvView], now: float, policy: TierPolicy) -> set[str]:
    """The longest-idle environments to put on disk so that the memory of running and paused
    ones (busy included: they hold theirs) fits ``budget_mb``."""
    if policy.budget_mb <= 0:
        return set()
    resident = [e for e in envs if e.tier is not Tier.DISK]
    over = sum(e.memory_mb for e in resident) - policy.budget_mb
    victims: set[str] = set()
    for e in _oldest_first(resident):
        if over <= 0:
            break
        if e.busy or now - e.last_used < policy.pressure_min_idle_s:
            continue
        victims.add(e.trajectory_id)
        over -= e.memory_mb
    return victims


def _oldest_first(envs: Iterable[EnvView]) -> list[EnvView]:
    return sorted(envs, key=lambda e: (e.last_used, e.trajectory_id))
