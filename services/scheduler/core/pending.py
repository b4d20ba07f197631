"""The core's queue indexed by what each queued action waits for, so that a scheduling pass
costs the actions it can place, not the queue's length (issue 13).

Queued actions are FCFS by a sequence number (enqueued: after every other; requeued: before
every other) and sit in lanes: GPU calls in one, each CPU action in the lane of the node holding
its trajectory's environment, or in the ``HOMELESS`` lane when it has none (it waits for a
placement). A pass (``walk``) visits the lanes merged in FCFS order and stops drawing from a
lane once its ``alive`` test says nothing more in it can start this pass; the core only skips
what its full scan would have looked at and left alone.

Queue timeouts are a heap of deadlines, so a tick costs the actions that expire.

Its full scan also makes one-time checks of any action it passes (an environment lost, a
request no node can ever hold). Their answer for an action changes only when it is queued, when
its trajectory's environment comes or goes, or when nodes come or go; so an action is
*unchecked* from such a change until a pass has visited it, and the walk visits every unchecked
action in its FCFS place whatever its lane.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Generator, Iterator

DUE_SLACK_S = 1e-3  # deadlines this close are looked at: the caller's test is exact
_Entry = tuple[int, str]  # (FCFS key, action); in a lane, stale once it left or moved
_Source = tuple[str, Iterator[_Entry]]  # a lane and where the walk is in it
HOMELESS = ""  # the lane of CPU actions whose trajectory has no environment
_GPU = "\0gpu"  # the lane of GPU calls (never a node id: ids are printable)


class Pending:
    """Lanes, trajectories and unchecked actions of the queue (ids only: the core keeps the
    actions). A lane is a deque whose entries go stale when their action leaves it: dropped
    from its head, or in one go when most are stale (deleting from the front of a dict or a
    list would cost the lane's length)."""

    def __init__(self) -> None:
        self.seq: dict[str, int] = {}  # action -> FCFS key
        self.lane_of: dict[str, str] = {}
        self.lanes: dict[str, deque[_Entry]] = {}  # lane -> its entries in FCFS order
        self._live: dict[str, int] = {}  # lane -> how many of its entries are not stale
        self.by_tid: dict[str, dict[str, None]] = {}  # trajectory -> its queued actions
        self._tid: dict[str, str] = {}
        self._last = 0
        self._first = 0
        self._unchecked: list[tuple[int, str]] = []  # heap; stale entries skipped
        self._marked: set[str] = set()
        self.all_unchecked = False  # nodes changed: the next walk checks every action
        self._walking = False  # lanes are read: replaced, never changed in place
        self._deadlines: list[tuple[float, int, str]] = []  # heap; stale entries skipped

    def __len__(self) -> int:
        return len(self.seq)

    def has_gpu(self) -> bool:
        return self._live.get(_GPU, 0) > 0

    def gpu(self) -> list[str]:
        """The queued GPU calls, FCFS."""
        return [aid for seq, aid in self.lanes.get(_GPU, ()) if self._valid(_GPU, seq, aid)]

    def _valid(self, lane: str, seq: int, aid: str) -> bool:
        return self.seq.get(aid) == seq and self.lane_of[aid] == lane

    def add(
        self, aid: str, tid: str, lane: str | None, due: float | None, first: bool = False
    ) -> None:
        """Queue ``aid`` (lane None: a GPU call), last or (``first``) before every other;
        ``due``: when its queue timeout is (about) reached."""
        if first:
            self._first -= 1
            self.seq[aid] = self._first
        else:
            self._last += 1
            self.seq[aid] = self._last
        self._tid[aid] = tid
        self.by_tid.setdefault(tid, {})[aid] = None
        self._put(aid, _GPU if lane is None else lane)
        self.mark(aid)
        if due is not None:
            heapq.heappush(self._deadlines, (due, self.seq[aid], aid))

    def remove(self, aid: str) -> None:
        if self.seq.pop(aid, None) is None:
            return
        tid = self._tid.pop(aid)
        mine = self.by_tid[tid]
        del mine[aid]
        if not mine:
            del self.by_tid[tid]
        self._marked.discard(aid)
        self._drop(self.lane_of.pop(aid))
        if len(self._deadlines) > 2 * len(self.seq) + 1024:  # mostly started: drop those
            self._deadlines = [d for d in self._deadlines if self.seq.get(d[2]) == d[1]]
            heapq.heapify(self._deadlines)

    def expired(self, now: float, test: Callable[[str], bool]) -> list[str]:
        """The queued actions whose deadline is near ``now`` and that ``test`` says expired,
        FCFS; the others near it stay due."""
        near: list[tuple[float, int, str]] = []
        while self._deadlines and self._deadlines[0][0] <= now + DUE_SLACK_S:
            entry = heapq.heappop(self._deadlines)
            if self.seq.get(entry[2]) == entry[1]:
                near.append(entry)
        out: list[tuple[int, str]] = []
        for entry in near:
            if test(entry[2]):
                out.append((entry[1], entry[2]))
            else:
                heapq.heappush(self._deadlines, entry)
        return [aid for _, aid in sorted(out)]

    def move(self, tid: str, lane: str) -> None:
        """The trajectory's environment is now in ``lane``: so are its queued CPU actions, and
        the checks of those that moved are due again."""
        moved = [
            (self.seq[aid], aid)
            for aid in self.by_tid.get(tid, ())
            if self.lane_of[aid] not in (_GPU, lane)
        ]
        for _, aid in moved:
            self._drop(self.lane_of[aid])
            self.lane_of[aid] = lane
            self.mark(aid)
        if not moved:
            return
        moved.sort()
        q = self.lanes.get(lane)
        if q is None or self._walking or (q and q[-1][0] > moved[0][0]):
            skip = set(moved)  # an entry of an earlier stay here is valid again
            old = [e for e in q or () if e not in skip and self._valid(lane, *e)]
            self.lanes[lane] = deque(heapq.merge(old, moved))
        else:
            q.extend(moved)
        self._live[lane] = self._live.get(lane, 0) + len(moved)

    def mark(self, aid: str) -> None:
        """Its checks are due (at the next walk); nothing if it is no longer queued."""
        if aid in self.seq and aid not in self._marked:
            self._marked.add(aid)
            heapq.heappush(self._unchecked, (self.seq[aid], aid))

    def _put(self, aid: str, lane: str) -> None:
        """At the end of ``lane``, or (requeued first) at its head."""
        self.lane_of[aid] = lane
        q = self.lanes.get(lane)
        if q is None or self._walking:
            q = self.lanes[lane] = deque(q or ())
        entry = (self.seq[aid], aid)
        if q and q[0][0] > entry[0]:
            q.appendleft(entry)
        else:
            q.append(entry)
        self._live[lane] = self._live.get(lane, 0) + 1

    def _drop(self, lane: str) -> None:
        """One action left ``lane`` (its entry is stale now)."""
        live = self._live[lane] = self._live[lane] - 1
        if live == 0:
            del self._live[lane], self.lanes[lane]
        elif not self._walking and len(self.lanes[lane]) > 2 * live + 64:
            valid = (e for e in self.lanes[lane] if self._valid(lane, *e))
            self.lanes[lane] = deque(dict.fromkeys(valid))

    # ------------------------------------------------------------------ the walk

    def walk(self, alive: Callable[[str], bool], extra: list[str]) -> Generator[str, None, None]:
        """The CPU actions a pass must visit, FCFS: each lane's until it is not ``alive`` (asked
        before each of its actions is drawn), every unchecked one, and what the caller appends
        to ``extra`` on the way (actions of a trajectory it just placed). Between ``begin_walk``
        and ``end_walk``; each action once."""
        heap: list[tuple[int, str, int]] = []  # (seq, action, source); source -1: no lane
        sources: list[_Source] = []
        for lane, q in self.lanes.items():
            while q and not self._valid(lane, *q[0]):
                q.popleft()
            if lane != _GPU and alive(lane):
                sources.append((lane, iter(q)))
                self._draw(heap, sources, len(sources) - 1)
        if self.all_unchecked:
            self.all_unchecked = False
            self._marked = set(self.seq)
            self._unchecked = [(seq, aid) for aid, seq in self.seq.items()]
            heapq.heapify(self._unchecked)
        seen: set[str] = set()
        self._next_unchecked(heap)
        try:
            while heap:
                _, aid, src = heapq.heappop(heap)
                if src >= 0:
                    if alive(sources[src][0]):
                        self._draw(heap, sources, src)
                elif src == -1:
                    self._next_unchecked(heap)
                if aid in seen or aid not in self.seq or self.lane_of[aid] == _GPU:
                    continue
                seen.add(aid)
                self._marked.discard(aid)
                yield aid
                while extra:
                    more = extra.pop()
                    if more in self.seq and more not in seen:
                        heapq.heappush(heap, (self.seq[more], more, -2))
        finally:  # the unchecked action drawn but not reached stays due
            for seq, aid, src in heap:
                if src == -1 and aid in self._marked:
                    heapq.heappush(self._unchecked, (seq, aid))

    def _draw(self, heap: list[tuple[int, str, int]], sources: list[_Source], i: int) -> None:
        lane, it = sources[i]
        for seq, aid in it:
            if self._valid(lane, seq, aid):
                heapq.heappush(heap, (seq, aid, i))
                return

    def _next_unchecked(self, heap: list[tuple[int, str, int]]) -> None:
        """Draw the oldest unchecked action into the walk (stale entries dropped)."""
        while self._unchecked:
            seq, aid = heapq.heappop(self._unchecked)
            if aid in self._marked and self.seq.get(aid) == seq:
                heapq.heappush(heap, (seq, aid, -1))
                return

    def begin_walk(self) -> None:
        self._walking = True

    def end_walk(self) -> None:
        self._walking = False
