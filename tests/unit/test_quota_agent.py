"""The quota agent's HTTP executor against real servers: the rate-limited test server and a
plain aiohttp app (echo, redirects, cookies, big bodies, a held call). SSRF attempts end as
typed ``invalid_request`` failures; the API key reaches the upstream and nothing else."""

from __future__ import annotations

import asyncio
import itertools
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import pytest
from aiohttp import web

from services.quota_manager.http import Upstream
from services.quota_manager.reach import MAX_REDIRECTS
from services.quota_manager.service import HttpExecutor
from tangram.contract import (
    ActionSpec,
    Dispatch,
    ErrorKind,
    ExecAction,
    HttpAction,
    Outcome,
    QuotaSpec,
    UnifiedAction,
    encode,
)
from tests.ratelimited_server import RateLimitedServer, ServerConfig

from ..support import eventually

SECRET = "sk-test-0123456789abcdef-SECRET"
KEY_ENV = "TEST_QUOTA_KEY"


@dataclass
class Upstream_:
    """A plain aiohttp app: what it saw, and a gate holding ``/hold`` calls."""

    url: str = ""
    port: int = 0
    seen: list[dict[str, str]] = field(default_factory=list)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    held: int = 0
    loops: int = 0


def _app(state: Upstream_) -> web.Application:
    async def echo(request: web.Request) -> web.Response:
        state.seen.append(dict(request.headers))
        body = await request.read()
        reply = {"method": request.method, "len": len(body), "usage": {"total_tokens": 42}}
        return web.json_response(reply, headers={"X-Seen": "yes"})

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query["to"])

    async def loop(request: web.Request) -> web.Response:
        state.loops += 1
        raise web.HTTPFound("/loop")

    async def cookie(request: web.Request) -> web.Response:
        resp = web.Response(text="ok")
        resp.set_cookie("session", "s3cr3t")
        return resp

    async def reflect(request: web.Request) -> web.Response:
        said = request.headers.get("Authorization", "")
        return web.Response(text=f"you said {said}", headers={"X-You-Said": said})

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=b"x" * 100_000)

    async def hold(request: web.Request) -> web.Response:
        state.held += 1
        await state.gate.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_route("*", "/echo", echo)
    app.router.add_get("/redirect", redirect)
    app.router.add_get("/loop", loop)
    app.router.add_get("/cookie", cookie)
    app.router.add_get("/big", big)
    app.router.add_get("/reflect", reflect)
    app.router.add_get("/hold", hold)
    return app


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream_]:
    state = Upstream_()
    runner = web.AppRunner(_app(state), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.port = runner.addresses[0][1]
    state.url = f"http://127.0.0.1:{state.port}"
    try:
        yield state
    finally:
        state.gate.set()
        await runner.cleanup()


@pytest.fixture
async def executor() -> AsyncIterator[HttpExecutor]:
    ex = HttpExecutor(Upstream(), environ={KEY_ENV: SECRET})
    await ex.start()
    try:
        yield ex
    finally:
        await ex.close()


def dispatch(
    url: str,
    hosts: tuple[str, ...],
    *,
    method: str = "GET",
    key: bool = False,
    aid: str = "a1",
    timeout_s: float = 10.0,
    **kw: object,
) -> Dispatch:
    quota = QuotaSpec("api", concurrency=8, hosts=hosts, api_key_env=KEY_ENV if key else None)
    action = HttpAction(method=method, url=url, quota="api", **kw)  # type: ignore[arg-type]
    spec = ActionSpec(
        action_id=aid, job_id="j", trajectory_id="", action=action, timeout_s=timeout_s
    )
    ua = UnifiedAction(
        spec=spec, demands=(), key_resource="quota:api", env_memory_mb=0, submitted_at=0.0
    )
    return Dispatch(action=ua, quota=quota)


def refused(outcome: Outcome, why: str) -> None:
    assert outcome.failure is ErrorKind.INVALID_REQUEST, outcome
    assert why in outcome.detail, outcome.detail
    assert outcome.http is None


def host_of(u: Upstream_) -> str:
    return f"127.0.0.1:{u.port}"


# ------------------------------------------------------------------ calls


async def test_a_call_returns_status_headers_body_and_tokens(executor, upstream):
    out = await executor.run(dispatch(f"{upstream.url}/echo", (host_of(upstream),)))
    assert out.failure is None
    assert out.http is not None
    assert out.http.status == 200
    assert out.http.headers["x-seen"] == "yes"
    assert msgspec.json.decode(out.http.body)["method"] == "GET"
    assert out.tokens_used == 42
    assert out.started_at is not None
    assert out.finished_at is not None


async def test_post_body_reaches_the_upstream(executor, upstream):
    d = dispatch(f"{upstream.url}/echo", (host_of(upstream),), method="POST", body=b"abc")
    out = await executor.run(d)
    assert out.http is not None
    assert msgspec.json.decode(out.http.body)["len"] == 3


async def test_the_rate_limited_server_429_is_a_fact_not_a_failure(executor):
    async with RateLimitedServer(ServerConfig(per_second=1, concurrency=4)) as server:
        hosts = (server.url.removeprefix("http://"),)
        first = await executor.run(dispatch(f"{server.url}/call", hosts, aid="x1"))
        second = await executor.run(dispatch(f"{server.url}/call", hosts, aid="x2"))
    assert first.http is not None
    assert first.http.status == 200
    assert second.failure is None
    assert second.http is not None
    assert second.http.status == 429
    assert "retry-after" in second.http.headers


async def test_body_capped_and_flagged(executor, upstream):
    d = dispatch(f"{upstream.url}/big", (host_of(upstream),), response_cap_bytes=1000)
    out = await executor.run(d)
    assert out.http is not None
    assert len(out.http.body) == 1000
    assert out.http.body_truncated


async def test_set_cookie_never_leaves_the_agent(executor, upstream):
    out = await executor.run(dispatch(f"{upstream.url}/cookie", (host_of(upstream),)))
    assert out.http is not None
    assert out.http.status == 200
    assert "set-cookie" not in out.http.headers
    assert b"s3cr3t" not in encode(out)


async def test_redirect_within_the_list_is_followed(executor, upstream):
    url = f"{upstream.url}/redirect?to={upstream.url}/echo"
    out = await executor.run(dispatch(url, (host_of(upstream),)))
    assert out.http is not None
    assert out.http.status == 200
    assert len(upstream.seen) == 1


async def test_unreachable_upstream_is_upstream_failed(executor):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = await executor.run(dispatch(f"http://127.0.0.1:{port}/", (f"127.0.0.1:{port}",)))
    assert out.failure is ErrorKind.UPSTREAM_FAILED
    assert out.detail


async def test_timeout_from_the_action(executor, upstream):
    d = dispatch(f"{upstream.url}/hold", (host_of(upstream),), timeout_s=0.3)
    out = await executor.run(d)
    assert out.failure is ErrorKind.EXEC_TIMEOUT


async def test_kill_cancels_the_call(executor, upstream):
    run = asyncio.create_task(executor.run(dispatch(f"{upstream.url}/hold", (host_of(upstream),))))
    await eventually(lambda: upstream.held == 1, what="the call to reach the upstream")
    await executor.kill("a1")
    out = await asyncio.wait_for(run, 5)
    assert out.failure is ErrorKind.CANCELLED


async def test_close_ends_calls_in_flight(upstream):
    ex = HttpExecutor(Upstream())
    run = asyncio.create_task(ex.run(dispatch(f"{upstream.url}/hold", (host_of(upstream),))))
    await eventually(lambda: upstream.held == 1, what="the call to reach the upstream")
    await ex.close()
    assert (await asyncio.wait_for(run, 5)).failure is ErrorKind.CANCELLED


async def test_a_session_in_use_is_never_closed_to_make_room(
    executor, upstream, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr("services.quota_manager.http.MAX_SESSIONS", 1)
    held = dispatch(f"{upstream.url}/hold", (host_of(upstream),), aid="held")
    run = asyncio.create_task(executor.run(held))
    await eventually(lambda: upstream.held == 1, what="the call to reach the upstream")
    other = dispatch(f"{upstream.url}/echo", (host_of(upstream), "example.org"), aid="other")
    assert (await executor.run(other)).failure is None  # a second allow-list: a second session
    upstream.gate.set()
    out = await asyncio.wait_for(run, 5)
    assert out.failure is None, out  # its session was not closed under it
    assert out.http is not None
    assert out.http.body == b"late"


def ticks() -> Callable[[], float]:
    """A clock reading 1, 2, 3, ... on successive calls (the run, the attempt, the send...)."""
    count = itertools.count(1)
    return lambda: float(next(count))


async def test_started_at_is_when_the_request_went_out(upstream):
    ex = HttpExecutor(Upstream(), clock=ticks())  # 1: run, 2: attempt, 3: sent, 4: answered
    try:
        out = await ex.run(dispatch(f"{upstream.url}/echo", (host_of(upstream),)))
    finally:
        await ex.close()
    assert (out.started_at, out.finished_at) == (3.0, 4.0)


async def test_a_call_never_sent_started_when_its_attempt_began():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ex = HttpExecutor(Upstream(), clock=ticks())  # 1: run, 2: attempt, 3: failed
    try:
        out = await ex.run(dispatch(f"http://127.0.0.1:{port}/", (f"127.0.0.1:{port}",)))
    finally:
        await ex.close()
    assert out.failure is ErrorKind.UPSTREAM_FAILED
    assert (out.started_at, out.finished_at) == (2.0, 3.0)


async def test_a_killed_call_reports_its_send(upstream):
    ex = HttpExecutor(Upstream(), clock=ticks())  # 1: run, 2: attempt, 3: sent, 4: killed
    try:
        run = asyncio.create_task(ex.run(dispatch(f"{upstream.url}/hold", (host_of(upstream),))))
        await eventually(lambda: upstream.held == 1, what="the call to reach the upstream")
        await ex.kill("a1")
        out = await asyncio.wait_for(run, 5)
    finally:
        await ex.close()
    assert out.failure is ErrorKind.CANCELLED
    assert (out.started_at, out.finished_at) == (3.0, 4.0)


# ------------------------------------------------------------------ secrets


async def test_api_key_sent_upstream_and_nowhere_else(executor, upstream):
    d = dispatch(
        f"{upstream.url}/echo",
        (host_of(upstream),),
        key=True,
        headers={"Authorization": "Bearer caller-supplied", "X-Job": "j"},
    )
    out = await executor.run(d)
    assert upstream.seen[-1]["Authorization"] == f"Bearer {SECRET}"
    assert SECRET.encode() not in encode(out)
    assert SECRET.encode() not in encode(d)


async def test_a_key_the_upstream_echoes_back_is_scrubbed(executor, upstream):
    out = await executor.run(dispatch(f"{upstream.url}/reflect", (host_of(upstream),), key=True))
    assert out.http is not None
    assert out.http.body == b"you said Bearer [redacted]"
    assert SECRET.encode() not in encode(out)


async def test_a_redirect_to_another_origin_does_not_carry_the_key(executor, upstream):
    hosts = (host_of(upstream), f"localhost:{upstream.port}")
    same = f"{upstream.url}/redirect?to={upstream.url}/echo"
    assert (await executor.run(dispatch(same, hosts, key=True))).failure is None
    assert upstream.seen[-1]["Authorization"] == f"Bearer {SECRET}"  # same origin: kept
    other = f"{upstream.url}/redirect?to=http://localhost:{upstream.port}/echo"
    assert (await executor.run(dispatch(other, hosts, key=True))).failure is None
    assert "Authorization" not in upstream.seen[-1]  # another host: dropped


async def test_missing_key_env_is_refused_by_name(upstream):
    ex = HttpExecutor(Upstream(), environ={})
    out = await ex.run(dispatch(f"{upstream.url}/echo", (host_of(upstream),), key=True))
    refused(out, KEY_ENV)
    assert upstream.seen == []
    await ex.close()


async def test_key_not_in_failures(upstream):
    ex = HttpExecutor(Upstream(), environ={KEY_ENV: SECRET})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = await ex.run(dispatch(f"http://127.0.0.1:{port}/", (f"127.0.0.1:{port}",), key=True))
    assert out.failure is ErrorKind.UPSTREAM_FAILED
    assert SECRET not in out.detail
    await ex.close()


# ------------------------------------------------------------------ SSRF


async def test_other_hosts_refused(executor, upstream):
    refused(await executor.run(dispatch(f"{upstream.url}/echo", ("api.example.com",))), "not in")
    assert upstream.seen == []


async def test_loopback_refused_when_not_listed(executor, upstream):
    out = await executor.run(dispatch(f"{upstream.url}/echo", ("127.0.0.1:1",)))
    refused(out, "not in this quota")


async def test_file_scheme_refused(executor):
    refused(await executor.run(dispatch("file:///etc/passwd", ("localhost",))), "scheme")


async def test_a_name_resolving_to_a_private_address_is_refused(executor, upstream):
    out = await executor.run(
        dispatch(f"http://localhost:{upstream.port}/echo", (f"localhost:{upstream.port}",))
    )
    refused(out, "non-public address")
    assert upstream.seen == []


async def test_redirect_off_the_list_refused(executor, upstream):
    url = f"{upstream.url}/redirect?to=http://169.254.169.254/latest/meta-data"
    refused(await executor.run(dispatch(url, (host_of(upstream),))), "not in this quota")


async def test_redirect_to_an_unlisted_port_refused(executor, upstream):
    async with RateLimitedServer() as other:
        url = f"{upstream.url}/redirect?to={other.url}/call"
        refused(await executor.run(dispatch(url, (host_of(upstream),))), "not in this quota")
        assert other.counters.ok == {}


async def test_redirect_loop_bounded(executor, upstream):
    out = await executor.run(dispatch(f"{upstream.url}/loop", (host_of(upstream),)))
    refused(out, "too many redirects")
    assert upstream.loops == MAX_REDIRECTS + 1


async def test_reserved_headers_refused(executor, upstream):
    d = dispatch(f"{upstream.url}/echo", (host_of(upstream),), headers={"Host": "evil.com"})
    refused(await executor.run(d), "set by tangram")


async def test_non_http_actions_and_missing_quota_refused(executor, upstream):
    d = dispatch(f"{upstream.url}/echo", (host_of(upstream),))
    refused(await executor.run(msgspec.structs.replace(d, quota=None)), "without its quota")
    spec = msgspec.structs.replace(d.action.spec, action=ExecAction(command="true"))
    exec_d = msgspec.structs.replace(d, action=msgspec.structs.replace(d.action, spec=spec))
    refused(await executor.run(exec_d), "not exec")
