"""Review of the quota surface as a hostile caller or provider would attack it: a key echoed
back and cut by the response cap, a redirect that downgrades https behind a URL with leading
whitespace, rate-limit headers that would pause a quota for years, token counts and repeated
headers past every bound. The HTTP tests run the
real executor against a real aiohttp server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from services.quota_manager.http import Upstream, tokens_used
from services.quota_manager.reach import check_redirect
from services.quota_manager.service import HttpExecutor
from services.scheduler.policies.quota_adaptive import parse_delay, parse_hints
from services.scheduler.policies.quota_limiter import Grant, Limiter
from tangram.contract import MAX_MESSAGE_BYTES, ErrorKind, QuotaSpec, encode
from tangram.contract.quota_rules import MAX_HEADER_BYTES
from tangram.errors import InvalidRequest

from .test_quota_agent import KEY_ENV, SECRET, dispatch

PREFIX = b"you said "
WALL = 1_700_000_000.0
DAY_S = 24 * 3600.0


@pytest.fixture
async def reflecting() -> AsyncIterator[str]:
    """An upstream that echoes the Authorization header it got, twice, in its body."""

    async def reflect(request: web.Request) -> web.Response:
        said = request.headers.get("Authorization", "").encode()
        return web.Response(body=PREFIX + said + b" and " + said)

    app = web.Application()
    app.router.add_get("/reflect", reflect)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def test_no_part_of_the_key_leaks_where_the_cap_cuts_it(reflecting: str) -> None:
    # A caller picks the cap so the cut falls inside the echoed key: before the fix the body
    # kept the key's first bytes (all but the last one with the right cap).
    ex = HttpExecutor(Upstream(), environ={KEY_ENV: SECRET})
    whole = PREFIX + b"Bearer [redacted] and Bearer [redacted]"
    try:
        for cap in range(len(PREFIX), len(PREFIX) + 3 * len(SECRET) + 20):
            url = f"http://{reflecting}/reflect"
            out = await ex.run(dispatch(url, (reflecting,), key=True, response_cap_bytes=cap))
            assert out.http is not None, out
            body = out.http.body
            assert whole.startswith(body), (cap, body)
            assert len(body) <= cap, (cap, body)
            assert out.http.body_truncated == (body != whole), cap  # kept short of the cap
            assert SECRET[:4].encode() not in encode(out), cap
        out = await ex.run(dispatch(url, (reflecting,), key=True, response_cap_bytes=1000))
        assert out.http is not None
        assert out.http.body == whole
        assert not out.http.body_truncated
    finally:
        await ex.close()


@pytest.mark.parametrize("url", [" https://a.com/x", "\thttps://a.com/x", "ht\ttps://a.com/x"])
def test_no_https_downgrade_behind_leading_whitespace(url: str) -> None:
    # urlsplit and yarl both strip these, so the first hop is https: its redirect may not be http
    with pytest.raises(InvalidRequest, match="from https down to http"):
        check_redirect("http://a.com/y", url, ("a.com",))


@pytest.mark.parametrize(
    "headers",
    [
        {"retry-after": "99999999"},
        {"retry-after": "1e308"},
        {"retry-after": "1" * 400 + "h"},  # float() of 400 digits is inf
        {"retry-after": "Fri, 31 Dec 9999 23:59:59 GMT"},
        {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "1e300"},
    ],
)
def test_a_hostile_delay_pauses_a_quota_a_day_at_most(headers: dict[str, str]) -> None:
    hints = parse_hints(headers, WALL)
    for delay in (hints.retry_after_s, hints.reset_s):
        assert delay is None or 0 <= delay <= DAY_S
    lim = Limiter(QuotaSpec("q", per_second=100))
    grant = lim.try_acquire(1, 0, 1.0)
    assert isinstance(grant, Grant)
    lim.observe(hints, 1.0)
    lim.release(grant, 1.0, status=429, retry_after_s=hints.retry_after_s)
    assert lim.next_free_at(1.0) <= 1.0 + DAY_S


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-5", "", "1e", "-1h", "0x10"])
def test_nonsense_delays_are_never_negative_or_infinite(value: str) -> None:
    delay = parse_delay(value, WALL)
    assert delay is None or 0 <= delay <= DAY_S


def test_a_reply_claiming_2_64_tokens_does_not_break_the_token_window() -> None:
    # Before the bound, 2**64 - 1 tokens swallowed the other calls' 1000 in the float sum:
    # once it expired the window counted nothing while they were still inside it.
    claimed = tokens_used(b'{"usage": {"total_tokens": 18446744073709551615}}')
    assert claimed is not None
    lim = Limiter(QuotaSpec("q", tokens_per_minute=10**9), margin_s=0.0)
    big, small = lim.try_acquire(1, 10, 0.0), lim.try_acquire(1, 1000, 0.0)
    assert isinstance(big, Grant)
    assert isinstance(small, Grant)
    lim.release(big, 1.0, sent_at=0.0, tokens_used=claimed)
    lim.release(small, 1.0, sent_at=1.0, tokens_used=1000)
    assert lim.tokens is not None
    assert lim.tokens.wait(10**9, 60.5, 1.0) == 61.0  # the 1000 sent at 1.0 still count


async def test_a_header_repeated_by_the_upstream_cannot_outgrow_the_message() -> None:
    # aiohttp lets 100 headers of 8000 bytes through; joined as repeats they made an 800 KB
    # outcome, past the bus's 512 KiB limit: its completion would be refused at every resend
    # and the action would never end.
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        repeated = b"".join(b"X-A: " + b"v" * 8000 + b"\r\n" for _ in range(100))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + repeated + b"\r\nok")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    where = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    ex = HttpExecutor(Upstream())
    try:
        out = await ex.run(dispatch(f"http://{where}/", (where,)))
    finally:
        await ex.close()
        server.close()
    assert out.http is not None, out
    assert out.http.body == b"ok"
    assert sum(len(k) + len(v) for k, v in out.http.headers.items()) <= MAX_HEADER_BYTES
    assert len(encode(out)) < MAX_MESSAGE_BYTES // 2


async def test_a_url_aiohttp_cannot_use_is_the_callers_error_not_a_retry(reflecting: str) -> None:
    # The allow-list check takes "127.0.0.1." as 127.0.0.1; aiohttp refuses the trailing dot of
    # an IPv4 literal. As upstream_failed (status None) the scheduler retried it, each try a
    # grant of the quota: it is the caller's invalid_request.
    host, port = reflecting.split(":")
    ex = HttpExecutor(Upstream())
    try:
        out = await ex.run(dispatch(f"http://{host}.:{port}/reflect", (reflecting,)))
    finally:
        await ex.close()
    assert out.failure is ErrorKind.INVALID_REQUEST, out
    assert "not a canonical IPv4 address" in out.detail


async def test_a_callers_accept_encoding_cannot_hide_an_echoed_key() -> None:
    # An honest echo endpoint answering in whatever coding the request accepts: with the
    # caller's Accept-Encoding passed on, it answered in one aiohttp does not decode, so the
    # echoed key came back encoded, past the scrub. The quota_manager now asks for what it
    # decodes itself whenever it adds a key.
    def rot13(data: bytes) -> bytes:
        return data.translate(bytes.maketrans(_ROT_FROM, _ROT_FROM[13:26] + _ROT_FROM[:13]))

    async def echo(request: web.Request) -> web.Response:
        said = request.headers.get("Authorization", "").encode()
        if "x-rot13" in request.headers.get("Accept-Encoding", ""):
            return web.Response(body=rot13(said), headers={"Content-Encoding": "x-rot13"})
        return web.Response(body=said)

    app = web.Application()
    app.router.add_get("/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host = f"127.0.0.1:{runner.addresses[0][1]}"
    ex = HttpExecutor(Upstream(), environ={KEY_ENV: SECRET})
    try:
        headers = {"accept-encoding": "x-rot13"}
        d = dispatch(f"http://{host}/echo", (host,), key=True, headers=headers)
        out = await ex.run(d)
        assert out.http is not None, out
        assert out.http.body == b"Bearer [redacted]", out.http.body
        assert rot13(SECRET.encode()) not in encode(out)
    finally:
        await ex.close()
        await runner.cleanup()


_ROT_FROM = b"abcdefghijklmnopqrstuvwxyz"
