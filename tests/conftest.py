"""Shared fixtures: real servers (nats-server and PostgreSQL from their wheels) and a real mesh
whose services run as their own processes, exactly as ``tangram up`` runs them. The helpers
behind them (``eventually``, ``running_mesh``) live in :mod:`tests.support`."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tangram.bus import Bus
from tangram.client import Client
from tangram.embedded import PG_TEMPLATE_VAR, EmbeddedNats
from tangram.launcher import Mesh

from .support import FAST_SERVICES, eventually, mesh_options, running_mesh

__all__ = ["FAST_SERVICES", "mesh_options", "running_mesh", "wait_for_file"]


async def wait_for_file(path: Path, timeout_s: float = 15.0) -> None:
    """Until an action has written ``path`` (it is in flight on its node), or fail."""
    await eventually(path.exists, what=f"{path} to appear", timeout_s=timeout_s)


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """One mesh per test module (tests use unique ids, so they can share it)."""
    async with running_mesh(tmp_path_factory.mktemp("mesh")) as m:
        yield m


@pytest.fixture
async def client(mesh: Mesh) -> AsyncIterator[Client]:
    async with Client.connect(mesh.nats_url) as c:
        yield c


@pytest.fixture
async def nats_url(tmp_path: Path) -> AsyncIterator[str]:
    """A nats-server of this test's own (no mesh): for tests of one service or the client."""
    server = await asyncio.to_thread(EmbeddedNats(tmp_path / "nats").start)
    try:
        yield server.url
    finally:
        await asyncio.to_thread(server.stop)


@pytest.fixture
async def raw_bus(nats_url: str) -> AsyncIterator[Bus]:
    """A bus on ``nats_url`` for a test that plays a service itself (a fake gateway)."""
    bus = await Bus.connect(nats_url, "fake-gateway")
    yield bus
    await bus.close()


@pytest.fixture
def open_state() -> Iterator[Path]:
    """A state dir under /tmp that the process backend's per-trajectory uids can pass through
    (pytest's own temporary directories are closed to other users)."""
    base = Path(tempfile.mkdtemp(prefix="tgs-", dir="/tmp"))
    os.chmod(base, 0o711)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def uid() -> str:
    """A unique prefix for this test's ids."""
    return uuid.uuid4().hex[:10]


def pytest_configure(config: pytest.Config) -> None:
    """Every Postgres cluster of this run (the tests' own and those of the meshes they start,
    which inherit the environment) is a copy of one made at the first: initdb once, not once
    per cluster. A run of the caller's choosing (the variable already set) is left alone."""
    if PG_TEMPLATE_VAR not in os.environ:
        os.environ[PG_TEMPLATE_VAR] = tempfile.mkdtemp(prefix="tangram-pg-template-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop(PG_TEMPLATE_VAR), True))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TANGRAM_SKIP_SLOW") == "1":
        skip = pytest.mark.skip(reason="TANGRAM_SKIP_SLOW=1")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
