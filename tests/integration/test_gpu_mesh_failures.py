"""GPU failures through the whole mesh (gateway, scheduler, gpu_manager on two CPU devices):
a factory that never returns fails its registration at the gpu_manager's prepare timeout while
the node keeps serving, and a service that outgrows its measured footprint at run time is
re-measured and its call retried once on a larger chunk."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import ServiceSpec, ServiceState
from tangram.client import Client
from tangram.errors import InvalidRequest
from tangram.launcher import Mesh

from ..support import eventually
from .test_gpu_mesh_e2e import direct, user_mesh

pytestmark = pytest.mark.slow

MODULE = "tangram_failing_models"
CODE = textwrap.dedent(
    """
    import threading, torch

    STUCK = threading.Event()  # never set in the gpu_manager: stuck() never returns

    def _handle(model, payloads):
        device = next(model.parameters()).device
        return model(torch.tensor(payloads, dtype=torch.float32, device=device)).squeeze(1).tolist()

    def big():  # ~2.6 MB of state on a 4 MB device
        torch.manual_seed(1)
        l = torch.nn.Linear
        return torch.nn.Sequential(l(4, 800), torch.nn.Tanh(), l(800, 800), l(800, 1)), _handle

    def _growing(model, payloads):  # a 2 MB cache built on first use: prepare never saw it
        if "cache" not in model._buffers:
            device = next(model.parameters()).device
            model.register_buffer("cache", torch.zeros(500_000, device=device))
        return _handle(model, payloads)

    def grow():
        torch.manual_seed(2)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)), _growing

    def stuck():
        STUCK.wait()
        return big()
    """
)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    env = {
        "TANGRAM_GPU_CPU_DEVICES": "2",
        "TANGRAM_GPU_CPU_BUDGET_MB": "4",
        "TANGRAM_GPU_PREPARE_TIMEOUT_S": "1",
        "TANGRAM_SCHEDULER_POLICY": "min",  # each call its smallest DoP variant first
    }
    async with user_mesh(tmp_path, MODULE, CODE, env) as m:
        yield m


async def prepared(client: Client, spec: ServiceSpec) -> ServiceState:
    """Register ``spec`` and wait until the GPU node has it ready (a registration made before
    the node joined is answered at once; the node prepares it when it joins)."""
    await client.register_service(spec)

    async def ready() -> ServiceState | None:
        (state,) = [s for s in await client.list_services() if s.spec.name == spec.name]
        return state if state.prepared_on else None

    return await eventually(ready, what=f"{spec.name} prepared", timeout_s=60, interval_s=0.2)


async def test_a_stuck_factory_fails_its_registration_and_the_node_serves_on(mesh: Mesh, uid: str):
    x = [0.5, -1.0, 0.25, 2.0]
    timed_out = r"did not return within the prepare timeout of 1s"
    async with Client.connect(mesh.nats_url) as client:
        await prepared(client, ServiceSpec("big", f"{MODULE}:big"))  # the GPU node is up
        with pytest.raises(InvalidRequest, match=timed_out):
            await client.register_service(ServiceSpec("stuck", f"{MODULE}:stuck"))
        state = await client.register_service(ServiceSpec("other", f"{MODULE}:grow"))
        result = await client.infer("big", x, job_id=uid, timeout_s=60)
        listed = {s.spec.name: s for s in await client.list_services()}
    assert state.prepared_on  # prepared after the stuck one: the node prepares on
    assert result.status == "succeeded", result
    assert result.output == direct(MODULE, "big", x)
    assert "prepare timeout" in listed["stuck"].error
    assert mesh.procs["gpu_manager"].returncode is None


async def test_a_service_outgrowing_its_footprint_is_re_measured_and_retried_on_a_larger_chunk(
    mesh: Mesh, uid: str
):
    x = [0.5, -1.0, 0.25, 2.0]
    async with Client.connect(mesh.nats_url) as client:
        await prepared(client, ServiceSpec("big", f"{MODULE}:big"))
        measured = await prepared(client, ServiceSpec("grow", f"{MODULE}:grow", dops=(1, 2)))
        warm = await client.infer("big", x, job_id=uid, timeout_s=60)  # resident on GPU 0
        # grow fits GPU 0 beside big as measured; its pass adds 2 MB: over the 4 MB budget
        result = await client.infer("grow", x, job_id=uid, timeout_s=60)

        async def grown() -> ServiceState | None:
            (state,) = [s for s in await client.list_services() if s.spec.name == "grow"]
            return state if state.footprint_mb > measured.footprint_mb else None

        state = await eventually(grown, what="grow's footprint re-measured", interval_s=0.2)
        again = await client.infer("big", x, job_id=uid, timeout_s=60)
    assert warm.allocation is not None
    assert warm.allocation.gpus == (0,)
    assert result.status == "succeeded", result
    assert result.output == direct(MODULE, "grow", x)
    assert result.allocation is not None
    assert result.allocation.gpus == (0, 1)  # the retry, on the DoP-2 variant's chunk
    assert (measured.footprint_mb, state.footprint_mb) == (1, 2)  # its 2 MB cache counted
    assert again.status == "succeeded", again
    assert again.timings is not None
    assert again.timings.restore_s > 0  # big was evicted to make room for grow's cache
