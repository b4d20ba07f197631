"""A rate-limited HTTP API for tests and the bench: it enforces a rate (calls per second, a
sliding window over accepted calls) and a concurrency limit, and answers 429 with
``Retry-After`` when either is exceeded, as a real provider does.

``async with RateLimitedServer(ServerConfig(per_second=20, concurrency=4)) as server:`` serves
on ``server.url`` (127.0.0.1, a free port). ``/call`` (any method) is the API; ``/stats`` the
counters (200s and 429s per ``X-Job`` header, peak concurrency); ``/redirect?to=URL`` answers
302 to ``URL`` (for redirect-guard tests). ``server.gate`` holds accepted calls in flight while
cleared, so tests control concurrency without sleeping; ``clock`` may be injected so rate
tests do not depend on the machine's speed.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

from aiohttp import web


@dataclass(frozen=True)
class ServerConfig:
    """The limits the server enforces and how it reports them."""

    per_second: int = 10
    concurrency: int = 4
    latency_s: float = 0.0
    fractional_retry_after: bool = False
    report_remaining: bool = False


@dataclass
class Counters:
    """What the server saw, per caller (``X-Job``)."""

    ok: Counter[str] = field(default_factory=Counter)
    throttled: Counter[str] = field(default_factory=Counter)
    in_flight: int = 0
    peak_in_flight: int = 0
    arrived: int = 0  # every request to /call, answered or not
    peak_per_second: int = 0  # the most requests accepted within any one second
    credentials: set[str] = field(default_factory=set)  # Authorization values seen (not in /stats)

    def as_json(self) -> dict[str, object]:
        jobs = sorted(set(self.ok) | set(self.throttled))
        return {
            "jobs": {j: {"ok": self.ok[j], "throttled": self.throttled[j]} for j in jobs},
            "ok": sum(self.ok.values()),
            "throttled": sum(self.throttled.values()),
            "in_flight": self.in_flight,
            "peak_in_flight": self.peak_in_flight,
        }


class RateLimitedServer:
    """The server as an async context manager; see the module docstring."""

    def __init__(
        self, config: ServerConfig | None = None, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config or ServerConfig()
        self.clock = clock
        self.counters = Counters()
        self.gate = asyncio.Event()
        self.gate.set()
        self._accepted: deque[float] = deque()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> RateLimitedServer:
        app = web.Application()
        app.router.add_route("*", "/call", self._call)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/redirect", self._redirect)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.gate.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _call(self, request: web.Request) -> web.Response:
        job = request.headers.get("X-Job", "-")
        self.counters.arrived += 1
        if "Authorization" in request.headers:
            self.counters.credentials.add(request.headers["Authorization"])
        now = self.clock()
        self._expire(now)
        refusal = self._refusal(now)
        if refusal is not None:
            self.counters.throttled[job] += 1
            return self._throttled(*refusal)
        self._accepted.append(now)
        self.counters.peak_per_second = max(self.counters.peak_per_second, len(self._accepted))
        headers = self._remaining(now)
        self.counters.in_flight += 1
        self.counters.peak_in_flight = max(self.counters.peak_in_flight, self.counters.in_flight)
        try:
            await request.read()
            await self.gate.wait()
            if self.config.latency_s > 0:
                await asyncio.sleep(self.config.latency_s)  # the provider's service time
        finally:
            self.counters.in_flight -= 1
        self.counters.ok[job] += 1
        return web.json_response({"ok": True, "job": job}, headers=headers)

    def _expire(self, now: float) -> None:
        while self._accepted and self._accepted[0] + 1.0 <= now:
            self._accepted.popleft()

    def _refusal(self, now: float) -> tuple[str, float] | None:
        if self.counters.in_flight >= self.config.concurrency:
            return "concurrency", max(self.config.latency_s, 0.05)
        if len(self._accepted) >= self.config.per_second:
            return "rate", self._accepted[0] + 1.0 - now
        return None

    def _throttled(self, reason: str, wait_s: float) -> web.Response:
        retry = f"{wait_s:.3f}" if self.config.fractional_retry_after else str(math.ceil(wait_s))
        headers = {"Retry-After": retry, "X-Throttled-By": reason}
        return web.json_response({"ok": False, "reason": reason}, status=429, headers=headers)

    def _remaining(self, now: float) -> dict[str, str]:
        if not self.config.report_remaining:
            return {}
        reset = self._accepted[0] + 1.0 - now if self._accepted else 0.0
        left = self.config.per_second - len(self._accepted)
        return {"x-ratelimit-remaining": str(left), "x-ratelimit-reset": f"{reset:.3f}"}

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.counters.as_json())

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPFound(request.query.get("to", "/call"))


async def _serve(config: ServerConfig) -> None:
    """Serve until killed, the URL on the first line of stdout (see ``main``)."""
    async with RateLimitedServer(config) as server:
        print(server.url, flush=True)
        await asyncio.Event().wait()


def main() -> None:
    """``python -m tests.ratelimited_server --per-second N --concurrency N [--latency-s S]``:
    the server in a process of its own (the bench's, so the callers' process does not also
    serve the API they call), its URL printed first; SIGTERM stops it."""
    import argparse

    import uvloop

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--per-second", type=int, required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--latency-s", type=float, default=0.0)
    args = ap.parse_args()
    config = ServerConfig(args.per_second, args.concurrency, args.latency_s)
    uvloop.run(_serve(config))


if __name__ == "__main__":
    main()
