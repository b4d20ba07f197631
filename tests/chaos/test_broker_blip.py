"""A short broker outage under load: every submit a user makes during it still succeeds (the
client's retry budget rides it out), and every action reaches exactly one terminal state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tangram import ActionSpec, ExecAction
from tangram.client import Client

from ..support import running_mesh

pytestmark = pytest.mark.slow

OUTAGE_S = 2.0  # the scenario: the broker is away this long (longer than the 1.5 s)


async def test_submits_ride_out_a_broker_restart(tmp_path: Path, uid: str) -> None:
    specs = [
        ActionSpec(
            action_id=f"{uid}-{i}",
            job_id=uid,
            trajectory_id=f"{uid}-t{i % 8}",
            action=ExecAction(command="true"),
        )
        for i in range(600)
    ]
    acked, some_acked = 0, asyncio.Event()

    async def submit(client: Client, spec: ActionSpec) -> None:
        nonlocal acked
        await client.submit(spec)
        acked += 1
        if acked >= 50:
            some_acked.set()

    async with running_mesh(tmp_path / "mesh") as mesh:
        assert mesh.nats is not None
        async with Client.connect(mesh.nats_url) as client:
            submits = asyncio.gather(*(submit(client, s) for s in specs), return_exceptions=True)
            await asyncio.wait_for(some_acked.wait(), 30)
            await asyncio.to_thread(mesh.nats.kill)
            await asyncio.sleep(OUTAGE_S)  # the outage itself
            await asyncio.to_thread(mesh.nats.start)
            outcomes = await submits
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            assert not failed, f"{len(failed)} submits failed, e.g. {failed[0]!r}"
            results = await asyncio.gather(
                *(client.result(s.action_id, timeout=120) for s in specs)
            )
    assert {r.status for r in results} <= {"succeeded", "failed"}
    assert [r.action_id for r in results] == [s.action_id for s in specs]
