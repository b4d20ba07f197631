"""A factory that ends its process (``os._exit``: no exception to catch) through the whole
mesh, supervised as ``tangram up`` runs it: the gpu_manager dies building it, the supervisor
starts it again, the scheduler asks the new agent to build it once more, and after the second
death the registration fails naming what happened. The node is not restarted into the same
build for ever: it serves a good service after."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import ServiceSpec
from tangram.client import Client
from tangram.errors import InvalidRequest
from tangram.launcher import Mesh

from ..support import eventually
from .test_gpu_mesh_e2e import direct, user_mesh
from .test_gpu_mesh_failures import prepared

pytestmark = pytest.mark.slow

MODULE = "tangram_exiting_models"
CODE = textwrap.dedent(
    """
    import os, torch

    def _handle(model, payloads):
        return model(torch.tensor(payloads, dtype=torch.float32)).squeeze(1).tolist()

    def good():
        torch.manual_seed(3)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)), _handle

    def exits():
        os._exit(7)
    """
)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    env = {"TANGRAM_GPU_CPU_DEVICES": "1", "TANGRAM_GPU_CPU_BUDGET_MB": "16"}
    async with user_mesh(tmp_path, MODULE, CODE, env) as m:
        m.supervise()  # as `tangram up` runs it: what dies unexpectedly is started again
        yield m


async def test_a_factory_ending_the_process_fails_its_registration_after_two_deaths(
    mesh: Mesh, uid: str
) -> None:
    x = [0.5, -1.0, 0.25, 2.0]
    async with Client.connect(mesh.nats_url) as client:
        await prepared(client, ServiceSpec("good", f"{MODULE}:good"))  # the GPU node is up
        first = mesh.procs["gpu_manager"].pid
        with pytest.raises(InvalidRequest, match=r"ended 2 times in a row while it built"):
            await client.register_service(ServiceSpec("exits", f"{MODULE}:exits"))
        agent = mesh.procs["gpu_manager"]
        assert agent.pid != first  # it did die, and was started again
        state = await prepared(client, ServiceSpec("good", f"{MODULE}:good"))  # built again
        result = await client.infer("good", x, job_id=uid, timeout_s=60)
        listed = {s.spec.name: s for s in await client.list_services()}
    assert state.prepared_on
    assert result.status == "succeeded", result
    assert result.output == direct(MODULE, "good", x)
    assert "os._exit" in listed["exits"].error
    assert mesh.procs["gpu_manager"] is agent  # not restarted since
    assert agent.returncode is None

    async def calls_fail_at_once() -> bool:
        async with Client.connect(mesh.nats_url) as again:
            res = await again.infer("exits", x, job_id=uid, timeout_s=60)
        return res.status == "failed" and "ended 2 times" in (
            res.error.message if res.error else ""
        )

    await eventually(calls_fail_at_once, what="a call to the unbuildable service to fail")
    assert mesh.procs["gpu_manager"] is agent
