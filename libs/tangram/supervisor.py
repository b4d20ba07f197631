"""Supervision for ``tangram up``: a process that dies unexpectedly is started again.

:class:`Restarts` is the policy, pure and driven by the time it is given: capped exponential
backoff, started afresh once a process has stayed up ``stable_s``, and a crash loop reported once
(a process that keeps dying is retried at the cap's pace, never at full speed). :func:`supervise`
is the async shell the launcher runs per process. A deliberate stop never meets it: whoever stops
or kills a process on purpose cancels its supervisor first (see ``launcher.Mesh``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    first_s: float = 0.5  # the delay before the first restart; doubled at each exit in a row
    max_s: float = 30.0  # the cap: a crash loop is retried this often, no faster
    stable_s: float = 30.0  # a process up this long starts the backoff afresh when it exits
    crash_loop: int = 5  # exits in a row, each before stable_s, reported as a crash loop


@dataclass(frozen=True, slots=True)
class Restart:
    attempt: int  # restarts in a row (1: the first since the process was last stable)
    delay_s: float
    crash_loop: bool  # this exit makes it a crash loop (said once per loop)


class Restarts:
    """When to start a process again after each exit."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self.attempt = 0
        self.started_at = 0.0

    def started(self, now: float) -> None:
        self.started_at = now

    def exited(self, now: float) -> Restart:
        p = self.policy
        if now - self.started_at >= p.stable_s:
            self.attempt = 0
        self.attempt += 1
        delay = min(p.max_s, p.first_s * 2 ** (self.attempt - 1))
        return Restart(self.attempt, delay, self.attempt == p.crash_loop)


def describe(status: int | None) -> str:
    """An exit status as a person reads it: 'exited with 1', 'killed by SIGKILL'."""
    if status is None:
        return "is gone"
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-status).name}"
    return f"exited with {status}"


async def supervise(
    name: str,
    wait: Callable[[], Awaitable[int | None]],
    start: Callable[[], Awaitable[None]],
    policy: RestartPolicy,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Until cancelled: ``wait`` for the process to exit, then ``start`` it again after the
    policy's delay, saying so in one line (which, how it ended, attempt, delay)."""
    restarts = Restarts(policy)
    restarts.started(clock())
    while True:
        how = describe(await wait())
        while True:
            r = restarts.exited(clock())
            log.warning("%s %s; restart %d in %.2gs", name, how, r.attempt, r.delay_s)
            if r.crash_loop:
                log.error(
                    "%s is crash-looping: %d exits in a row, each within %.2gs of its start;"
                    " retrying at most every %.2gs (see its log)",
                    name,
                    r.attempt,
                    policy.stable_s,
                    policy.max_s,
                )
            await asyncio.sleep(r.delay_s)
            try:
                await _uncancelled(start())
                break
            except Exception as exc:
                how = f"did not start ({exc})"
        restarts.started(clock())
        log.info("%s restarted", name)


async def _uncancelled(start: Awaitable[None]) -> None:
    """Let a start finish even when cancelled meanwhile: the process it makes is then known to
    the launcher, which stops it, rather than left running unowned."""
    task = asyncio.ensure_future(start)
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


async def exited(proc: subprocess.Popen[bytes]) -> int | None:
    """Wait, without a thread, until a child started with ``subprocess`` exits (a pidfd
    readable on the event loop); its exit status."""
    try:
        fd = os.pidfd_open(proc.pid)
    except ProcessLookupError:
        return proc.poll()
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await done
    finally:
        loop.remove_reader(fd)
        os.close(fd)
    return proc.wait()
