"""The dashboard's shell: stores the spans every service ships, and serves the pages.

One port (``TANGRAM_DASHBOARD_HOST``/``_PORT``, loopback by default), every page behind a
token (``TANGRAM_DASHBOARD_TOKEN`` or ``_TOKEN_FILE``: see guard.py); the span subscription
joins the ``dashboard`` queue group, so a second dashboard never writes a span twice.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

import asyncpg
from aiohttp import web
from nats.aio.msg import Msg

from services.dashboard import config
from services.dashboard import web as routes
from services.dashboard.config import DashboardConfig
from services.dashboard.spans import SpanWriter
from tangram import auth, db, subjects
from tangram.bus import BaseBus, open_bus
from tangram.config import MeshConfig
from tangram.contract.spans import SpanBatch
from tangram.errors import Unavailable
from tangram.runtime import Service

log = logging.getLogger(__name__)


class Dashboard(Service):
    name = "dashboard"

    def __init__(
        self,
        cfg: DashboardConfig,
        bus: BaseBus,
        pool: asyncpg.Pool,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.bus = bus
        self.pool = pool
        self.writer = SpanWriter(cfg, pool, clock)
        self.token, self._made = token_of(cfg)
        self._runner = web.AppRunner(routes.app(pool, bus, self.token), access_log=None)
        self.url = ""

    async def on_start(self) -> None:
        self.bus.serve(subjects.SPANS, self.on_spans, max_in_flight=1)
        await self.bus.start()
        self.spawn(self.writer.run(), "span-writer")
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.cfg.host, self.cfg.port)
        try:
            await site.start()
        except OSError as exc:
            raise Unavailable(
                f"dashboard cannot listen on {self.cfg.host}:{self.cfg.port}: {exc}"
            ) from exc
        port = self._runner.addresses[0][1] if self._runner.addresses else self.cfg.port
        self.url = f"http://{self.cfg.host}:{port}"
        if self._made:  # no one else knows it: say it where the operator started this
            log.warning(
                "dashboard on %s (no TANGRAM_DASHBOARD_TOKEN or _TOKEN_FILE: a token for this"
                " run only)",
                auth.login_url(self.url, self.token),
            )
        else:
            log.info(
                "dashboard on %s (its token: TANGRAM_DASHBOARD_TOKEN or _TOKEN_FILE)", self.url
            )

    async def on_spans(self, batch: SpanBatch, msg: Msg) -> None:
        self.writer.add(batch.spans)

    async def on_stop(self, grace_s: float) -> None:
        await self.bus.stop_serving(grace_s)
        await self._runner.cleanup()
        with contextlib.suppress(Exception):  # trace detail: never blocks a stop
            await self.writer.flush()


def token_of(cfg: DashboardConfig) -> tuple[str, bool]:
    """The token the pages ask for, and whether it was made here (none was configured); a
    token file named but unreadable stops the start (its error says which file)."""
    if cfg.token:
        return cfg.token, False
    if cfg.token_file:
        return auth.read_token(cfg.token_file), False
    return secrets.token_urlsafe(32), True


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, Dashboard]:
    """The dashboard as configured by the environment and ``overrides`` (see runtime.Build)."""
    mesh, cfg = config.load(overrides)
    pool = await db.open_pool(stack, mesh.postgres_dsn, max_size=4, name="dashboard")
    bus = await open_bus(stack, mesh.nats_url, "dashboard")
    return mesh, Dashboard(cfg, bus, pool)
