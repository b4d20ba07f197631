"""The process backend's output (``CappedSink``): past its cap, an action flooding its stdout
costs the agent's event loop little, and a chatty one still finishes with its output capped;
what is left in the pipes at the exit is read whole; a background child holding them is killed;
a timeout kills the action's group and keeps what it wrote; a sink never reads a pipe once
closed (its fd number may be the next action's), so each action gets its own output."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process.backend import (
    DRAIN_AFTER_EXIT_S,
    CappedSink,
    ProcessBackend,
    ProcessConfig,
)
from tangram.contract import ErrorKind

CORES = tuple(sorted(os.sched_getaffinity(0)))[:1]


@pytest.fixture
async def backend(open_state: Path) -> AsyncIterator[ProcessBackend]:
    b = ProcessBackend(ProcessConfig(root=open_state / "envs", node_id="n-out", incarnation="o"))
    await b.start()
    try:
        yield b
    finally:
        await b.close()


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def test_a_flood_past_the_cap_costs_the_agent_little(backend: ProcessBackend) -> None:
    before = _cpu_s()
    out = await backend.run(ExecRequest("flood", "t", ("cat", "/dev/zero"), CORES, 1.5, 4096))
    spent = _cpu_s() - before
    assert out.stdout == b"\0" * 4096
    assert out.stdout_truncated
    assert spent < 0.35, f"{spent:.2f} s of the agent's CPU for 1.5 s of flood"  # was ~0.67


async def test_a_chatty_action_still_finishes_capped(backend: ProcessBackend) -> None:
    argv = ("sh", "-c", "head -c 20000000 /dev/zero; echo done >&2")
    out = await backend.run(ExecRequest("chatty", "t", argv, CORES, 30.0, 4096))
    assert (out.exit_code, out.stderr, len(out.stdout)) == (0, b"done\n", 4096)
    assert out.stdout_truncated


async def test_what_is_left_in_the_pipes_at_the_exit_is_read_whole(
    backend: ProcessBackend,
) -> None:
    # far more than one read (64 KiB) still in the pipe when the exit is seen
    argv = ("sh", "-c", "head -c 300000 /dev/zero; echo err >&2")
    out = await backend.run(ExecRequest("left", "t", argv, CORES, 30.0, 1 << 20))
    assert (out.exit_code, len(out.stdout), out.stderr) == (0, 300000, b"err\n")
    assert not out.stdout_truncated


async def test_a_background_child_holding_the_pipes_is_killed(backend: ProcessBackend) -> None:
    argv = ("sh", "-c", "echo before; sleep 30 & exit 3")
    t0 = time.monotonic()
    out = await backend.run(ExecRequest("bg", "t", argv, CORES, 30.0, 4096))
    assert (out.exit_code, out.stdout, out.failure) == (3, b"before\n", None)
    assert time.monotonic() - t0 < 10 * DRAIN_AFTER_EXIT_S


async def test_a_timeout_kills_the_group_and_keeps_its_output(backend: ProcessBackend) -> None:
    argv = ("sh", "-c", "echo started; sleep 30; echo never")
    out = await backend.run(ExecRequest("slow", "t", argv, CORES, 2.0, 4096))
    assert (out.failure, out.stdout) == (ErrorKind.EXEC_TIMEOUT, b"started\n")
    assert "2s timeout" in out.detail


async def test_a_pipe_at_its_end_is_read_at_once() -> None:
    """``read_now`` takes what the pipe holds, and its end, without a turn of the event loop;
    past the cap it keeps the pause (the rest is read later)."""
    r, w = os.pipe()
    os.write(w, b"all of it")
    os.close(w)
    sink = CappedSink(r, 64)
    assert sink.read_now()
    assert (sink.value(), sink.truncated) == (b"all of it", False)
    r, w = os.pipe()
    sink = CappedSink(r, 64)
    os.write(w, b"some")
    assert not sink.read_now()  # the writer still open
    assert sink.value() == b"some"
    os.close(w)
    await asyncio.wait_for(sink.eof, 5.0)
    r, w = os.pipe()
    os.write(w, b"all of it")
    os.close(w)
    sink = CappedSink(r, 4)
    assert not sink.read_now()  # past the cap: paused
    assert (sink.value(), sink.truncated) == (b"all ", True)
    await asyncio.wait_for(sink.eof, 5.0)


async def test_a_closed_sink_never_reads_the_pipe_that_took_its_fd_number() -> None:
    """The exit's read comes after the loop may have seen the pipe's end and closed it, and
    the next action's pipe may have the freed fd number by then: its output is not taken."""
    r, w = os.pipe()
    os.close(w)
    sink = CappedSink(r, 64)
    assert sink.read_now()  # at its end: closed, r is free
    r2, w2 = os.pipe()  # the next action's pipe, on the freed number (the lowest free one)
    if r2 != r:
        os.dup2(r2, r)
    os.set_blocking(r, False)  # as the next action's sink sets it
    os.write(w2, b"theirs")
    try:
        assert sink.read_now()
        assert sink.value() == b""
        assert os.read(r, 64) == b"theirs"
    finally:
        for fd in {r, r2, w2}:
            os.close(fd)


async def test_many_short_actions_at_once_each_get_their_own_output(
    backend: ProcessBackend,
) -> None:
    cores = tuple(sorted(os.sched_getaffinity(0)))
    reqs = [
        ExecRequest(f"a{i}", f"t{i % 8}", ("echo", str(i)), (cores[i % len(cores)],), 30.0, 64)
        for i in range(300)
    ]
    outs = await asyncio.gather(*(backend.run(r) for r in reqs))
    assert [o.stdout for o in outs] == [b"%d\n" % i for i in range(300)]
