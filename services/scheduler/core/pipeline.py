"""Pipelining: grants on cores that are still busy, so a node never idles for a round trip.

Without it a node runs at most one action per core, and every action pays a full round trip
(completion -> scheduler -> started record -> dispatch) between two runs on a core; with
short actions that round trip, not the work, bounds the node, and every message and commit
carries one action. With it, once a pass has started what fits, the head of a full node's
pool is granted cores whose current action is still running: the agent holds the dispatch
and starts it the moment those actions end (``Dispatch.after``), while the scheduler already
decides the next. At most ``pipeline_depth`` waiting grants per core (CoreConfig), so a long
action delays at most that many others there. The price: a node killed outright ends its
waiting grants ``node_died`` with the rest (whether one had started is unknown), where
without pipelining they would still be queued.

Only actions with one possible core count are pipelined: an action with a choice of cores
waits for the policy, which sizes it to the cores free when it starts (its elasticity is
worth more than a round trip). Nor is one that sets its own ``queue_timeout_s``: the timeout is
kept while an action is queued, and a grant waiting on a node behind a long action would
outlive it (the default bound, 30 minutes, is no such promise). Pools stay FCFS: the first
candidate that cannot be pipelined stops the node's pipelining for the pass.

A new trajectory is placed behind a busy core too (``SchedulerCore._place_behind``), on a node
whose recent actions ran short (``pipeline_short_s``): there a grant waits behind actions that
have been ending within that bound, where one behind a long action would bind the trajectory
to a node that frees late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tangram.contract import UnifiedAction

CPU = "cpu"


@dataclass(frozen=True, slots=True)
class Holder:
    """A core's current action, as pipelining sees it."""

    core: int
    action_id: str
    started_at: float


@dataclass(frozen=True, slots=True)
class Grant:
    action: UnifiedAction
    cores: tuple[int, ...]
    after: tuple[str, ...]  # the actions holding those cores now


def fixed_cores(action: UnifiedAction) -> int | None:
    """The one core count an action can run with; None when it has a choice (or no CPU)."""
    for d in action.demands:
        if d.resource == CPU:
            return d.choices[0] if len(d.choices) == 1 else None
    return None


def pipelinable(action: UnifiedAction) -> int | None:
    """The core count a grant on busy cores would give ``action``; None when it is not to be
    pipelined (a choice of cores, or a queue timeout of its own: see the module's docstring)."""
    return None if action.spec.queue_timeout_s is not None else fixed_cores(action)


def plan(candidates: Sequence[UnifiedAction], holders: Sequence[Holder]) -> list[Grant]:
    """Grants for the head of a full pool, FCFS, on the cores that free first (their actions
    started earliest); ``holders`` are the busy cores with no grant waiting on them yet."""
    order = sorted(holders, key=lambda h: (h.started_at, h.core))
    grants: list[Grant] = []
    for action in candidates:
        n = pipelinable(action)
        if n is None or n > len(order):
            break
        taken, order = order[:n], order[n:]
        cores = tuple(sorted(h.core for h in taken))
        after = tuple(dict.fromkeys(h.action_id for h in taken))
        grants.append(Grant(action, cores, after))
    return grants
