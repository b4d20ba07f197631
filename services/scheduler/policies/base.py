"""The policy contract: given one pool's FCFS queue, decide who starts now and with how many units.

A pool is one node's cores (§5.2: CPU is scheduled per node, a trajectory stays on its node).
The scheduler core hands a policy the pool's waiting actions in FCFS order, the free and total
units, and what runs there; the policy returns the grants of the queue that start now.
Policies are pure and deterministic: the live scheduler and the simulator call the same code.

Every policy is a :class:`Policy`. Optional hooks are declared here as small Protocols and
checked once, when the core is built: :class:`Learns` (told each successful action's execution
time), :class:`PerPool` (keeps state per pool: one instance per node, told when a
trajectory's environment there ends) and :class:`ArrangesChunks` (arranges GPU pools too;
other policies give GPU actions their smallest DoP).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from services.scheduler.policies.durations import DurationLearner


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
    # a setup cost per choice, added to its duration there (a GPU service's restore, §5.3)
    setup_s: tuple[float, ...] = ()

    @property
    def min(self) -> int:
        return self.choices[0]


@dataclass(frozen=True, slots=True)
class Running:
    """An action running in the pool, as a policy sees it."""

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
    """Chooses grants for a pool. ``grants[i]`` belongs to ``waiting[i]``: 0 means "not now",
    anything else is one of its choices; grants past the returned list are all 0.

    ``lookahead`` says whether the policy looks at the queue past the first action that does
    not fit at its minimum (a policy that only admits what fits at minimum does not, and the
    core then shows it nothing past that block).
    """

    @property
    def name(self) -> str: ...

    @property
    def lookahead(self) -> bool: ...

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Running],
        now: float,
    ) -> list[int]:
        """Return grants for ``waiting`` (may be empty)."""
        ...


@runtime_checkable
class Learns(Protocol):
    """A policy that learns durations: told the execution time of every action that succeeded."""

    def observe(self, profile: str, units: int, exec_s: float) -> None: ...


@runtime_checkable
class ArrangesChunks(Protocol):
    """A policy that can arrange a GPU pool whose free units are buddy chunks (Algorithm 4),
    and whose duration learner the GPU ordering may consult."""

    @property
    def learner(self) -> DurationLearner: ...

    def arrange_chunks(
        self,
        waiting: Sequence[Waiting],
        free_chunks: tuple[int, int, int, int],
        running: Sequence[Running],
        now: float,
        candidates: int | None = None,
    ) -> list[int]: ...


@runtime_checkable
class PerPool(Policy, Protocol):
    """A policy that keeps state per pool (trajectory-static reservations).

    The core builds one instance per node with ``for_pool``, tells it when a trajectory's
    environment there ends (or a reservation it made started nothing) with ``close_trajectory``,
    and drops it with its node.
    """

    def for_pool(self) -> PerPool: ...

    def close_trajectory(self, trajectory_id: str) -> None: ...


def fits_at_min(waiting: Sequence[Waiting], free: int) -> int:
    """Length of the longest FCFS prefix whose minimum demands fit in ``free`` units."""
    n = 0
    for w in waiting:
        if w.min > free:
            break
        free -= w.min
        n += 1
    return n


def clamp_choice(choices: Sequence[int], k: int) -> int:
    """The largest allowed amount not above k, or the minimum when all are above it."""
    best = choices[0]
    for c in choices:
        if c <= k:
            best = c
    return best


class MinPolicy:
    """FCFS, every action gets its minimum: the baseline that any elastic policy must beat."""

    name = "min"
    lookahead = False  # admits only what fits at minimum: the queue past the block is moot

    def arrange(
        self,
        waiting: Sequence[Waiting],
        free: int,
        capacity: int,
        running: Sequence[Running],
        now: float,
    ) -> list[int]:
        return [w.min for w in waiting[: fits_at_min(waiting, free)]]
