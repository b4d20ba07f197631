"""Choose the node's execution backend: Docker when an engine answers (and has the sandbox
image), the non-isolating process backend otherwise. Says which, in one line."""

from __future__ import annotations

import asyncio
import logging

from services.cpu_manager import docker_engine
from services.cpu_manager.backend import Backend
from services.cpu_manager.config import CpuManagerConfig
from services.cpu_manager.docker_backend import DockerBackend
from services.cpu_manager.docker_config import DockerConfig
from services.cpu_manager.process_backend import ProcessBackend, ProcessConfig
from tangram.errors import Unavailable

log = logging.getLogger(__name__)


def _image_present(cfg: DockerConfig) -> bool:
    """Blocking: True when the engine has the default sandbox image."""
    engine = docker_engine.Engine(cfg)
    try:
        engine.connect()
        engine.api.inspect_image(cfg.default_image)
        return True
    except Exception:
        return False
    finally:
        engine.close()


def docker_config(cfg: CpuManagerConfig, incarnation: str) -> DockerConfig:
    return DockerConfig(
        root=str(cfg.env_root()), docker_host=cfg.docker_host, node_id=cfg.node_id,
        incarnation=incarnation, default_image=cfg.image, warm_pool=cfg.warm_pool,
        max_envs=cfg.max_envs, mounts=tuple(m for m in cfg.mounts.split(",") if m),
    )  # fmt: skip


async def make_backend(cfg: CpuManagerConfig, incarnation: str) -> tuple[Backend, str]:
    """The backend to use and the one line that says why."""
    if cfg.backend not in ("auto", "process", "docker"):
        raise Unavailable(f"unknown backend {cfg.backend!r}; use auto, process or docker")
    process = ProcessBackend(
        ProcessConfig(root=cfg.env_root(), node_id=cfg.node_id, incarnation=incarnation)
    )
    if cfg.backend == "process":
        return process, "process backend (as configured; NOT isolated)"
    dcfg = docker_config(cfg, incarnation)
    version = await asyncio.to_thread(docker_engine.probe, cfg.docker_host, 2.0)
    if version is None or not await asyncio.to_thread(_image_present, dcfg):
        why = "no Docker engine answers" if version is None else f"image {cfg.image} missing"
        if cfg.backend == "docker":
            raise Unavailable(f"docker backend requested but {why}")
        return process, f"process backend ({why}; NOT isolated)"
    return DockerBackend(dcfg), f"docker backend (engine {version}, image {cfg.image})"
