"""Fixtures for tests against a real Docker engine: one private dockerd per session."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from engine import Engine, EngineUnavailable, LocalDockerd

from services.cpu_manager.docker.backend import DockerBackend
from services.cpu_manager.docker.config import DockerConfig


@pytest.fixture(scope="session")
def docker_engine() -> Iterator[Engine]:
    """A private dockerd with the test image; skips where none can run (fails when CI=true)."""
    local = LocalDockerd()
    try:
        engine = local.start()
    except EngineUnavailable as exc:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"Docker engine required in CI: {exc}")
        pytest.skip(f"no Docker engine can run here: {exc}")
    try:
        yield engine
    finally:
        local.stop()


@pytest.fixture
def docker_config(docker_engine: Engine, tmp_path: Path) -> Callable[..., DockerConfig]:
    """Build a config for a backend of its own (unique node id, so sweeps never collide)."""

    def make(**overrides: Any) -> DockerConfig:
        base: dict[str, Any] = {
            "root": str(tmp_path / "envs"),
            "docker_host": docker_engine.host,
            "node_id": f"t{uuid.uuid4().hex[:8]}",
            "incarnation": uuid.uuid4().hex[:8],
            "image": docker_engine.image,
            "mounts": docker_engine.mounts,
            "warm_pool": 0,
            "pool_memory_mb": 256,
        }
        base.update(overrides)
        return DockerConfig(**base)

    return make


@pytest.fixture
async def backend_factory(
    docker_config: Callable[..., DockerConfig],
) -> AsyncIterator[Callable[..., Any]]:
    """Start backends on demand; every one is closed at the end of the test."""
    started: list[DockerBackend] = []

    async def make(**overrides: Any) -> DockerBackend:
        backend = DockerBackend(docker_config(**overrides))
        started.append(backend)
        await backend.start()
        return backend

    yield make
    for backend in started:
        await backend.close()


@pytest.fixture(params=["executor", "docker_exec"])
async def backend(request: pytest.FixtureRequest, backend_factory: Any) -> DockerBackend:
    """A backend in each exec mode (executor + cgroup pinning; docker exec + docker update)."""
    if request.param == "executor":
        return await backend_factory(exec_mode="executor", cpuset_via="auto")
    return await backend_factory(exec_mode="docker_exec", cpuset_via="docker")
