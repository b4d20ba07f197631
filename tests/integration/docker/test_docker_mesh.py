"""The whole mesh on the Docker backend: `auto` picks it when an engine answers, and actions
run through gateway -> scheduler -> cpu_manager in locked-down per-trajectory containers."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from engine import Engine

from tangram.client import Client
from tangram.launcher import Mesh
from tests.integration.test_output_caps import OVERSIZED, check_oversized
from tests.support import running_mesh

pytestmark = [pytest.mark.docker, pytest.mark.slow]


@pytest.fixture
async def docker_mesh(docker_engine: Engine) -> AsyncIterator[Mesh]:
    # A short state dir: the executor's unix socket lives under it (108-byte path limit).
    short = Path(tempfile.mkdtemp(prefix="tgm-", dir="/tmp"))
    env = {
        "TANGRAM_CPU_DOCKER_HOST": docker_engine.host,
        "TANGRAM_CPU_IMAGE": docker_engine.image,
        "TANGRAM_CPU_MOUNTS": ",".join(docker_engine.mounts),
        "TANGRAM_CPU_WARM_POOL": "1",
    }
    try:
        async with running_mesh(short, backend="auto", env=env) as m:
            yield m
    finally:
        shutil.rmtree(short, ignore_errors=True)


async def test_auto_picks_docker_and_actions_run_pinned_in_their_container(
    docker_mesh: Mesh, uid: str
):
    log = (docker_mesh.opts.state_dir / "logs" / "cpu_manager.0.log").read_text()
    assert "docker backend (engine" in log
    async with Client.connect(docker_mesh.nats_url) as client:
        first = await client.exec(
            "echo kept > f; cat /sys/fs/cgroup/cpuset.cpus.effective "
            "2>/dev/null || grep Cpus_allowed_list /proc/self/status",
            trajectory_id=uid,
            job_id=uid,
            wait_s=60,
        )
        assert first.ok, (first.error, first.stderr)
        assert first.allocation is not None
        seen = first.stdout.strip().split(":")[-1].strip()
        assert seen == ",".join(map(str, first.allocation.cores))
        again = await client.exec("cat f; id -u", trajectory_id=uid, job_id=uid, wait_s=60)
        assert again.stdout.split()[0] == "kept"
        assert again.stdout.split()[1] != "0"  # not root inside the sandbox
        other = await client.exec("cat f", trajectory_id=f"{uid}-b", job_id=uid, wait_s=60)
        assert other.exit_code != 0
        port = docker_mesh.nats_url.rsplit(":", 1)[1]
        probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {port}), 2)\""
        net = await client.exec(probe, trajectory_id=uid, job_id=uid, wait_s=60)
        assert net.exit_code != 0  # no network by default: the host's NATS is unreachable


@pytest.mark.parametrize(("command", "char", "stderr_cut"), OVERSIZED)
async def test_oversized_output_returns_cut_and_flagged_from_a_container(
    docker_mesh: Mesh, uid: str, command: str, char: str, stderr_cut: bool
):
    async with Client.connect(docker_mesh.nats_url) as client:
        await check_oversized(client, uid, command, char, stderr_cut)
