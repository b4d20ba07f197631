"""The restart policy of ``tangram up``: capped exponential backoff, reset once a process stays
up, a crash loop said once; and the supervisor that applies it, on a fake process."""

from __future__ import annotations

import asyncio
import logging
import signal

import pytest

from tangram.supervisor import RestartPolicy, Restarts, describe, supervise

from ..support import eventually

POLICY = RestartPolicy(first_s=0.5, max_s=4.0, stable_s=10.0, crash_loop=4)


def exits(restarts: Restarts, at: list[float]) -> list[tuple[int, float, bool]]:
    """Each process starts at once after its delay and exits at the given time."""
    out = []
    for t in at:
        r = restarts.exited(t)
        out.append((r.attempt, r.delay_s, r.crash_loop))
        restarts.started(t + r.delay_s)
    return out


def test_delays_double_up_to_the_cap_and_a_crash_loop_is_said_once():
    restarts = Restarts(POLICY)
    restarts.started(0.0)
    got = exits(restarts, [1.0, 2.0, 3.0, 5.0, 10.0, 15.0])
    assert got == [
        (1, 0.5, False),
        (2, 1.0, False),
        (3, 2.0, False),
        (4, 4.0, True),
        (5, 4.0, False),
        (6, 4.0, False),
    ]


def test_a_process_that_stayed_up_starts_the_backoff_afresh():
    restarts = Restarts(POLICY)
    restarts.started(0.0)
    assert exits(restarts, [1.0, 2.0]) == [(1, 0.5, False), (2, 1.0, False)]
    assert exits(restarts, [2.0 + 1.0 + 10.0]) == [(1, 0.5, False)]  # up 10 s: stable


def test_exit_statuses_read_as_people_say_them():
    assert describe(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe(1) == "exited with 1"
    assert describe(None) == "is gone"


class FakeProcess:
    """Exits when told; counts its starts; its first ``failing`` starts raise."""

    def __init__(self, failing: int = 0) -> None:
        self.exit: asyncio.Queue[int] = asyncio.Queue()
        self.starts = 0
        self.failing = failing

    async def wait(self) -> int:
        return await self.exit.get()

    async def start(self) -> None:
        self.starts += 1
        if self.starts <= self.failing:
            raise RuntimeError("port in use")


async def test_the_supervisor_restarts_says_so_and_stops_when_cancelled(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="tangram.supervisor")
    proc = FakeProcess(failing=1)
    policy = RestartPolicy(first_s=0.01, max_s=0.02, stable_s=60.0, crash_loop=3)
    task = asyncio.create_task(supervise("svc", proc.wait, proc.start, policy))

    def said() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "tangram.supervisor"]

    proc.exit.put_nowait(-signal.SIGKILL)
    await eventually(lambda: "svc restarted" in said(), what="a failed start, then a restart")
    assert said() == [
        "svc killed by SIGKILL; restart 1 in 0.01s",
        "svc did not start (port in use); restart 2 in 0.02s",
        "svc restarted",
    ]
    proc.exit.put_nowait(1)
    await eventually(lambda: len(said()) == 6, what="the crash loop said, then a restart")
    assert said()[3:] == [
        "svc exited with 1; restart 3 in 0.02s",
        "svc is crash-looping: 3 exits in a row, each within 60s of its start;"
        " retrying at most every 0.02s (see its log)",
        "svc restarted",
    ]
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert proc.starts == 3
