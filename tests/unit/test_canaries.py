"""The agents' canaries (``tangram.agent.Canaries``). The process backend's spawns ``true`` on
the launcher thread every action is spawned on (so a wedged launcher never answers it), and an
action killed while its spawn waited for that launcher never starts once it is free; the GPU
agent's waits for a runner thread; the quota agent's for the resolver's threads."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.executor import GpuExecutor
from services.quota_manager.http import Upstream
from services.quota_manager.service import HttpExecutor
from tangram.contract import ErrorKind


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    cfg = ProcessConfig(root=tmp_path / "envs", node_id="n-canary", trajectory_uids=False)
    b = ProcessBackend(cfg)
    await b.start()
    yield b
    await b.close()


def request(aid: str, marker: Path) -> ExecRequest:
    cores = tuple(sorted(os.sched_getaffinity(0)))[:1]
    argv = ("sh", "-c", f"touch {marker}")
    return ExecRequest(aid, "t", argv, cores, timeout_s=5.0, output_cap_bytes=1024)


async def test_the_canary_runs_through_the_launcher_and_waits_for_it(
    backend: ProcessBackend,
) -> None:
    await asyncio.wait_for(backend.canary(), 5)
    wedge = threading.Event()
    held = backend._launcher.submit(wedge.wait)
    try:
        canary = asyncio.ensure_future(backend.canary())
        done, _ = await asyncio.wait([canary], timeout=0.3)
        assert not done  # wedged: no answer
    finally:
        wedge.set()
    await asyncio.wait_for(canary, 5)
    held.result(timeout=5)


async def test_an_action_killed_while_its_spawn_waits_never_starts(
    backend: ProcessBackend, tmp_path: Path
) -> None:
    marker = tmp_path / "ran"
    wedge = threading.Event()
    backend._launcher.submit(wedge.wait)
    try:
        run = asyncio.ensure_future(backend.run(request("a", marker)))
        await asyncio.sleep(0.05)
        assert await backend.kill("a", ErrorKind.NODE_DIED)
    finally:
        wedge.set()
    outcome = await asyncio.wait_for(run, 5)
    assert (outcome.failure, outcome.detail) == (ErrorKind.NODE_DIED, "killed before it started")
    assert not marker.exists()
    ok = await backend.run(request("b", marker))  # the launcher serves on
    assert (ok.failure, ok.exit_code) == (None, 0)
    assert marker.exists()


async def wedged_then_free(
    canary: Callable[[], Awaitable[None]], pool: concurrent.futures.Executor
) -> None:
    """``canary`` answers at once, not while every thread of ``pool`` is held, then again."""
    await asyncio.wait_for(canary(), 5)
    wedge = threading.Event()
    held = [pool.submit(wedge.wait) for _ in range(64)]  # every thread it may have
    try:
        pending = asyncio.ensure_future(canary())
        done, _ = await asyncio.wait([pending], timeout=0.3)
        assert not done
    finally:
        wedge.set()
    await asyncio.wait_for(pending, 5)
    for h in held:
        h.result(timeout=5)


async def test_the_gpu_canary_runs_on_a_runner_thread() -> None:
    ex = GpuExecutor(GpuManagerConfig(node_id="g0"))
    await ex.canary()  # not started: no runner, nothing to prove
    ex._runner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gpu-run")
    try:
        await wedged_then_free(ex.canary, ex._runner)
    finally:
        ex._runner.shutdown()


async def test_the_quota_canary_runs_on_the_resolver_threads() -> None:
    ex = HttpExecutor(Upstream())
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(2)
    loop.set_default_executor(pool)  # the default executor aiohttp's resolver uses
    try:
        await wedged_then_free(ex.canary, pool)
    finally:
        await ex.close()
