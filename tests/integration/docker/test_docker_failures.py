"""Typed failures: timeout, OOM, lost or hung containers, missing image, unreachable daemon."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import time

import pytest
from engine import LocalDockerd
from exec_requests import ok, request_for

from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.config import DockerConfig
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from tangram.contract import ErrorKind

pytestmark = pytest.mark.docker

CPUS = sorted(os.sched_getaffinity(0))
COUNT_SLEEPS = "ls -l /proc/*/exe 2>/dev/null | grep -c /sleep || true"


async def test_timeout_kills_the_whole_process_group(backend: DockerBackend) -> None:
    t0 = time.monotonic()
    out = await backend.run(request_for("traj-t", "sleep 30 & sleep 30", timeout_s=1.0))
    assert out.failure is ErrorKind.EXEC_TIMEOUT
    assert time.monotonic() - t0 < 5
    if backend.cfg.exec_mode == "executor":  # docker exec leaves the background child behind
        assert ok(await backend.run(request_for("traj-t", COUNT_SLEEPS))).strip() == "0"


async def test_kill_on_request(backend: DockerBackend) -> None:
    t0 = time.monotonic()
    ok(await backend.run(request_for("traj-k", "true")))  # the env exists: run() registers at once
    req = request_for("traj-k", "sleep 30")
    running = asyncio.ensure_future(backend.run(req))
    await asyncio.sleep(0)  # one turn of the loop: the action is registered, not yet started
    assert await backend.kill(req.action_id)
    out = await asyncio.wait_for(running, 10)
    assert out.failure is ErrorKind.CANCELLED
    assert time.monotonic() - t0 < 5


async def test_output_is_capped(backend: DockerBackend) -> None:
    out = await backend.run(
        request_for("traj-cap", "head -c 100000 /dev/zero", output_cap_bytes=1000)
    )
    assert out.exit_code == 0
    assert len(out.stdout) == 1000
    assert out.stdout_truncated


async def test_command_failure_is_not_an_infrastructure_failure(backend: DockerBackend) -> None:
    out = await backend.run(request_for("traj-f", "echo oops >&2; exit 3"))
    assert out.failure is None
    assert out.exit_code == 3
    assert out.stderr == b"oops\n"


@pytest.mark.parametrize(
    ("program", "code"),
    [("tangram-no-such-program", 127), ("/nonexistent/prog", 127), ("/etc/passwd", 126)],
)
async def test_a_program_that_cannot_start_is_reported_as_the_process_backend_does(
    backend: DockerBackend, tmp_path, program: str, code: int
) -> None:
    req = request_for("traj-spawn", [program, "--flag"], (min(CPUS),))
    async with contextlib.AsyncExitStack() as stack:
        process = ProcessBackend(ProcessConfig(root=tmp_path / "process"))
        await process.start()
        stack.push_async_callback(process.close)
        expected = await process.run(req)
    out = await backend.run(req)
    assert (out.failure, out.exit_code, out.stderr) == (None, code, expected.stderr)
    assert (expected.failure, expected.exit_code) == (None, code)
    ok(await backend.run(request_for("traj-spawn", "true")))  # the environment is fine


async def test_oom_is_reported_and_the_environment_survives(backend: DockerBackend) -> None:
    hog = "x = bytearray(400 * 2**20); print(len(x))"
    out = await backend.run(request_for("traj-oom", ["python3", "-c", hog], memory_mb=64))
    assert out.failure is ErrorKind.OOM_KILLED, (out.exit_code, out.detail, out.stderr)
    ok(await backend.run(request_for("traj-oom", "true", memory_mb=64)))


async def test_container_killed_from_outside_is_reported(backend: DockerBackend) -> None:
    ok(await backend.run(request_for("traj-v", "echo 1 > /work/f")))
    await backend.call(backend.engine.api.kill, backend.env("traj-v").container_id)
    lost = await backend.run(request_for("traj-v", "cat /work/f"))
    assert lost.failure is ErrorKind.ENVIRONMENT_LOST
    assert "traj-v" not in backend.envs()
    fresh = await backend.run(request_for("traj-v", "cat /work/f"))
    assert fresh.failure is None
    assert fresh.exit_code != 0


async def test_hung_executor_times_out_and_the_next_action_says_lost(backend_factory) -> None:
    backend = await backend_factory(exec_grace_s=1.0)
    ok(await backend.run(request_for("traj-h", "true")))
    state = await backend.call(backend.engine.state, backend.env("traj-h").container_id)
    os.kill(int(state["Pid"]), signal.SIGSTOP)  # the executor stops answering
    hung = await backend.run(request_for("traj-h", "true", timeout_s=0.5))
    assert hung.failure is ErrorKind.EXEC_TIMEOUT
    assert "hung" in hung.detail
    lost = await backend.run(request_for("traj-h", "true"))
    assert lost.failure is ErrorKind.ENVIRONMENT_LOST
    ok(await backend.run(request_for("traj-h", "true")))


async def test_missing_image(backend: DockerBackend) -> None:
    out = await backend.run(request_for("traj-i", "true", image="tangram-nope:absent"))
    assert out.failure is ErrorKind.IMAGE_MISSING
    assert "traj-i" not in backend.envs()


async def test_unreachable_daemon_at_start(docker_config) -> None:
    backend = DockerBackend(docker_config(docker_host="unix:///nonexistent/docker.sock"))
    with pytest.raises(Exception, match="unreachable") as info:
        await backend.start()
    assert info.value.failure is ErrorKind.BACKEND_UNAVAILABLE
    out = await backend.run(request_for("traj-u", "true"))
    assert out.failure is ErrorKind.BACKEND_UNAVAILABLE
    await backend.close()


# docker-py leaks the socket of every connection attempt to a dead daemon (unixconn.connect).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.slow
async def test_daemon_dying_under_the_backend(docker_config) -> None:
    local = LocalDockerd()
    engine = await asyncio.to_thread(local.start)
    backend = DockerBackend(docker_config(docker_host=engine.host, image=engine.image))
    try:
        await backend.start()
        ok(await backend.run(request_for("traj-dd", "true")))
        await asyncio.to_thread(local.stop)
        out = await backend.run(request_for("traj-new", "true"))
        assert out.failure is ErrorKind.BACKEND_UNAVAILABLE, out.detail
        out = await backend.run(request_for("traj-dd", "true"))
        assert out.failure in (ErrorKind.BACKEND_UNAVAILABLE, ErrorKind.ENVIRONMENT_LOST), (
            out.detail
        )
    finally:
        await backend.close()
        await asyncio.to_thread(local.stop)
        gc.collect()  # finalize the SDK's leaked sockets here, where the warning is expected


def test_config_rejects_unknown_fields() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"root": "/x", "exec_mod": "executor"}, DockerConfig)


@pytest.mark.parametrize(
    "mode",
    [
        {"exec_mode": "executor", "cpuset_via": "auto"},
        {"exec_mode": "executor", "cpuset_via": "docker"},
        {"exec_mode": "docker_exec", "cpuset_via": "docker"},
    ],
    ids=["executor-cgroup", "executor-update", "exec-update"],
)
async def test_container_removed_from_outside_is_replaced(backend_factory, mode) -> None:
    backend = await backend_factory(**mode)
    ok(await backend.run(request_for("traj-rm", "echo 1 > /work/f")))
    gone = backend.env("traj-rm")
    await backend.call(backend.engine.remove, gone.container_id)
    lost = await backend.run(request_for("traj-rm", "cat /work/f"))
    assert lost.failure is ErrorKind.ENVIRONMENT_LOST, (lost.failure, lost.detail)
    assert "traj-rm" not in backend.envs()
    fresh = await backend.run(request_for("traj-rm", "cat /work/f"))  # told once, then replaced
    assert fresh.failure is None, fresh.detail
    assert fresh.exit_code != 0
    assert backend.env("traj-rm").container_id != gone.container_id


@pytest.mark.parametrize("exec_mode", ["executor", "docker_exec"])
async def test_oom_is_reported_when_the_cgroup_is_not_visible(
    backend_factory, tmp_path, exec_mode
) -> None:
    backend = await backend_factory(exec_mode=exec_mode, cgroup_root=str(tmp_path / "no-cgroup"))
    hog = "x = bytearray(400 * 2**20); print(len(x))"
    out = await backend.run(request_for("traj-oom-nc", ["python3", "-c", hog], memory_mb=64))
    assert backend.env("traj-oom-nc").cgroup is None
    assert out.failure is ErrorKind.OOM_KILLED, (out.exit_code, out.detail, out.stderr)
    ok(await backend.run(request_for("traj-oom-nc", "true", memory_mb=64)))
    exited = await backend.run(request_for("traj-oom-nc", "kill -9 $$", memory_mb=64))
    assert exited.failure is None  # a SIGKILL that is not the OOM killer stays the command's own
    assert exited.exit_code in (-9, 137)


async def test_hung_docker_exec_is_an_exec_timeout(backend_factory) -> None:
    backend = await backend_factory(exec_mode="docker_exec", exec_grace_s=1.0)
    ok(await backend.run(request_for("traj-hx", "true")))
    # The orphan escapes the exec's process tree and keeps its output open: the exec never ends.
    hang = "(sleep 60 &) ; sleep 60"
    t0 = time.monotonic()
    hung = await backend.run(request_for("traj-hx", hang, timeout_s=0.5))
    assert hung.failure is ErrorKind.EXEC_TIMEOUT, (hung.failure, hung.detail)
    assert "hung" in hung.detail
    assert time.monotonic() - t0 < 10
    lost = await backend.run(request_for("traj-hx", "true"))
    assert lost.failure is ErrorKind.ENVIRONMENT_LOST
    ok(await backend.run(request_for("traj-hx", "true")))
