"""The client against a real mesh: submit-only use keeps no per-action state, and a retryable
error reply (the gateway's ``unavailable`` while Postgres is down) is retried within the
client's timeout instead of surfacing."""

from __future__ import annotations

import asyncio

import pytest

from tangram import ActionSpec, ExecAction
from tangram.client import Client
from tangram.launcher import Mesh

pytestmark = pytest.mark.slow


def spec(action_id: str, command: str = "echo hi") -> ActionSpec:
    return ActionSpec(
        action_id=action_id,
        job_id=action_id,
        trajectory_id=action_id,
        action=ExecAction(command=command),
    )


async def test_submit_only_use_keeps_no_waiters(mesh: Mesh, client: Client, uid: str):
    todo = [spec(f"{uid}-{i}") for i in range(20)]
    await asyncio.gather(*(client.submit(s) for s in todo))
    async with Client.connect(mesh.nats_url) as watcher:  # someone else awaits the results
        results = await asyncio.gather(*(watcher.result(s.action_id, timeout=30) for s in todo))
    assert all(r.ok for r in results)
    assert client._waiters == {}
    # A result pushed before anyone asks is still served (from the bounded cache or the gateway).
    assert (await client.result(todo[0].action_id, timeout=10)).ok
    assert client._waiters == {}


async def test_run_of_a_finished_duplicate_keeps_no_waiter(client: Client, uid: str):
    s = spec(f"{uid}-dup")
    first = await client.run(s)
    await client.result(s.action_id, timeout=10)  # from the gateway: its record is committed
    again = await client.run(s)  # the gateway answers with the finished result itself
    assert first.ok
    assert again.action_id == first.action_id
    assert client._waiters == {}


async def test_unavailable_reply_is_retried_within_the_timeout(
    mesh: Mesh, client: Client, uid: str
):
    assert mesh.pg is not None
    s = spec(f"{uid}-while-pg-down")
    await asyncio.to_thread(mesh.pg.kill)
    try:
        submitting = asyncio.ensure_future(client.submit(s))
        done, _ = await asyncio.wait([submitting], timeout=1.0)
        assert not done, submitting.exception()  # the gateway answers "unavailable": retried
    finally:
        await asyncio.to_thread(mesh.pg.start)
    ack = await submitting
    assert ack.action_id == s.action_id
    res = await client.result(s.action_id, timeout=60)
    assert res.ok, res.error
