"""Model services through the whole mesh: client.register_service and client.infer, outputs
equal to the model called directly (also right after an eviction and restore), unknown
services refused, concurrent calls co-batched into fewer forward passes, and a kill -9 of the
gpu_manager mid-call (re-queued, or node_died)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import ErrorKind, ServiceSpec, ServiceState
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually, running_mesh

pytestmark = pytest.mark.slow

MODULE = "tangram_e2e_models"
# the user models both GPU mesh modules serve (judge and rival: two seeds of one MLP)
MODELS = textwrap.dedent(
    """
    import os, time, torch

    def _mlp(seed):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 400), torch.nn.Tanh(), torch.nn.Linear(400, 400), torch.nn.Linear(400, 1))

    def _handle(model, payloads):
        return model(torch.tensor(payloads, dtype=torch.float32)).squeeze(1).tolist()

    def judge():
        return _mlp(1), _handle

    def rival():
        return _mlp(2), _handle

    """
)
CODE = MODELS + textwrap.dedent(
    """
    def paced():  # a tiny model whose pass costs a fixed 20 ms, as a kernel launch would
        def handle(model, payloads):
            time.sleep(0.02)
            return _handle(model, payloads)
        return _mlp(4), handle

    def stuck():
        def handle(model, payloads):
            open(os.environ["STUCK_MARKER"], "w").close()
            time.sleep(60)
            return _handle(model, payloads)
        return _mlp(3), handle
    """
)


@contextlib.asynccontextmanager
async def user_mesh(
    tmp_path: Path, module: str, code: str, env: dict[str, str]
) -> AsyncIterator[Mesh]:
    """A whole mesh whose gpu_manager (CPU devices, ``env`` over the defaults) has the user
    module ``module`` (source ``code``) on its PYTHONPATH, as this test process has."""
    user = tmp_path / "user"
    user.mkdir()
    (user / f"{module}.py").write_text(code)
    env = {
        "PYTHONPATH": os.pathsep.join([str(user), os.environ.get("PYTHONPATH", "")]),
        "TANGRAM_GPU_BACKEND": "cpu",
        "TANGRAM_GPU_HEARTBEAT_S": "0.5",
        "TANGRAM_GPU_TORCH_THREADS": "1",
        **env,
    }
    sys.path.insert(0, str(user))
    try:
        async with running_mesh(tmp_path / "mesh", env=env, gpu_manager=True) as m:
            yield m
    finally:
        sys.path.remove(str(user))
        sys.modules.pop(module, None)


def direct(module: str, name: str, x: list[float]) -> float:
    """The output of ``module.name``'s model called directly on ``x``."""
    model, handle = getattr(importlib.import_module(module), name)()
    return float(handle(model, [x])[0])


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    env = {
        "TANGRAM_GPU_CPU_DEVICES": "1",
        "TANGRAM_GPU_CPU_BUDGET_MB": "1",  # judge and rival never fit together
        "STUCK_MARKER": str(tmp_path / "stuck"),
    }
    async with user_mesh(tmp_path, MODULE, CODE, env) as m:
        yield m


async def test_infer_through_the_mesh_equals_the_model_also_after_eviction(mesh: Mesh, uid: str):
    x = [0.5, -1.0, 0.25, 2.0]
    async with Client.connect(mesh.nats_url) as client:
        for name in ("judge", "rival"):
            state = await client.register_service(ServiceSpec(name, f"{MODULE}:{name}"))
            assert not state.error
        results = [
            await client.infer(name, x, job_id=uid, timeout_s=60)
            for name in ("judge", "judge", "rival", "judge")
        ]
        unknown = await client.infer("nope", x, job_id=uid)
        listed = {s.spec.name for s in await client.list_services()}
    assert [r.status for r in results] == ["succeeded"] * 4, results
    assert [r.output for r in results] == [
        direct(MODULE, n, x) for n in ("judge", "judge", "rival", "judge")
    ]
    assert results[3].timings is not None
    assert results[3].timings.restore_s > 0  # rival evicted judge
    assert results[0].allocation is not None
    assert results[0].allocation.gpus == (0,)
    assert unknown.error is not None
    assert unknown.error.kind is ErrorKind.INVALID_REQUEST
    assert listed >= {"judge", "rival"}


async def test_concurrent_calls_to_a_resident_service_share_forward_passes(mesh: Mesh, uid: str):
    n = 16
    xs = [[i / n, 1.0, -1.0, 0.5] for i in range(n)]
    async with Client.connect(mesh.nats_url) as client:
        await client.register_service(ServiceSpec("paced", f"{MODULE}:paced", max_batch=8))
        warm = await client.infer("paced", xs[0], job_id=uid, timeout_s=60)
        assert warm.status == "succeeded", warm
        calls = [client.infer("paced", x, job_id=uid, timeout_s=60) for x in xs]
        results = await asyncio.gather(*calls)

        async def counted() -> ServiceState | None:
            (state,) = [s for s in await client.list_services() if s.spec.name == "paced"]
            return state if state.calls == n + 1 else None

        state = await eventually(
            counted, what="the agent to report the calls it ran", interval_s=0.2
        )
    assert [r.status for r in results] == ["succeeded"] * n, results
    # batched, a matmul may sum in another order than alone: equal to float32 rounding
    assert [r.output for r in results] == pytest.approx(
        [direct(MODULE, "paced", x) for x in xs], 1e-5
    )
    assert all(r.allocation is not None and r.allocation.gpus == (0,) for r in results)
    assert state.batches < n  # n concurrent calls (and a warm one) in fewer passes than n


async def test_kill_9_of_the_gpu_manager_mid_call(mesh: Mesh, uid: str, tmp_path: Path):
    async with Client.connect(mesh.nats_url) as client:
        await client.register_service(ServiceSpec("stuck", f"{MODULE}:stuck"))
        spec_id = f"{uid}-stuck"
        fut = client.infer("stuck", [0.0] * 4, job_id=uid, action_id=spec_id, timeout_s=120)
        task = asyncio.ensure_future(fut)
        await eventually((tmp_path / "stuck").exists, what="the call to run", timeout_s=60)
        await mesh.kill("gpu_manager")
        res = await asyncio.wait_for(task, 60)
    assert res.status == "failed"
    assert res.error is not None
    assert res.error.kind is ErrorKind.NODE_DIED  # it may have run: never silently re-run
