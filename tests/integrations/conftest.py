"""One mesh for the adapter tests: a gpu_manager on CPU devices serving the example reward
service, and the reward front. The adapters find it as framework code would, through
``TANGRAM_NATS_URL`` (and the reward front's URL in the
``mesh.json`` of ``TANGRAM_STATE_DIR``)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import ServiceSpec
from tangram.client import Client
from tangram.integrations import clients
from tangram.launcher import Mesh

from ..support import running_mesh

GPU_ENV = {
    "TANGRAM_GPU_BACKEND": "cpu",
    "TANGRAM_GPU_HEARTBEAT_S": "0.5",
    "TANGRAM_GPU_TORCH_THREADS": "1",
}
REWARD = ServiceSpec("reward", "tangram.integrations.examples:reward_model", dops=(1,))


@pytest.fixture(scope="package")
async def reward_mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    root: Path = tmp_path_factory.mktemp("adapters")
    opts = {"gpu_manager": True, "reward_front": True, "quota_manager": False, "dashboard": False}
    async with running_mesh(root, env=GPU_ENV, **opts) as mesh:
        async with Client.connect(mesh.nats_url) as client:
            state = await client.register_service(REWARD)
            assert not state.error, state.error
        found = {"TANGRAM_NATS_URL": mesh.nats_url, "TANGRAM_STATE_DIR": str(root)}
        before = {k: os.environ.get(k) for k in found}
        os.environ.update(found)
        try:
            yield mesh
        finally:
            await clients.close_shared()
            clients.close_shared_sync()
            for key, value in before.items():
                if value is None:
                    del os.environ[key]
                else:
                    os.environ[key] = value
