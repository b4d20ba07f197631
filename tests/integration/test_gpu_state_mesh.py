"""The state tiers through the whole mesh: a gpu_manager whose host tier holds one model (the
others on disk) serves exact outputs; calls queued behind a busy device make the scheduler
hint the node; bad hints on the real bus are refused and the node keeps serving."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from tangram import ServiceSpec, ServiceState
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract.state import Prefetch
from tangram.launcher import Mesh

from ..support import eventually
from .test_gpu_mesh_e2e import MODELS, direct, user_mesh

pytestmark = pytest.mark.slow

MODULE = "tangram_state_models"
CODE = MODELS + textwrap.dedent(
    """
    def slow():  # holds the only device while the others queue at the scheduler
        def handle(model, payloads):
            open(os.environ["SLOW_MARKER"], "w").close()
            time.sleep(0.5)
            return _handle(model, payloads)
        return torch.nn.Linear(4, 1), handle
    """
)


@pytest.fixture
async def mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    env = {
        "TANGRAM_GPU_NODE_ID": "gs0",
        "TANGRAM_GPU_CPU_DEVICES": "1",
        "TANGRAM_GPU_CPU_BUDGET_MB": "1",
        "TANGRAM_GPU_HOST_BUDGET_MB": "1",  # judge or rival, not both: the other on disk
        "TANGRAM_GPU_STATE_DIR": str(tmp_path / "store"),
        "SLOW_MARKER": str(tmp_path / "slow-running"),
    }
    async with user_mesh(tmp_path, MODULE, CODE, env) as m:
        yield m


async def test_queued_calls_are_hinted_and_served_exactly_through_disk(
    mesh: Mesh, uid: str, tmp_path: Path
):
    x = [0.5, -1.0, 0.25, 2.0]
    bus = await Bus.connect(mesh.nats_url, "hint-listener")
    hints: list[Prefetch] = []

    async def heard(msg: object) -> None:
        hints.append(msgspec.msgpack.decode(msg.data, type=Prefetch))  # type: ignore[attr-defined]

    await bus.nc.subscribe("tangram.v1.node.gs0.prefetch", cb=heard)
    try:
        async with Client.connect(mesh.nats_url) as client:
            for name in ("judge", "rival", "slow"):
                spec = ServiceSpec(name, f"{MODULE}:{name}", max_batch=1)
                assert not (await client.register_service(spec)).error
            store = tmp_path / "store"  # every tensor on disk once the node prepared them
            stored = lambda: store.exists() and len(list(store.iterdir())) >= 6  # noqa: E731
            await eventually(stored, what="the services in the disk tier", timeout_s=60)
            busy = asyncio.create_task(client.infer("slow", x, job_id=uid, timeout_s=60))
            running = tmp_path / "slow-running"
            await eventually(running.exists, what="slow holding the device", timeout_s=30)
            calls = [client.infer(n, x, job_id=uid, timeout_s=60) for n in ("judge", "rival")]
            results = await asyncio.gather(busy, *calls)
            await eventually(lambda: hints, what="a prefetch hint to gs0")
            for junk in (b"\x00garbage", msgspec.msgpack.encode({"type": "prefetch"})):
                reply = await bus.nc.request("tangram.v1.node.gs0.prefetch", junk, timeout=5)
                assert b"invalid_request" in reply.data
            again = await client.infer("judge", x, job_id=uid, timeout_s=60)

            async def reported() -> dict[str, ServiceState] | None:
                found = {s.spec.name: s for s in await client.list_services()}
                return found if found["judge"].calls == 2 else None  # next heartbeat

            listed = await eventually(reported, what="judge's calls reported")
    finally:
        await bus.close()
    assert [r.status for r in results] == ["succeeded"] * 3, results
    assert results[1].output == direct(MODULE, "judge", x)
    assert results[2].output == direct(MODULE, "rival", x)
    assert again.output == direct(MODULE, "judge", x)
    assert {i.name for h in hints for i in h.services} & {"judge", "rival"}
    # the hits reach the client with the calls
    assert sum(s.host_hits for s in listed.values()) >= 1
    assert all(s.device_hits <= s.calls for s in listed.values())
