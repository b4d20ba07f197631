"""Choose the node's execution backend: Docker when an engine answers (and has the sandbox
image), the non-isolating process backend otherwise. Says which, in one line.

``choose`` is shared by the node agent and ``tangram up`` (which prints the line, may build the
default sandbox image first, and then starts the agents with the backend it chose).
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass
from typing import Literal

from services.cpu_manager.backend_api import Backend
from services.cpu_manager.config import CpuManagerConfig
from services.cpu_manager.docker import engine as docker_engine
from services.cpu_manager.docker import sandbox_image
from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.engine import DockerFailure
from services.cpu_manager.process import users
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from tangram.errors import Unavailable

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
CONTAINER_VAR = "TANGRAM_IN_CONTAINER"  # set by compose/Dockerfile


@dataclass(frozen=True, slots=True)
class Choice:
    """The backend to run and the one line that says which and why."""

    backend: Literal["docker", "process"]
    line: str


async def _fallback(cfg: CpuManagerConfig, why: str) -> Choice:
    if cfg.backend == "docker":
        raise Unavailable(f"docker backend requested but {why}")
    if os.environ.get(CONTAINER_VAR):  # the process backend would run actions in here, unisolated
        raise Unavailable(f"no fallback to the process backend inside a container ({why})")
    return Choice("process", f"process backend ({why}; {await _users(cfg)}; NOT isolated)")


async def _users(cfg: CpuManagerConfig) -> str:
    """Whom the process backend's actions would run as (file ownership is all it separates);
    in a thread: the first call of a boot builds tangram-dropuid."""
    found = await asyncio.to_thread(users.run_as, cfg.env_root(), wanted=cfg.trajectory_uids)
    return found.line()


def _missing_image(cfg: CpuManagerConfig) -> str:
    if cfg.docker.image == sandbox_image.TAG:
        return f"image {cfg.docker.image} missing; `tangram sandbox-image` builds it"
    return (
        f"image {cfg.docker.image} missing; load it into the engine, or unset TANGRAM_CPU_IMAGE "
        f"to use {sandbox_image.TAG} (`tangram sandbox-image` builds that)"
    )


async def _ensure_image(cfg: CpuManagerConfig, build: bool) -> tuple[bool, str]:
    """(present now, how it got there). Only the default sandbox image is ever built."""
    if await asyncio.to_thread(sandbox_image.present, cfg.docker.docker_host, cfg.docker.image):
        return True, ""
    if not build or cfg.docker.image != sandbox_image.TAG:
        return False, ""
    await asyncio.to_thread(sandbox_image.build, cfg.docker.docker_host, cfg.docker.image)
    return True, f"; built just now: {sandbox_image.DESCRIPTION}"


async def choose(cfg: CpuManagerConfig, *, build_image: bool = False) -> Choice:
    """Docker or process, and why; with ``build_image`` a missing default image is built."""
    if cfg.backend == "process":
        said = await _users(cfg)
        return Choice("process", f"process backend (as configured; {said}; NOT isolated)")
    version = await asyncio.to_thread(docker_engine.probe, cfg.docker.docker_host, PROBE_TIMEOUT_S)
    if version is None:
        where = cfg.docker.docker_host or "the default socket"
        return await _fallback(cfg, f"no Docker engine answers at {where}")
    try:
        present, built = await _ensure_image(cfg, build_image)
    except DockerFailure as exc:
        return await _fallback(cfg, f"image {cfg.docker.image} unavailable: {exc.detail}")
    if not present:
        return await _fallback(cfg, _missing_image(cfg))
    mode = f"exec via {cfg.docker.exec_mode}"
    return Choice(
        "docker", f"docker backend (engine {version}, image {cfg.docker.image}, {mode}{built})"
    )


async def make_backend(cfg: CpuManagerConfig, incarnation: str) -> tuple[Backend, str]:
    """The backend to use and the one line that says why."""
    choice = await choose(cfg)
    if choice.backend == "docker":
        return DockerBackend(cfg.docker_for(incarnation)), choice.line
    process = ProcessBackend(
        ProcessConfig(
            root=cfg.env_root(),
            node_id=cfg.node_id,
            incarnation=incarnation,
            trajectory_uids=cfg.trajectory_uids,
            spawner=cfg.spawner,
        )
    )
    return process, choice.line
