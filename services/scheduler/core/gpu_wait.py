"""Wait for a resident copy, or restore a new one: one GPU pass's list schedule of the copies
of each service (§5.3, plexrl §4.4).

A call whose service is resident only on busy GPUs either waits for one of those copies or
restores the service on another chunk. §5.3 counts the restore in the action's duration and
lets the ACT estimate decide; HRRS counts the setup cost in the service time. So a call is
booked on the copy that would finish it first -- the copy frees at the predicted ends of the
calls on its GPUs, then runs the calls booked on it before in the pass, ``max_batch`` at a
time -- when that is sooner than restoring (on the chunk that frees first, a free one now)
and running there. Booked on a copy that is free now, it is a candidate of the pass (cost 0);
booked on a busy one, it stays queued this pass (the pool's policy still sees it, behind its
candidates, in its estimate). Otherwise it is a restore candidate as before: the pool's policy
chooses its chunk and DoP with the restore in the duration, and it books nothing here (booking
a restore candidate's new copy and chunk kept calls behind it out of the pool, whose policy
then scaled the few left up: a higher ACT in Figure 8(b), ``bench/fig8b.py``).

A restore is not free for the others, though: while more calls of other services queue than
GPUs are free, it takes a GPU they need for its whole length, and evicts copies they will
restore again. So the restore alternative counts its length ``restore_weight`` times (once
when nobody else wants the free GPUs, up to ``1 + MAX_EXTRA_RESTORES`` on a contended pool):
there a service grows another copy only when waiting for its copies would cost several
restores. In Figure 8(b) at batch 1024 this (with ``gpu.cached``'s choice of chunk) took
restores from 0.14 to 0.044 per call, and elastic's mean ACT over five draws of the workload
from 1.82 s to 0.63 s, with restores at 10.09 GB/s, when it was introduced (before the
simulated GPUs kept a fifth of their memory free of weights and restores were priced in
decimal GB: ``bench/results/fig8b.json`` holds the latest run, at the bandwidth ``gpu.json``
measured).

Nothing is remembered between passes: a call waits only while, at each pass, its copy is
still reported (or runs its service) and is predicted to free in time. A call that overruns
its prediction keeps its GPUs predicted free "now" for as long again; past that the estimate
is wrong and no one waits for those GPUs (``until``).

Pure: the pass gives the time, the GPUs' predicted ends and the node's facts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from services.scheduler.core.books import GpuFacts, Node
from services.scheduler.core.gpu import resident_positions

NEVER = math.inf
# a restore on a contended pool counts at most this many times more than its own length
MAX_EXTRA_RESTORES = 8.0


def restore_weight(rivals: int, free_gpus: int) -> float:
    """How many times its own length a restore counts against waiting for a busy copy: once
    for the call's own delay, plus, while more calls of other services (``rivals``) queue than
    GPUs are free, the share of the restore's GPU time taken from them -- and of the copies it
    evicts, which they would restore again -- at most ``MAX_EXTRA_RESTORES`` more. When no
    one else wants the free GPUs a restore that ends sooner wins; on a contended pool a copy
    is replicated only when waiting for it would cost several restores (Figure 8(b):
    restores per call fall, and the ACT with them)."""
    return 1.0 + min(MAX_EXTRA_RESTORES, max(0, rivals - free_gpus) / max(1, free_gpus))


def until(end: float, started_at: float, now: float) -> float:
    """When a call predicted to end at ``end`` frees its GPUs, as a pass at ``now`` sees it:
    ``end``; ``now`` while it overruns by less than its predicted duration; past that never
    (the prediction is wrong: nobody waits for it)."""
    if now <= end:
        return end
    return now if now - end <= end - started_at else NEVER


@dataclass(slots=True)
class Copy:
    """A copy of one service variant on a chunk: when it can start its next batch, how many
    calls are booked on that batch, and whether that batch starts in this pass (the copy is
    free: calls booked on it are candidates)."""

    node_id: str
    gpus: tuple[int, ...]
    free_at: float
    joinable: bool
    seats: int = 0

    @property
    def dop(self) -> int:
        return len(self.gpus)

    def finish(self, exec_s: float, now: float) -> float:
        """When a call booked on it next would end."""
        return max(now, self.free_at) + exec_s

    def book(self, exec_s: float, max_batch: int, now: float) -> float:
        """Book a call on its next batch; when that call ends."""
        end = self.finish(exec_s, now)
        self.seats += 1
        if self.seats >= max_batch:  # that batch is full: the next call runs after it
            self.free_at, self.seats, self.joinable = end, 0, False
        return end


@dataclass(slots=True)
class NodeTimes:
    """A GPU node as one pass sees it: per position (the node's GPU order), when its GPU can
    take a call (``now``: free; ``NEVER``: down or unknown) and whether a call holds it (or
    one booked in this pass will)."""

    node_id: str
    facts: GpuFacts
    at: list[float]
    busy: list[bool]
    running: dict[tuple[int, ...], tuple[str, int]] = field(default_factory=dict)
    _earliest: dict[int, tuple[float, int]] = field(default_factory=dict)

    def earliest(self, dop: int) -> tuple[float, int]:
        """When the first chunk of ``dop`` GPUs is free (``now`` if one is), and its start."""
        hit = self._earliest.get(dop)
        if hit is None:
            starts = range(0, len(self.at) - dop + 1, dop)
            hit = min(((max(self.at[s : s + dop]), s) for s in starts), default=(NEVER, 0))
            self._earliest[dop] = hit
        return hit

    def gpus(self, start: int, dop: int) -> tuple[int, ...]:
        return self.facts.gpus[start : start + dop]

    def hold(self, gpus: tuple[int, ...], end: float) -> None:
        """A call of this pass holds ``gpus`` until ``end``."""
        for p, g in enumerate(self.facts.gpus):
            if g in gpus:
                self.at[p] = max(self.at[p], end) if self.busy[p] else end
                self.busy[p] = True
        self._earliest.clear()

    def copies(self, service: str, dops: Iterable[int]) -> list[Copy]:
        """Every copy of ``service``'s ``dops`` variants here: reported resident, or running it
        (a copy the agent's next report will list), that some pass may still take."""
        out = []
        for d in dops:
            resident = resident_positions(self.facts, service, d)
            for start in range(0, len(self.at) - d + 1, d):
                pos = range(start, start + d)
                gpus = self.gpus(start, d)
                if resident.issuperset(pos) or self.running.get(gpus) == (service, d):
                    at = max(self.at[p] for p in pos)
                    if at < NEVER:
                        free = not any(self.busy[p] for p in pos)
                        out.append(Copy(self.node_id, gpus, at, free))
        return out


def node_times(
    node: Node,
    runs: Iterable[tuple[tuple[int, ...], float]],
    running: Mapping[tuple[int, ...], tuple[str, int]],
    now: float,
) -> NodeTimes:
    """``NodeTimes`` of ``node`` from the GPUs its calls hold and when each frees (``until``;
    ``NEVER`` for a call that may be stuck), and the variant each busy chunk runs."""
    facts = node.gpu
    assert facts is not None
    ends: dict[int, float] = {}
    for gpus, end in runs:
        for g in gpus:
            ends[g] = max(ends.get(g, now), end)
    at, busy = [], []
    for g in facts.gpus:
        held = g not in node.free
        at.append(NEVER if g in facts.down else ends.get(g, NEVER) if held else now)
        busy.append(held)
    return NodeTimes(node.node_id, facts, at, busy, dict(running))


class Copies:
    """One pass's list schedule of every live GPU node's copies (the module docstring)."""

    def __init__(self, times: Mapping[str, NodeTimes], now: float) -> None:
        self.times, self.now = times, now
        self._of: dict[str, list[Copy]] = {}  # service -> its copies, built at first need

    def waits(
        self,
        service: str,
        allowed: Mapping[str, Sequence[int]],
        exec_s: Mapping[int, float],
        restore_s: Mapping[tuple[str, int], float],
        max_batch: int,
        weight: float = 1.0,
    ) -> str | None:
        """The node whose busy copy a call of ``service`` waits for this pass, if it waits:
        booked behind the copy that would finish it first when that beats restoring on the
        chunk that frees first; a call booked on a free copy, or whose restore is sooner, is a
        candidate (``allowed``: per node, the variants it may run as; ``exec_s`` per variant;
        ``restore_s`` per node and variant)."""
        copies = self._copies(service, allowed)
        if not copies:
            return None
        nodes = [(self.times[n], ds) for n, ds in allowed.items() if n in self.times]
        restore = restore_end(nodes, restore_s, exec_s, weight)
        copy = best(copies, allowed, exec_s, restore, self.now)
        if copy is None:
            return None
        waits = not copy.joinable
        copy.book(exec_s[copy.dop], max_batch, self.now)
        return copy.node_id if waits else None

    def _copies(self, service: str, allowed: Mapping[str, Sequence[int]]) -> list[Copy]:
        copies = self._of.get(service)
        if copies is None:
            dops = sorted({d for ds in allowed.values() for d in ds})
            copies = self._of[service] = [
                c for n in allowed if n in self.times for c in self.times[n].copies(service, dops)
            ]
        return copies

    def took(self, node_id: str, gpus: tuple[int, ...], end: float) -> None:
        """A call of this pass holds ``gpus`` of ``node_id`` until ``end``."""
        t = self.times.get(node_id)
        if t is not None:
            t.hold(gpus, end)


def best(
    copies: Sequence[Copy],
    allowed: Mapping[str, Sequence[int]],
    exec_s: Mapping[int, float],
    restore_end: float,
    now: float,
) -> Copy | None:
    """The copy that would finish a call soonest, if that is before ``restore_end`` (the
    restore alternative's end); ``allowed``: per node, the variants the call may run as."""
    pick, end = None, restore_end
    for c in copies:
        if c.dop in allowed.get(c.node_id, ()):
            e = c.finish(exec_s[c.dop], now)
            if e < end:
                pick, end = c, e
    return pick


def restore_end(
    nodes: Iterable[tuple[NodeTimes, Sequence[int]]],
    restore_s: Mapping[tuple[str, int], float],
    exec_s: Mapping[int, float],
    weight: float = 1.0,
) -> float:
    """When a call would end if it restored its service: on the chunk of each allowed variant
    that frees first (a free one: now), the soonest over nodes and variants."""
    return min(
        (
            t.earliest(d)[0] + weight * restore_s[t.node_id, d] + exec_s[d]
            for t, dops in nodes
            for d in dops
        ),
        default=NEVER,
    )
