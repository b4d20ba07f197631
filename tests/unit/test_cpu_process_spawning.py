"""Where the process backend spawns without its spawner (off, or where it cannot be built;
``test_cpu_spawner`` has it): a trajectory's first action on the launcher thread (its
directory made there), a later one on the event loop's thread while the launcher is idle,
pinned to its cores with the loop's own mask taken back; behind the launcher, in order,
while it has work."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.cpu_manager.backend_api import ExecRequest
from services.cpu_manager.process.backend import ProcessBackend
from tangram.contract import ErrorKind

from ..support import eventually, process_backend

CORE = max(os.sched_getaffinity(0))  # one core of the machine's (the last: not every core)


@pytest.fixture
async def backend(tmp_path: Path) -> AsyncIterator[ProcessBackend]:
    async with process_backend(tmp_path, "n-spawn", spawner=False) as b:
        yield b


@pytest.fixture
def spawners(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of the thread each spawn ran on, in order."""
    names: list[str] = []
    popen = subprocess.Popen

    def recorded(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        names.append(threading.current_thread().name)
        return popen(*args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", recorded)
    return names


def allowed(aid: str, trajectory: str = "t") -> ExecRequest:
    """An action printing the cores it may run on."""
    argv = ("sh", "-c", "grep Cpus_allowed_list /proc/self/status")
    return ExecRequest(aid, trajectory, argv, (CORE,), timeout_s=5.0, output_cap_bytes=1024)


async def test_a_known_trajectorys_action_is_spawned_on_the_loop_pinned_to_its_cores(
    backend: ProcessBackend, spawners: list[str]
) -> None:
    mask = os.sched_getaffinity(0)
    loop_thread = threading.current_thread().name
    first = await backend.run(allowed("a"))
    second = await backend.run(allowed("b"))
    assert spawners[0] == "launcher"  # new: its directory is made on the launcher thread
    assert spawners[1] == loop_thread
    for out in (first, second):
        assert out.exit_code == 0
        assert out.stdout.decode().split() == ["Cpus_allowed_list:", str(CORE)]
    assert os.sched_getaffinity(0) == mask  # the loop took its own mask back


async def test_while_the_launcher_has_work_an_action_waits_behind_it(
    backend: ProcessBackend, spawners: list[str]
) -> None:
    assert (await backend.run(allowed("a"))).exit_code == 0
    wedge = threading.Event()
    backend._launcher.submit(wedge.wait)
    try:
        run = asyncio.ensure_future(backend.run(allowed("b")))
        await eventually(lambda: backend.starts.snapshot() == (1, 1), what="b under way")
        assert not run.done()
        assert len(spawners) == 1  # not spawned beside the launcher
    finally:
        wedge.set()
    assert (await asyncio.wait_for(run, 5)).exit_code == 0
    assert spawners == ["launcher", "launcher"]  # in order, behind what the thread held
    assert not backend._launcher.busy
    assert (await backend.run(allowed("c"))).exit_code == 0
    assert spawners[-1] == threading.current_thread().name


async def test_a_failed_spawn_on_the_loop_still_gives_the_loop_its_mask_back(
    backend: ProcessBackend,
) -> None:
    mask = os.sched_getaffinity(0)
    assert (await backend.run(allowed("a"))).exit_code == 0
    bad = ExecRequest("b", "t", ("/no/such/program",), (CORE,), 5.0, 1024)
    assert (await backend.run(bad)).exit_code == 127
    assert os.sched_getaffinity(0) == mask
    backend.workdir("t").rename(backend.cfg.root / "gone")  # its directory vanished
    lost = await backend.run(allowed("c"))
    assert lost.failure == ErrorKind.ENVIRONMENT_LOST
    assert os.sched_getaffinity(0) == mask


async def test_a_mask_the_loop_cannot_take_back_loses_no_action(
    backend: ProcessBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The machine's CPUs changed under the agent (none of its old mask allowed): the action
    still runs and is supervised; the loop stays on the action's cores, and says so."""
    mask = os.sched_getaffinity(0)
    assert (await backend.run(allowed("a"))).exit_code == 0
    pin = os.sched_setaffinity

    def refusing(pid: int, cpus: Any) -> None:
        if set(cpus) == mask and len(mask) > 1:
            raise OSError(22, "Invalid argument")
        pin(pid, cpus)

    monkeypatch.setattr(os, "sched_setaffinity", refusing)
    try:
        out = await backend.run(allowed("b"))
        assert out.exit_code == 0
        assert out.stdout.decode().split() == ["Cpus_allowed_list:", str(CORE)]
    finally:
        pin(0, mask)
