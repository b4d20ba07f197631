"""The process backend's output past its cap (``CappedSink``): an action flooding its stdout
costs the agent's event loop little, and a chatty one still finishes with its output capped."""

from __future__ import annotations

import os
import resource
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig

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
