"""The ops HTTP endpoint of a service process: ``/metrics``, ``/healthz``, ``/readyz``.

One small aiohttp server per process, started before the service and stopped after it by the
runtime (:func:`tangram.runtime.run_service`), on ``TANGRAM_OPS_HOST``:``TANGRAM_OPS_PORT``
(default 127.0.0.1 and 0, a free port; the bound URL is logged). Routes:

- ``/metrics``: :data:`tangram.metrics.REGISTRY` and the service's own state gauges, in the
  OpenMetrics format when the scraper asks for it (exemplars show only there), else the
  Prometheus text format;
- ``/healthz``: 200 while the process is up and its event loop runs timers on time (answering
  at all proves the loop turns; a loop late by more than ``LAG_LIMIT_S`` is stuck on something),
  503 once the service has stopped;
- ``/readyz``: 200 when the service is running and each of its dependencies answers within
  ``PROBE_TIMEOUT_S`` (bus connected, Postgres pool usable), else 503 naming what is not.

Everything runs on the service's event loop and is bounded: a scrape reads the books without a
lock and builds a few dozen families; a readiness probe waits at most ``PROBE_TIMEOUT_S``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tangram import metrics
from tangram.errors import TangramError
from tangram.runtime import Probe, Service, State

if TYPE_CHECKING:
    import asyncpg

    from tangram.bus import BaseBus

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0
LAG_EVERY_S = 0.5  # how often the loop's lateness is measured
LAG_LIMIT_S = 5.0  # later than this, /healthz says the loop is stuck
SHUTDOWN_S = 2.0  # a request still in flight at close (a readiness probe) is given this long


class ServiceGauges(Collector):
    """The service's state gauges, built by its ``collect`` hook at each scrape."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self.service.collect())
        except Exception:  # a bug in a hook: the counters and histograms are still served
            log.exception("%s: state gauges failed; /metrics serves the rest", self.service.name)
            return []

    def describe(self) -> Iterable[Metric]:
        return ()  # not collected at registration: the service may not have started yet


class LoopLag:
    """How late the event loop runs a timer: measured every ``LAG_EVERY_S`` by a task."""

    def __init__(self) -> None:
        self.lag_s = 0.0
        self.at = time.monotonic()

    async def measure(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(LAG_EVERY_S)
            self.at = time.monotonic()
            self.lag_s = max(0.0, self.at - before - LAG_EVERY_S)
            metrics.LOOP_LAG.set(self.lag_s)


class OpsServer:
    """The ops endpoint of one service (see the module docstring)."""

    def __init__(
        self,
        service: Service,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: CollectorRegistry = metrics.REGISTRY,
    ) -> None:
        self.service = service
        self.host, self.port = host, port
        self.registry = registry
        self.url = ""
        self.lag = LoopLag()
        self._gauges = ServiceGauges(service)
        self._runner: web.AppRunner | None = None
        self._lag_task: asyncio.Task[None] | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.on_metrics)
        app.router.add_get("/healthz", self.on_healthz)
        app.router.add_get("/readyz", self.on_readyz)
        return app

    async def start(self) -> str:
        """Bind and serve; the base URL (a port in use is a TangramError naming it)."""
        runner = web.AppRunner(
            self.app(), access_log=None, handle_signals=False, shutdown_timeout=SHUTDOWN_S
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.host, self.port)
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise TangramError(
                f"ops endpoint: cannot listen on {self.host}:{self.port} ({exc.strerror});"
                " set TANGRAM_OPS_PORT (0: any free port)"
            ) from exc
        self._runner = runner
        port = runner.addresses[0][1]
        self.url = f"http://{_host_in_url(self.host)}:{port}"
        self.registry.register(self._gauges)
        self._lag_task = asyncio.get_running_loop().create_task(self.lag.measure(), name="ops-lag")
        log.info("%s: ops endpoint %s (/metrics, /healthz, /readyz)", self.service.name, self.url)
        return self.url

    async def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._lag_task is not None:
            self._lag_task.cancel()
            await asyncio.gather(self._lag_task, return_exceptions=True)
            self._lag_task = None
        if self._runner is not None:
            self.registry.unregister(self._gauges)
            await self._runner.cleanup()
            self._runner = None

    # ------------------------------------------------------------------ routes

    async def on_metrics(self, request: web.Request) -> web.Response:
        encoder, content_type = choose_encoder(request.headers.get("Accept", ""))
        body = encoder(self.registry)
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def on_healthz(self, request: web.Request) -> web.Response:
        late = time.monotonic() - self.lag.at - LAG_EVERY_S
        lag = max(self.lag.lag_s, late)
        state = self.service.state
        ok = state is not State.STOPPED and lag < LAG_LIMIT_S
        body = {"ok": ok, "state": state.value, "loop_lag_s": round(lag, 4)}
        return web.json_response(body, status=200 if ok else 503)

    async def on_readyz(self, request: web.Request) -> web.Response:
        checks = await probe_all(self.service.dependencies())
        running = self.service.state is State.RUNNING
        ok = running and all(checks.values())
        body = {"ready": ok, "state": self.service.state.value, "checks": checks}
        return web.json_response(body, status=200 if ok else 503)


def _host_in_url(host: str) -> str:
    """The host as a URL names it: a wildcard as the loopback address, IPv6 in brackets."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


async def probe_all(probes: Mapping[str, Probe]) -> dict[str, bool]:
    """Every probe at once, each bounded by ``PROBE_TIMEOUT_S``; a raise or a timeout is False."""
    names = list(probes)
    results = await asyncio.gather(*(_bounded(probes[n]) for n in names))
    return dict(zip(names, results, strict=True))


async def _bounded(probe: Probe) -> bool:
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            return bool(await probe())
    except Exception as exc:  # a probe that fails says "not ready", never breaks the route
        log.debug("readiness probe failed: %r", exc)
        return False


def bus_probe(bus: BaseBus) -> Probe:
    """Ready while the bus's broker connection is up (an in-memory bus always is)."""
    from tangram.bus import Bus

    async def connected() -> bool:
        return not isinstance(bus, Bus) or bus.nc.is_connected

    return connected


def pool_probe(pool: asyncpg.Pool) -> Probe:
    """Ready while a connection can be had from the pool and answers."""

    async def usable() -> bool:
        async with pool.acquire(timeout=PROBE_TIMEOUT_S) as conn:
            return bool(await conn.fetchval("SELECT 1") == 1)

    return usable


@contextlib.asynccontextmanager
async def serving(service: Service, host: str, port: int) -> AsyncIterator[OpsServer]:
    """An ops server for ``service`` while inside."""
    server = OpsServer(service, host, port)
    await server.start()
    try:
        yield server
    finally:
        await asyncio.shield(server.close())
