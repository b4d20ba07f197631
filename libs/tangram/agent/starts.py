"""How far an executor got starting what it was handed: the start phase the health detector
watches (``Progress.spawned`` and ``Progress.spawning``, see ``tangram.health``).

A *launch* is the step from "the action holds everything it needs" to "it started": a
process spawned, a request handed to a container's executor, a batch of model calls entered
the runner thread, an HTTP call handed to the client. It takes milliseconds whatever the
action's duration, so the detector can bound it tightly. Deliberately outside a launch: what
legitimately takes long or waits for another's resource, each bounded on its own -- creating,
pulling or restoring a container, building or restoring a model onto its GPUs (progress of
their own), waiting for a core, a GPU chunk or a connection slot held by other actions.

Thread-safe: a GPU batch's launch ends on its runner thread. Per action it costs one small
object and two uncontended lock round trips.
"""

from __future__ import annotations

import threading
from typing import Protocol, runtime_checkable


class Starts:
    """An executor's launches: ``spawned`` (ended: started, or failed or killed at the start,
    either way out of the phase) and ``spawning`` (under way now)."""

    __slots__ = ("_lock", "spawned", "spawning")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.spawned = 0
        self.spawning = 0

    def begin(self, n: int = 1) -> Launch:
        """``n`` actions start launching now; end it with :meth:`Launch.done` (or ``with``)."""
        with self._lock:
            self.spawning += n
        return Launch(self, n)

    def launched(self, n: int = 1) -> None:
        """``n`` actions started on a path without a bounded launch (counted, never awaited)."""
        with self._lock:
            self.spawned += n

    def snapshot(self) -> tuple[int, int]:
        """``(spawned, spawning)``, consistent with each other."""
        with self._lock:
            return self.spawned, self.spawning

    def _end(self, launch: Launch) -> None:
        with self._lock:
            n, launch.n = launch.n, 0
            self.spawning -= n
            self.spawned += n


class Launch:
    """One launch under way; :meth:`done` ends it once, from any thread, however often called
    (on success, on failure, from a ``finally``)."""

    __slots__ = ("n", "starts")

    def __init__(self, starts: Starts, n: int) -> None:
        self.starts = starts
        self.n = n

    def done(self) -> None:
        self.starts._end(self)

    def __enter__(self) -> Launch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


@runtime_checkable
class Launches(Protocol):
    """An executor (or a CPU backend) that counts its launches; without it a node reports
    none and the detector does not watch its start phase."""

    starts: Starts
