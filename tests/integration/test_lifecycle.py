"""Environment TTL, graceful drain on SIGTERM, and meshes that share a machine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import ActionSpec, ErrorKind, ExecAction
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually, running_mesh

pytestmark = pytest.mark.slow


@pytest.fixture
async def ttl_mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(tmp_path / "mesh", env={"TANGRAM_CPU_ENV_TTL_S": "0.5"}) as m:
        yield m


async def test_idle_environment_expires_and_its_trajectory_is_told(ttl_mesh: Mesh, uid: str):
    async with Client.connect(ttl_mesh.nats_url) as client:
        first = await client.exec("echo state > f", trajectory_id=uid, job_id=uid)
        assert first.ok
        envs = ttl_mesh.opts.state_dir / "envs" / "node0"
        await eventually(lambda: not any(envs.iterdir()), what="the idle environment's removal")

        async def scheduler_forgot() -> bool:
            return (await ttl_mesh.status(client.bus)).envs == 0

        await eventually(scheduler_forgot, what="the expiry to reach the scheduler")
        late = await client.exec("cat f", trajectory_id=uid, job_id=uid, wait_s=30)
        assert late.status == "failed"
        assert late.error is not None
        assert late.error.kind is ErrorKind.ENVIRONMENT_LOST
        assert "TTL" in late.error.message
        await client.close_env(uid)  # closing resets the id: a fresh environment
        fresh = await client.exec("echo again", trajectory_id=uid, job_id=uid, wait_s=30)
        assert fresh.ok


async def test_sigterm_drains_in_flight_actions(mesh: Mesh, uid: str, tmp_path: Path):
    marker = tmp_path / "started"
    async with Client.connect(mesh.nats_url) as client:
        spec = ActionSpec(
            action_id=f"{uid}-drain",
            job_id=uid,
            trajectory_id=uid,
            action=ExecAction(command=f"touch {marker}; sleep 1; echo finished"),
        )
        await client.submit(spec)
        await eventually(
            marker.exists, what="the action to run"
        )  # in flight on the node, not still being dispatched
        rc = await mesh.stop_service("cpu_manager.0")
        assert rc == 0
        await mesh.start_service("cpu_manager", 0)
        res = await client.result(spec.action_id, timeout=30)
    assert res.ok
    assert res.stdout == "finished\n"


async def test_a_second_mesh_on_the_machine_leaves_the_first_ones_actions_alone(
    mesh: Mesh, tmp_path: Path, uid: str
):
    marker = tmp_path / "running"
    async with Client.connect(mesh.nats_url) as client:
        running = asyncio.ensure_future(
            client.exec(f"touch {marker}; sleep 1.5; echo survived", trajectory_id=uid, job_id=uid)
        )
        await eventually(marker.exists, what="the first mesh's action to run")
        async with running_mesh(tmp_path / "other"):
            res = await running
    assert res.ok, res.error
    assert res.stdout == "survived\n"
