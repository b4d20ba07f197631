"""Allocation policies: given one pool's FCFS queue, decide who starts now and with how many units.

A pool is one node's cores (§5.2: CPU is scheduled per node, a trajectory stays on its node).
The scheduler core hands a policy the pool's waiting actions in FCFS order, the free and total
units, and what runs there; the policy returns the grants of the FCFS *prefix* that starts now.
Policies are pure and deterministic: the live scheduler and the simulator call the same code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from services.scheduler.durations import DurationLearner


@dataclass(frozen=True, slots=True)
class Waiting:
    """A queued action as a policy sees it."""

    action_id: str
    choices: tuple[int, ...]  # allowed units of the key resource, sorted ascending
    enqueued_at: float
    profile: str = ""
    t_ori_s: float | None = None  # duration on one unit, when known (§4.1 Eq. 1)
    parallel_fraction: float | None = None  # Amdahl fraction p: E(m) = 1 / (m (1 - p) + p)
    trajectory_id: str = ""

    @property
    def min(self) -> int:
        return self.choices[0]


@dataclass(frozen=True, slots=True)
class Busy:
    """An action running in the pool."""

    action_id: str
    units: int
    started_at: float
    expected_end: float | None = None
    trajectory_id: str = ""  # lets trajectory-static account a reservation's use
    # what the action said of its duration, so a policy can estimate ``expected_end`` itself
    profile: str = ""
    t_ori_s: float | None = None
    parallel_fraction: float | None = None


class Policy(Protocol):
    """Chooses grants for a pool. ``grants[i]`` belongs to ``waiting[i]`` and is in its choices."""

    name: str

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Busy],
        now: float,
    ) -> list[int]:
        """Return grants for the prefix of ``waiting`` that starts now (may be empty)."""
        ...


def fits_at_min(waiting: Sequence[Waiting], free: int) -> int:
    """Length of the longest FCFS prefix whose minimum demands fit in ``free`` units."""
    n = 0
    for w in waiting:
        if w.min > free:
            break
        free -= w.min
        n += 1
    return n


class MinPolicy:
    """FCFS, every action gets its minimum: the baseline that any elastic policy must beat."""

    name = "min"
    lookahead = False  # admits only what fits at minimum: the queue past the block is moot

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Busy],
        now: float,
    ) -> list[int]:
        return [w.min for w in waiting[: fits_at_min(waiting, free)]]


POLICY_SPECS = ("min", "elastic", "elastic:DEPTH", "fixed-dop:K", "trajectory-static:K")


def make_policy(spec: str, learner: DurationLearner | None = None) -> Policy:
    """Build a policy from its config name (one of ``POLICY_SPECS``).

    Stateful policies (trajectory-static) need one instance per pool, which the scheduler core
    builds with their ``for_pool``; ``learner`` lets the elastic policies of all pools share
    what they learn per profile.
    """
    from services.scheduler import elastic  # elastic builds on this module

    name, _, arg = spec.partition(":")
    known = ", ".join(POLICY_SPECS)
    try:
        match name:
            case "min" if not arg:
                return MinPolicy()
            case "elastic":
                return elastic.ElasticPolicy(depth=int(arg or 2), learner=learner)
            case "fixed-dop":
                return elastic.FixedDopPolicy(int(arg))
            case "trajectory-static":
                return elastic.TrajectoryStaticPolicy(int(arg or 1))
    except ValueError as exc:
        raise ValueError(f"bad scheduling policy {spec!r}: {exc}; known: {known}") from exc
    raise ValueError(f"unknown scheduling policy {spec!r}; known: {known}")
