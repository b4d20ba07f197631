"""Two hostile upstreams through a real mesh (gateway -> scheduler -> quota_manager, real
NATS and Postgres): one repeating a big header until the answer would not fit a bus message,
one echoing the API key where the caller's response cap cuts it. Each call must end, and no
byte of the key may reach the result or any table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tangram import QuotaSpec
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import running_mesh, tables_holding

pytestmark = pytest.mark.slow

SECRET = "sk-review-mesh-7b1d9e5a3c"
ENV_KEY = "REVIEW_KEY"
ENV = {ENV_KEY: SECRET, "TANGRAM_QUOTA_HEARTBEAT_S": "0.5"}


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """``/repeat``: 100 headers of 8000 bytes; else the Authorization header, echoed."""
    head = await reader.readuntil(b"\r\n\r\n")
    if head.startswith(b"GET /repeat"):
        headers, body = b"".join(b"X-A: " + b"v" * 8000 + b"\r\n" for _ in range(100)), b"ok"
    else:
        said = next(line for line in head.split(b"\r\n") if line.startswith(b"Authorization"))
        headers, body = b"", b"you said " + said
    length = f"Content-Length: {len(body)}\r\n".encode()
    writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n" + length + headers + b"\r\n" + body)
    await writer.drain()
    writer.close()


@pytest.fixture(scope="module")
async def rmesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    async with running_mesh(tmp_path_factory.mktemp("rmesh"), env=ENV) as m:
        yield m


async def test_hostile_answers_end_and_leave_no_key(rmesh: Mesh, uid: str) -> None:
    server = await asyncio.start_server(_answer, "127.0.0.1", 0)
    where = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with Client.connect(rmesh.nats_url) as c:
            name = f"rv{uid}"
            await c.set_quota(QuotaSpec(name, concurrency=4, hosts=(where,), api_key_env=ENV_KEY))
            # before the fix: an 800 KB answer, refused by the bus at every resend: never ended
            url = f"http://{where}/repeat"
            res = await c.http("GET", url, quota=name, job_id=uid, wait_s=20)
            assert res.ok, res
            assert res.http is not None
            assert res.http.body == b"ok"
            # before the fix: the key's first bytes, cut by the cap, reached the result
            cap = len(b"you said Authorization: Bearer ") + len(SECRET) - 1
            res = await c.http(
                "GET", f"http://{where}/echo", quota=name, job_id=uid, response_cap_bytes=cap
            )
            assert res.ok, res
            assert res.http is not None
            assert res.http.body == b"you said Authorization: Bearer [redacted]"
    finally:
        server.close()
    assert await tables_holding(rmesh.postgres_dsn, SECRET[:6]) == []
