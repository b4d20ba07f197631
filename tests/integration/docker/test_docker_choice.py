"""Which CPU backend runs, said in one line; the default sandbox image is built offline."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import docker
import pytest
from engine import Engine
from exec_requests import ok, request_for

from services.cpu_manager.choice import choose
from services.cpu_manager.config import CpuManagerConfig, load_own
from services.cpu_manager.docker import sandbox_image
from tangram.errors import Unavailable

pytestmark = pytest.mark.docker


def _remove_image(host: str, tag: str) -> None:
    api = docker.APIClient(base_url=host, version="1.41")
    try:
        api.remove_image(tag, force=True)
    except docker.errors.ImageNotFound:
        pass
    finally:
        api.close()


def _cfg(engine: Engine, image: str = sandbox_image.TAG, backend: str = "auto") -> CpuManagerConfig:
    return load_own({"docker_host": engine.host, "image": image, "backend": backend}, environ={})


async def test_missing_default_image_is_built_and_runs_without_configured_mounts(
    docker_engine: Engine, backend_factory
) -> None:
    await asyncio.to_thread(_remove_image, docker_engine.host, sandbox_image.TAG)
    missing = await choose(_cfg(docker_engine))
    assert missing.backend == "process"
    assert "`tangram sandbox-image` builds it" in missing.line
    built = await choose(_cfg(docker_engine), build_image=True)
    assert built.backend == "docker", built.line
    assert "built just now" in built.line
    assert "\n" not in built.line
    backend = await backend_factory(image=sandbox_image.TAG, mounts=())
    out = ok(await backend.run(request_for("traj-sb", ["python3", "-c", "print('py ok')"])))
    assert out == "py ok\n"
    lock = "touch /usr/x 2>/dev/null && echo usr-writable || echo usr-ro; ls /sys/class/net"
    assert ok(await backend.run(request_for("traj-sb", lock))).split() == ["usr-ro", "lo"]


async def test_a_custom_missing_image_is_never_built(docker_engine: Engine) -> None:
    cfg = _cfg(docker_engine, image="tangram-custom:absent")
    choice = await choose(cfg, build_image=True)
    assert choice.backend == "process"
    assert "image tangram-custom:absent missing" in choice.line
    assert "tangram sandbox-image" in choice.line
    with pytest.raises(Unavailable, match="docker backend requested but image"):
        await choose(_cfg(docker_engine, image="tangram-custom:absent", backend="docker"))


async def test_no_engine_means_process_and_says_so(tmp_path: Path) -> None:
    cfg = load_own({"docker_host": f"unix://{tmp_path}/none.sock"}, environ={})
    choice = await choose(cfg, build_image=True)
    assert choice.backend == "process"
    assert choice.line.startswith("process backend (no Docker engine answers at unix://")
    assert choice.line.endswith("NOT isolated)")


@pytest.mark.slow
async def test_up_says_docker_in_one_line_and_its_actions_run_there(docker_engine: Engine) -> None:
    await asyncio.to_thread(_remove_image, docker_engine.host, sandbox_image.TAG)
    state = Path(tempfile.mkdtemp(prefix="tgu-", dir="/tmp"))  # unix socket paths are short
    env = {
        **os.environ,
        "TANGRAM_CPU_DOCKER_HOST": docker_engine.host,
        "TANGRAM_CPU_WARM_POOL": "0",
        "TANGRAM_CPU_MOUNTS": "",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tangram.cli",
        "up",
        "--state-dir",
        str(state),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=env,
    )
    lines: list[str] = []
    try:
        async with asyncio.timeout(90):
            while not lines or not lines[-1].startswith(("mesh up", "tangram:")):
                lines.append((await proc.stdout.readline()).decode().rstrip())
        assert lines[-1].startswith("mesh up"), lines
        said = [line for line in lines if line.startswith("cpu ")]
        assert len(said) == 1, lines
        assert "docker backend (engine" in said[0]
        assert f"image {sandbox_image.TAG}" in said[0]
        from tangram import auth
        from tangram.client import Client

        nats_url = lines[-1].split()[3]
        creds = auth.find_creds(nats_url, state)  # `tangram up` runs NATS with credentials
        async with Client.connect(nats_url, creds=creds) as client:
            res = await client.exec(
                "python3 -c 'print(7)'; id -u", trajectory_id="up-1", job_id="up", wait_s=60
            )
        assert res.ok, (res.error, res.stderr)
        assert res.stdout.split() == ["7", "65534"]  # in the sandbox, not as this user
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            await asyncio.wait_for(proc.wait(), 60)
        shutil.rmtree(state, ignore_errors=True)
