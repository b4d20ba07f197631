"""The agents' canaries (``tangram.agent.Canaries``). The process backend's spawns ``true`` on
the launcher thread every action is spawned on (so a wedged launcher never answers it), and an
action killed while its spawn waited for that launcher never starts once it is free; the GPU
agent's waits for a runner thread; the quota agent's for the resolver's threads; the Docker
backend's is the engine's ping on a thread of its own, answered while every pool thread is
held by a healthy node's long calls (removals at a step's end, creations, restores), never
while the engine does not answer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.config import DockerConfig
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from services.gpu_manager.config import GpuManagerConfig
from services.gpu_manager.executor import GpuExecutor
from services.quota_manager.http import Upstream
from services.quota_manager.service import HttpExecutor
from tangram.contract import ErrorKind

from ..support import eventually, process_backend


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    async with process_backend(tmp_path, "n-canary") as b:
        yield b


def request(aid: str, marker: Path) -> ExecRequest:
    cores = tuple(sorted(os.sched_getaffinity(0)))[:1]
    argv = ("sh", "-c", f"touch {marker}")
    return ExecRequest(aid, "t", argv, cores, timeout_s=5.0, output_cap_bytes=1024)


async def test_the_canary_runs_through_the_spawner_too_and_waits_for_it(
    backend: ProcessBackend,
) -> None:
    spawner = backend._spawner
    assert spawner is not None
    await asyncio.wait_for(backend.canary(), 5)
    os.kill(spawner.pid, signal.SIGSTOP)  # wedged
    try:
        canary = asyncio.ensure_future(backend.canary())
        done, _ = await asyncio.wait([canary], timeout=0.3)
        assert not done  # wedged: no answer
    finally:
        os.kill(spawner.pid, signal.SIGCONT)
    await asyncio.wait_for(canary, 5)


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
        await eventually(lambda: "a" in backend._spawning, what="its spawn queued")
        assert await backend.kill("a", ErrorKind.NODE_DIED)
    finally:
        wedge.set()
    outcome = await asyncio.wait_for(run, 5)
    assert (outcome.failure, outcome.detail) == (ErrorKind.NODE_DIED, "killed before it started")
    assert not marker.exists()
    ok = await backend.run(request("b", marker))  # the launcher serves on
    assert (ok.failure, ok.exit_code) == (None, 0)
    assert marker.exists()


WEDGED_CLOSE = """
import asyncio, sys, threading
from pathlib import Path
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig

async def main() -> None:
    cfg = ProcessConfig(root=Path(sys.argv[1]), node_id="n-wedged", trajectory_uids=False)
    b = ProcessBackend(cfg)
    await b.start()
    b._launcher.submit(threading.Event().wait)  # wedged for good (a hung mount)
    await b.close()
    print("closed", flush=True)

asyncio.run(main())
"""


def test_a_wedged_launcher_does_not_keep_the_agent_from_exiting(tmp_path: Path) -> None:
    """Fenced for a wedged launcher, the agent stops: its backend's close must return (not
    block the event loop joining that thread) and the process must exit (the interpreter
    joins pool threads at exit), so that its supervisor starts a new incarnation."""
    argv = [sys.executable, "-c", WEDGED_CLOSE, str(tmp_path / "envs")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=15, check=False)
    assert (done.returncode, done.stdout) == (0, "closed\n"), done.stderr


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


class FakeApi:
    """The engine's client: ``ping`` answers once ``answering`` is set."""

    def __init__(self) -> None:
        self.answering = threading.Event()

    def ping(self) -> bool:
        self.answering.wait()
        return True


@pytest.fixture
def docker_backend(tmp_path: Path) -> Iterator[DockerBackend]:
    b = DockerBackend(DockerConfig(root=str(tmp_path), threads=2))
    b.engine._api = FakeApi()  # type: ignore[assignment]
    yield b
    b._threads.shutdown(wait=False)
    b._canary_thread.shutdown(wait=False)


async def test_the_docker_canary_answers_while_every_pool_thread_is_held(
    docker_backend: DockerBackend,
) -> None:
    api = docker_backend.engine._api
    assert isinstance(api, FakeApi)
    api.answering.set()
    held = threading.Event()
    busy = [docker_backend._threads.submit(held.wait) for _ in range(docker_backend.cfg.threads)]
    try:
        await asyncio.wait_for(docker_backend.canary(), 2.0)  # not queued behind the pool
    finally:
        held.set()
    for b in busy:
        b.result(timeout=5)


async def test_the_docker_canary_waits_for_the_engine(docker_backend: DockerBackend) -> None:
    api = docker_backend.engine._api
    assert isinstance(api, FakeApi)
    pending = asyncio.ensure_future(docker_backend.canary())
    done, _ = await asyncio.wait([pending], timeout=0.3)
    assert not done  # a wedged engine: no answer
    api.answering.set()
    await asyncio.wait_for(pending, 5)


async def test_a_spawn_the_closed_backend_left_under_way_is_killed_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spawn wedged past its doomed check when the fenced agent closes its backend (close no
    longer waits for the launcher, and the agent cancels the run): once it completes, the
    launcher thread itself kills it, since no one on the loop is left to."""
    cfg = ProcessConfig(root=tmp_path / "envs", node_id="n-closed", trajectory_uids=False)
    b = ProcessBackend(cfg)
    await b.start()
    inside, release = threading.Event(), threading.Event()
    spawned: list[subprocess.Popen[bytes]] = []
    popen = subprocess.Popen

    def wedged_popen(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        inside.set()
        release.wait()  # a spawn under way (a program on a hung mount)
        spawned.append(popen(*args, **kwargs))
        return spawned[-1]

    monkeypatch.setattr(subprocess, "Popen", wedged_popen)
    marker = tmp_path / "ran"
    req = dataclasses.replace(
        request("late", marker), argv=("sh", "-c", f"sleep 1; touch {marker}")
    )
    run = asyncio.ensure_future(b.run(req))
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, inside.wait, 5)
    await asyncio.wait_for(b.close(), 2)
    run.cancel()
    release.set()
    await eventually(lambda: spawned, what="the wedged spawn completed")
    code = await loop.run_in_executor(None, partial(spawned[0].wait, timeout=10))
    assert code == -signal.SIGKILL  # killed, not left to run (it would exit 0)
    assert not marker.exists()
