"""Environment lifecycle: state persists within a trajectory, never across; close, cap, pool."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine import build_shell_only_image
from exec_requests import ok, request_for

from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.engine import Engine
from tangram.contract import ErrorKind

pytestmark = pytest.mark.docker


async def test_files_persist_within_a_trajectory_only(backend: DockerBackend) -> None:
    ok(await backend.run(request_for("traj-1", "echo secret > /work/note && echo $HOME")))
    assert ok(await backend.run(request_for("traj-1", "cat /work/note"))).strip() == "secret"
    other = await backend.run(request_for("traj-2", "cat /work/note"))
    assert other.failure is None
    assert other.exit_code != 0
    assert backend.env("traj-1").container_id != backend.env("traj-2").container_id
    assert backend.starts.snapshot() == (3, 0)  # each launch counted once, none left under way


async def test_drop_env_removes_the_container_and_its_state(backend: DockerBackend) -> None:
    ok(await backend.run(request_for("traj-d", "echo x > /work/f")))
    container = backend.env("traj-d").container_id
    await backend.drop_env("traj-d")
    assert "traj-d" not in backend.envs()
    assert await backend.call(backend.engine.state, container) is None
    again = await backend.run(request_for("traj-d", "cat /work/f"))
    assert again.exit_code != 0


async def test_envs_report_last_use_for_idle_ttl(backend: DockerBackend) -> None:
    before = time.monotonic()
    ok(await backend.run(request_for("traj-ttl", "true")))
    last = backend.envs()["traj-ttl"]
    assert before <= last <= time.monotonic()


async def test_cap_per_node_refuses_a_new_environment(backend_factory) -> None:
    backend = await backend_factory(max_envs=2)
    for tid in ("cap-1", "cap-2"):
        ok(await backend.run(request_for(tid, "true")))
    refused = await backend.run(request_for("cap-3", "true"))
    assert refused.failure is ErrorKind.BACKEND_UNAVAILABLE
    assert "cap of 2" in refused.detail
    ok(await backend.run(request_for("cap-1", "true")))  # existing envs still run
    await backend.drop_env("cap-2")
    ok(await backend.run(request_for("cap-3", "true")))


async def test_close_removes_every_container(backend_factory) -> None:
    backend = await backend_factory(warm_pool=1)
    await backend.pool.wait_full(timeout_s=30)
    ok(await backend.run(request_for("traj-c", "true")))
    await backend.close()
    engine = Engine(backend.cfg)
    await asyncio.to_thread(engine.connect)
    assert await asyncio.to_thread(engine.containers, True) == []
    engine.close()
    assert [p.name for p in backend.root.iterdir()] == ["executor.py"]
    await backend.close()  # idempotent


async def test_warm_pool_serves_first_action_and_refills(backend_factory) -> None:
    backend = await backend_factory(warm_pool=2, pool_memory_mb=256)
    await backend.pool.wait_full(timeout_s=30)
    pooled = {env.container_id for env in backend.pool._ready[backend.cfg.image]}
    limit = "cat /sys/fs/cgroup/memory/memory.limit_in_bytes /sys/fs/cgroup/memory.max 2>/dev/null"
    out = ok(await backend.run(request_for("warm-0", limit + "; true", memory_mb=128)))
    assert int(out.split()[0]) == 128 * 2**20  # the pool container got the trajectory's memory
    assert backend.env("warm-0").container_id in pooled
    assert backend.stats["pool_hits"] == 1
    # taken out of the pool (its size may be back to 2 already: the refill starts at the take
    # and a creation can finish while the action runs; CI once saw 2 here)
    ready = {env.container_id for env in backend.pool._ready[backend.cfg.image]}
    assert backend.env("warm-0").container_id not in ready
    await backend.pool.wait_full(timeout_s=30)
    assert backend.pool.size() == 2
    assert backend.stats["created"] == 3


async def test_a_dead_pool_container_is_replaced(backend_factory) -> None:
    backend = await backend_factory(warm_pool=1)
    await backend.pool.wait_full(timeout_s=30)
    dead = backend.pool._ready[backend.cfg.image][0]
    await backend.call(backend.engine.api.kill, dead.container_id)
    ok(await backend.run(request_for("traj-after-dead-pool", "true")))
    assert backend.env("traj-after-dead-pool").container_id != dead.container_id
    assert backend.stats["quarantined"] == 1
    await backend.pool.wait_full(timeout_s=30)


async def test_drop_env_under_a_running_action_reports_a_kill(backend: DockerBackend) -> None:
    ok(await backend.run(request_for("traj-dr", "true")))
    running = asyncio.ensure_future(backend.run(request_for("traj-dr", "sleep 30")))
    await asyncio.sleep(0)  # one turn of the loop: the action is registered
    await backend.drop_env("traj-dr")
    out = await asyncio.wait_for(running, 15)
    assert out.failure is ErrorKind.CANCELLED
    ok(await backend.run(request_for("traj-dr", "true")))  # a fresh environment, no "lost"


async def test_an_action_without_cores_is_refused(backend: DockerBackend) -> None:
    out = await backend.run(request_for("traj-nc", "true", ()))
    assert out.failure is ErrorKind.INTERNAL


async def _creating(backend: DockerBackend, trajectory_id: str) -> None:
    await asyncio.sleep(0)  # one turn of the loop: run() registers the creation synchronously
    assert trajectory_id in backend._creating


async def test_kill_while_the_container_is_being_made(backend: DockerBackend) -> None:
    req = request_for("traj-kc", "touch /work/ran")
    running = asyncio.ensure_future(backend.run(req))
    await _creating(backend, "traj-kc")
    assert await backend.kill(req.action_id)
    out = await asyncio.wait_for(running, 30)
    assert out.failure is ErrorKind.CANCELLED, (out.failure, out.detail)
    assert out.exit_code is None
    after = await backend.run(request_for("traj-kc", "test -e /work/ran"))
    assert after.failure is None
    assert after.exit_code == 1  # the killed command never ran


async def test_drop_env_while_the_container_is_being_made(backend: DockerBackend) -> None:
    running = asyncio.ensure_future(backend.run(request_for("traj-dc", "true")))
    await _creating(backend, "traj-dc")
    await backend.drop_env("traj-dc")
    out = await asyncio.wait_for(running, 30)
    assert out.failure is ErrorKind.CANCELLED, (out.failure, out.detail)
    assert "traj-dc" not in backend.envs()
    assert await backend.call(backend.engine.containers, True) == []  # nothing lingers


@pytest.mark.parametrize("broken", ["no-python-image", "interpreter-exits"])
async def test_executor_that_cannot_start_falls_back_to_docker_exec(
    backend_factory, docker_engine, broken: str
) -> None:
    if broken == "no-python-image":
        image = await asyncio.to_thread(
            build_shell_only_image, docker_engine.host, "tangram-nopython:latest"
        )
        backend = await backend_factory(exec_mode="executor", image=image, mounts=())
    else:  # `sh -I executor.py` exits at once, as an interpreter too old to run it would
        backend = await backend_factory(exec_mode="executor", python="sh")
    assert ok(await backend.run(request_for("traj-np", "echo hi > /work/f; cat /work/f"))) == "hi\n"
    assert backend.env("traj-np").exec_mode == "docker_exec"
    assert backend.stats["executor_fallbacks"] == 1
    ok(await backend.run(request_for("traj-np2", "true")))
    assert backend.stats["executor_fallbacks"] == 1  # the image is remembered
    assert backend.env("traj-np2").exec_mode == "docker_exec"
