"""Shared fixtures: real servers (nats-server and PostgreSQL from their wheels) and a real mesh
whose services run as their own processes, exactly as ``tangram up`` runs them."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram.client import Client
from tangram.launcher import Mesh, MeshOptions

FAST_SERVICES = {
    "TANGRAM_SCHEDULER_NODE_TIMEOUT_S": "3",
    "TANGRAM_SCHEDULER_RECONCILE_GRACE_S": "0.5",
    "TANGRAM_SCHEDULER_SWEEP_S": "1",
    "TANGRAM_CPU_HEARTBEAT_S": "0.5",
}


async def wait_for_file(path: Path, timeout_s: float = 15.0) -> None:
    """Until an action has written ``path`` (it is in flight on its node), or fail."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(path.exists):
        assert time.monotonic() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.02)


def mesh_options(root: Path, **kw: object) -> MeshOptions:
    env = dict(FAST_SERVICES)
    env.update(kw.pop("env", {}) or {})  # type: ignore[arg-type]
    kw.setdefault("backend", "process")
    return MeshOptions(state_dir=root, fsync=False, env=env, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """One mesh per test module (tests use unique ids, so they can share it)."""
    m = Mesh(mesh_options(tmp_path_factory.mktemp("mesh")))
    try:
        await m.start()
        yield m
    finally:
        await m.stop()


@pytest.fixture
async def client(mesh: Mesh) -> AsyncIterator[Client]:
    async with Client.connect(mesh.nats_url) as c:
        yield c


@pytest.fixture
def uid() -> str:
    """A unique prefix for this test's ids."""
    return uuid.uuid4().hex[:10]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TANGRAM_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="TANGRAM_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
