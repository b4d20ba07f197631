"""The quota_manager's ``max_connections`` holds over all its sessions together (one per quota
allow-list), as the real rate-limited server sees it."""

from __future__ import annotations

import asyncio

from services.quota_manager.http import Call, Upstream
from tests.ratelimited_server import RateLimitedServer, ServerConfig

from ..support import eventually


async def test_max_connections_holds_over_every_session() -> None:
    async with RateLimitedServer(ServerConfig(per_second=10_000, concurrency=100)) as server:
        here = server.url.removeprefix("http://")
        # three allow-lists, so three sessions, each with a connector of its own
        lists = [(here,), (here, "a.example.com"), (here, "b.example.com")]
        upstream = Upstream(max_connections=2)
        try:
            server.gate.clear()  # every call that reaches the server stays in flight
            calls = [
                asyncio.ensure_future(
                    upstream.fetch(Call("GET", f"{server.url}/call", {}, b"", hosts, 1024))
                )
                for hosts in lists
                for _ in range(3)
            ]
            await eventually(
                lambda: (server.counters.in_flight, upstream.queued) == (2, 7),
                what="two calls at the server, the seven others waiting for a connection",
            )
            server.gate.set()
            answers = await asyncio.gather(*calls)
        finally:
            await upstream.close()
    assert [a.response.status for a in answers] == [200] * 9
    assert server.counters.peak_in_flight == 2
