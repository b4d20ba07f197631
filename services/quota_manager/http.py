"""One HTTP call under a quota, guarded end to end (the shell around ``reach.py``).

Every hop is checked by :mod:`~services.quota_manager.reach` before it is made: the URL
(scheme, allow-list, IP literals), then the address the name resolves to, inside the
connector's own resolver (:class:`GuardedResolver`), so the address checked is the address
connected to (no DNS rebinding between a check and the connect). The moment each request goes
out (its headers written, after the connection is ready) is noted in :class:`Sent`: the quota's
windows count sends, since that is what the provider counts. Redirects are followed here,
not by aiohttp, each target checked by the same rule, at most ``MAX_REDIRECTS``. The body read
is capped; ``Set-Cookie`` never leaves the agent and no cookie is ever kept between calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Final, NamedTuple

import aiohttp
import msgspec
from aiohttp.abc import AbstractResolver, ResolveResult
from multidict import CIMultiDictProxy
from yarl import URL

from services.quota_manager.reach import (
    MAX_REDIRECTS,
    check_address,
    check_redirect,
    for_origin,
)
from tangram.contract import HttpResponse, check_headers
from tangram.contract.hosts import Target, check_url
from tangram.contract.quota_rules import MAX_HEADER_BYTES, MAX_HEADERS
from tangram.errors import InvalidRequest

REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
DROPPED_HEADERS: Final = frozenset({"set-cookie", "set-cookie2"})
REDACTED: Final = b"[redacted]"
MAX_TOKENS: Final = 10**9  # the most tokens one reply may say it spent
MAX_SESSIONS: Final = 256  # one per (allow-list, scheme); the least recently used idle closes


class Call(NamedTuple):
    """What to send: the caller's method, URL, headers and body (the key already added)."""

    method: str
    url: str
    headers: dict[str, str]
    body: bytes
    hosts: tuple[str, ...]
    cap: int  # response body bytes kept
    secret: str = ""  # the API key in ``headers``: scrubbed from the body before it is cut


class Answer(NamedTuple):
    """The upstream's final answer and the tokens its JSON body says it spent."""

    response: HttpResponse
    tokens_used: int | None


class Sent:
    """When the latest request of a call went out (None: never), on ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.at: float | None = None

    def mark(self) -> None:
        self.at = self.clock()


class AddressRefused(OSError):
    """A resolved address the quota may not reach (aiohttp wraps it in a connector error)."""


class GuardedResolver(AbstractResolver):
    """Resolves through the system resolver and refuses every answer unless all its addresses
    pass :func:`check_address` for this allow-list and scheme."""

    def __init__(self, hosts: tuple[str, ...], scheme: str) -> None:
        self.hosts = hosts
        self.scheme = scheme
        self._inner = aiohttp.ThreadedResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        target = Target(f"{self.scheme}://{host}", self.scheme, host, port)
        for entry in found:
            try:
                check_address(target, entry["host"], self.hosts)
            except InvalidRequest as exc:
                raise AddressRefused(str(exc)) from None
        return found

    async def close(self) -> None:
        await self._inner.close()


_Key = tuple[tuple[str, ...], str]


class Upstream:
    """Sessions to the upstreams, one per (allow-list, scheme), and the guarded call.

    ``max_connections`` bounds the connections in use at once over ALL sessions: every hop
    holds one slot of a shared semaphore from its request until its answer is read (a
    connector's own ``limit`` counts its session alone). Idle keep-alive connections are not
    counted, as in aiohttp's limit; each closes after the connector's keep-alive timeout."""

    def __init__(
        self,
        *,
        max_connections: int = 1024,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self._slots = asyncio.Semaphore(max_connections)  # connections in use, all sessions
        self.queued = 0  # hops waiting for a slot
        self._trace = aiohttp.TraceConfig()
        self._trace.on_request_headers_sent.append(self._headers_sent)
        self._sessions: OrderedDict[_Key, aiohttp.ClientSession] = OrderedDict()
        self._users: dict[_Key, int] = {}  # calls using each session now

    async def fetch(self, call: Call, sent: Sent | None = None) -> Answer:
        """Make ``call``, following allowed redirects, noting in ``sent`` when each request
        went out; InvalidRequest when a hop is refused, aiohttp/OS errors when the upstream
        cannot be reached."""
        check_headers(call.headers)  # again: the gateway checked them without the key
        target = first = check_url(call.url, call.hosts)
        method, body = call.method, call.body
        for _ in range(MAX_REDIRECTS + 1):
            check_literal(target, call.hosts)
            async with (
                self._slot(),
                self._session(call.hosts, target.scheme) as session,
                session.request(
                    method,
                    URL(target.url, encoded=True),
                    headers=for_origin(call.headers, first, target),
                    data=body or None,
                    allow_redirects=False,
                    trace_request_ctx=sent,
                ) as resp,
            ):
                location = resp.headers.get("Location")
                if resp.status not in REDIRECTS or location is None:
                    return await answer(resp, call.cap, call.secret)
            target = check_redirect(location, target.url, call.hosts)
            method, body = redirected(resp.status, method, body)
        raise InvalidRequest(f"too many redirects (more than {MAX_REDIRECTS})")

    async def _headers_sent(
        self, session: aiohttp.ClientSession, ctx: SimpleNamespace, params: object
    ) -> None:
        # Called as the request's headers are handed to the connection, right before writing.
        sent = ctx.trace_request_ctx
        if isinstance(sent, Sent):
            sent.mark()

    async def close(self) -> None:
        while self._sessions:
            _, session = self._sessions.popitem()
            await session.close()

    @contextlib.asynccontextmanager
    async def _slot(self) -> AsyncIterator[None]:
        """One of the ``max_connections`` slots, held for one hop."""
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        try:
            yield
        finally:
            self._slots.release()

    @contextlib.asynccontextmanager
    async def _session(
        self, hosts: tuple[str, ...], scheme: str
    ) -> AsyncIterator[aiohttp.ClientSession]:
        """The session for an allow-list, held for one call: a session in use is never
        closed; past ``MAX_SESSIONS`` the least recently used idle ones are."""
        key = (hosts, scheme)
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = self._open(hosts, scheme)
        self._sessions.move_to_end(key)
        self._users[key] = self._users.get(key, 0) + 1
        try:
            yield session
        finally:
            self._users[key] -= 1
            await self._close_idle()

    async def _close_idle(self) -> None:
        while len(self._sessions) > MAX_SESSIONS:
            idle = next((k for k in self._sessions if not self._users.get(k)), None)
            if idle is None:
                return  # every one is in use: closed as their calls end
            self._users.pop(idle, None)
            await self._sessions.pop(idle).close()

    def _open(self, hosts: tuple[str, ...], scheme: str) -> aiohttp.ClientSession:
        # no DNS cache: every connect resolves (and checks) again; no cookie jar, no proxy env;
        # no limit of its own: the shared ``_slots`` bound every session together
        connector = aiohttp.TCPConnector(
            resolver=GuardedResolver(hosts, scheme), use_dns_cache=False, limit=0
        )
        return aiohttp.ClientSession(
            connector=connector,
            cookie_jar=aiohttp.DummyCookieJar(),
            trust_env=False,
            trace_configs=[self._trace],
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
        )


def check_literal(target: Target, hosts: tuple[str, ...]) -> None:
    """An IP-literal target is connected to without resolving: check its address here."""
    literal = target.host.strip("[]")
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in literal else socket.AF_INET, literal)
    except OSError:
        return  # a name: the resolver checks what it resolves to
    check_address(target, literal, hosts)


def redirected(status: int, method: str, body: bytes) -> tuple[str, bytes]:
    """The method and body of the next hop (RFC 9110 §15.4: 303 and a POST's 301/302 become
    a GET without body; 307/308 repeat the request)."""
    if (status == 303 and method != "HEAD") or (status in (301, 302) and method == "POST"):
        return "GET", b""
    return method, body


async def answer(resp: aiohttp.ClientResponse, cap: int, secret: str = "") -> Answer:
    """The upstream's answer, its body cut at ``cap`` bytes after ``secret`` is scrubbed from
    it: cut first, an echoed key would leave its first bytes (a caller picks the cap)."""
    body, more = await read_capped(resp.content, cap + len(secret))
    body = scrub(body, secret, cut=more)
    body, truncated = body[:cap], more or len(body) > cap
    response = HttpResponse(
        status=resp.status,
        headers=kept_headers(resp.headers),
        body=body,
        body_truncated=truncated,
    )
    return Answer(response, None if truncated else tokens_used(body))


async def read_capped(content: aiohttp.StreamReader, cap: int) -> tuple[bytes, bool]:
    """At most ``cap`` bytes of the body, and whether there was more (never reads past)."""
    chunks: list[bytes] = []
    size = 0
    while size <= cap:
        chunk = await content.read(cap + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)[:cap], size > cap


def scrub(body: bytes, secret: str, *, cut: bool = False) -> bytes:
    """``body`` with every ``secret`` replaced; when ``cut`` (more followed), also without
    the start of one it ends with. Read ``len(secret)`` past the cap, every key that starts
    before the cap is whole, so the body cut at the cap keeps no part of one."""
    if not secret:
        return body
    key = secret.encode()
    body = body.replace(key, REDACTED)
    if cut:
        body = body[: len(body) - _partial(body, key)]
    return body


def _partial(body: bytes, key: bytes) -> int:
    """The length of the longest start of ``key`` that ``body`` ends with."""
    return next((n for n in range(len(key) - 1, 0, -1) if body.endswith(key[:n])), 0)


def kept_headers(headers: CIMultiDictProxy[str]) -> dict[str, str]:
    """Response headers as one dict (repeats joined), without cookies, within the caps: a
    repeat counts too (100 repeats of 8 KB would make a result too big for the bus)."""
    kept: dict[str, str] = {}
    size = 0
    for name, value in headers.items():
        key = name.lower()
        if key in DROPPED_HEADERS or (key not in kept and len(kept) >= MAX_HEADERS):
            continue
        cost = len(value) + (2 if key in kept else len(key))
        if size + cost > MAX_HEADER_BYTES:
            continue
        kept[key] = f"{kept[key]}, {value}" if key in kept else value
        size += cost
    return kept


class _Usage(msgspec.Struct):
    total_tokens: int | None = None


class _LlmReply(msgspec.Struct):
    usage: _Usage | None = None


def tokens_used(body: bytes) -> int | None:
    """``usage.total_tokens`` of an LLM-style JSON reply, when there is one."""
    if not body.lstrip().startswith(b"{"):
        return None
    try:
        usage = msgspec.json.decode(body, type=_LlmReply).usage
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    total = usage.total_tokens if usage is not None else None
    # bounded as a lease's report is: 2**64 - 1 as a float would swallow every other entry of
    # the token window, which then undercounts once it expires
    return min(total, MAX_TOKENS) if total is not None and total >= 0 else None
