"""The rate-limited test server enforces both of its limits and counts per caller."""

from __future__ import annotations

import asyncio
import sys
import time

import aiohttp
import pytest

from tests.ratelimited_server import RateLimitedServer, ServerConfig
from tests.support import eventually


async def call(session: aiohttp.ClientSession, url: str, job: str) -> tuple[int, dict[str, str]]:
    async with session.get(f"{url}/call", headers={"X-Job": job}) as resp:
        await resp.read()
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}


async def test_concurrency_limit_answers_429_while_calls_are_in_flight() -> None:
    async with (
        RateLimitedServer(ServerConfig(per_second=1000, concurrency=3)) as server,
        aiohttp.ClientSession() as session,
    ):
        server.gate.clear()
        tasks = [asyncio.create_task(call(session, server.url, f"j{i % 2}")) for i in range(10)]
        await eventually(
            lambda: sum(t.done() for t in tasks) == 7 and server.counters.in_flight == 3,
            what="7 refusals while 3 calls are held",
        )
        server.gate.set()
        results = await asyncio.gather(*tasks)
    statuses = sorted(status for status, _ in results)
    assert statuses == [200] * 3 + [429] * 7
    assert all("retry-after" in h for s, h in results if s == 429)
    assert server.counters.peak_in_flight == 3


async def test_rate_limit_with_an_injected_clock() -> None:
    now = [1000.0]
    config = ServerConfig(per_second=5, concurrency=100, report_remaining=True)
    async with (
        RateLimitedServer(config, clock=lambda: now[0]) as server,
        aiohttp.ClientSession() as session,
    ):
        first = [await call(session, server.url, ("a", "b")[i % 2]) for i in range(8)]
        now[0] += 0.5
        still = await call(session, server.url, "a")
        now[0] += 0.5
        later = [await call(session, server.url, "a") for _ in range(6)]
        async with session.get(f"{server.url}/stats") as resp:
            stats = await resp.json()
    assert [s for s, _ in first] == [200] * 5 + [429] * 3
    assert [h["x-ratelimit-remaining"] for _, h in first[:5]] == ["4", "3", "2", "1", "0"]
    assert first[5][1]["retry-after"] == "1"
    assert first[5][1]["x-throttled-by"] == "rate"
    assert still[0] == 429
    assert [s for s, _ in later] == [200] * 5 + [429]
    assert stats["jobs"] == {"a": {"ok": 8, "throttled": 3}, "b": {"ok": 2, "throttled": 2}}


async def test_rate_limit_in_real_time_never_exceeds_the_window() -> None:
    config = ServerConfig(per_second=20, concurrency=50, fractional_retry_after=True)
    async with RateLimitedServer(config) as server, aiohttp.ClientSession() as session:
        started = time.monotonic()
        results = [await call(session, server.url, "x") for _ in range(60)]
        elapsed = time.monotonic() - started
    ok = sum(s == 200 for s, _ in results)
    assert 20 <= ok <= 20 * (int(elapsed) + 1)
    retry = [float(h["retry-after"]) for s, h in results if s == 429]
    assert retry
    assert all(0 < r <= 1.0 for r in retry)


async def test_redirect_endpoint() -> None:
    async with RateLimitedServer() as server, aiohttp.ClientSession() as session:
        target = "http://example.invalid/x"
        async with session.get(
            f"{server.url}/redirect", params={"to": target}, allow_redirects=False
        ) as resp:
            assert resp.status == 302
            assert resp.headers["Location"] == target


async def test_the_server_in_a_process_of_its_own() -> None:
    """``python -m tests.ratelimited_server`` (the bench's): URL first, limits held, /stats
    counts; a bad argument is refused before it serves."""
    from bench.quota import ServerProcess

    async with ServerProcess(ServerConfig(per_second=2, concurrency=2)) as server:
        async with aiohttp.ClientSession() as session:
            statuses = [(await call(session, server.url, "j"))[0] for _ in range(3)]
        stats = await server.stats()
    assert statuses == [200, 200, 429]
    assert stats["jobs"] == {"j": {"ok": 2, "throttled": 1}}
    bad = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.ratelimited_server", "--per-second", "many",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await bad.communicate()
    assert bad.returncode == 2
    assert b"--per-second" in err


async def test_a_server_process_whose_start_is_cancelled_is_not_left_running() -> None:
    """The bench's server process is ended when its start fails or is cancelled (before its
    URL came), not left serving after the bench."""
    from bench.quota import ServerProcess

    server = ServerProcess(ServerConfig(per_second=2, concurrency=2))
    starting = asyncio.ensure_future(server.__aenter__())
    await eventually(lambda: server._proc is not None, what="spawned", interval_s=0.001)
    starting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await starting
    proc = server._proc
    assert proc is not None
    try:
        assert proc.returncode is not None, "left running"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
