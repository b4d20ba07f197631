"""Quotas across restarts, through a real mesh (real Postgres, the real quota_manager) and the
real rate-limited server: a scheduler killed -9 while a call is in flight rebuilds the quota's
windows and the call from Postgres (the call is made once, its window stays spent); a task
cancelled inside a lease, while the gateway is down, still releases the unit."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import asyncpg
import pytest

from tangram import QuotaSpec, subjects
from tangram.client import Client
from tangram.contract import ErrorKind, GatewayRequest, ReleaseLease
from tangram.launcher import Mesh
from tests.ratelimited_server import RateLimitedServer, ServerConfig

from ..support import eventually, running_mesh, spying

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
async def rmesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    env = {"TANGRAM_QUOTA_HEARTBEAT_S": "0.5"}
    async with running_mesh(tmp_path_factory.mktemp("rmesh"), env=env) as m:
        yield m


async def _state(client: Client, name: str) -> tuple[int, int]:
    state = next(q for q in await client.list_quotas() if q.spec.name == name)
    return state.in_use, state.calls


async def test_a_scheduler_killed_mid_call_rebuilds_windows_and_the_call(rmesh, uid):
    async with (
        RateLimitedServer(ServerConfig(per_second=1000, concurrency=100)) as server,
        Client.connect(rmesh.nats_url) as client,
    ):
        name = f"w{uid}"
        here = server.url.removeprefix("http://")
        await client.set_quota(QuotaSpec(name, concurrency=2, per_minute=2, hosts=(here,)))
        url = f"{server.url}/call"
        first = await client.http("GET", url, quota=name, job_id=uid)
        assert first.ok
        # durable as finished, so the restart counts it from its history alone
        await eventually(
            lambda: _status(rmesh, first.action_id, "succeeded"),
            what="the first call durably finished",
        )
        server.gate.clear()
        flying = asyncio.ensure_future(client.http("GET", url, quota=name, job_id=uid, wait_s=90))
        await eventually(lambda: server.counters.in_flight == 1, what="the call in flight")
        await rmesh.kill("scheduler")
        await rmesh.start_service("scheduler")
        await rmesh.wait_ready()
        server.gate.set()
        result = await asyncio.wait_for(flying, 90)
        assert result.ok, result
        await eventually(lambda: _done(client, name), what="the restored call's unit free")
        # a quota agent serves the new scheduler (so a queue timeout below is the window's)
        await client.set_quota(QuotaSpec(f"{name}-open", concurrency=1, hosts=(here,)))
        assert (await client.http("GET", url, quota=f"{name}-open", job_id=uid, wait_s=30)).ok
        # the two calls sent before the restart still fill the per-minute window
        late = await client.http("GET", url, quota=name, job_id=uid, queue_timeout_s=1.5)
        assert late.error is not None
        assert late.error.kind is ErrorKind.QUEUE_TIMEOUT
        assert server.counters.arrived == 3  # the call in flight was made once


async def _status(mesh: Mesh, action_id: str, status: str) -> bool:
    conn = await asyncpg.connect(mesh.postgres_dsn)
    try:
        found = await conn.fetchval("SELECT status FROM actions WHERE action_id = $1", action_id)
    finally:
        await conn.close()
    return bool(found == status)


async def _done(client: Client, name: str) -> bool:
    in_use, _ = await _state(client, name)
    return in_use == 0


async def test_a_lease_cancelled_while_the_gateway_is_down_is_still_released(rmesh, uid):
    """The task is cancelled inside the lease and again while its release waits for the
    gateway: the release goes on (shielded, owned by the client) and lands once the gateway
    is back, so the unit is free long before the lease's TTL."""
    name = f"c{uid}"
    async with Client.connect(rmesh.nats_url, request_timeout=120.0) as client:
        await client.set_quota(QuotaSpec(name, concurrency=1))
        inside = asyncio.Event()

        async def hold() -> None:
            async with client.lease(name, job_id=uid, ttl_s=600):
                inside.set()
                await asyncio.Event().wait()

        task = asyncio.ensure_future(hold())
        await inside.wait()
        await rmesh.kill("gateway")
        async with spying(rmesh.nats_url, subjects.GATEWAY.subject, GatewayRequest) as seen:
            task.cancel()  # inside the lease: its release goes out and finds no gateway
            await eventually(
                lambda: any(isinstance(m, ReleaseLease) for m in seen),
                what="the release on its way",
            )
            task.cancel()  # again, while the release waits for an answer
            with pytest.raises(asyncio.CancelledError):
                await task
        await rmesh.start_service("gateway")
        await rmesh.wait_ready()
        async with client.lease(name, job_id=uid, wait_s=20) as lease:
            assert lease.grant.units == 1
