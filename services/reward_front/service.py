"""The reward front's shell: an aiohttp server whose requests become ``infer`` actions.

Routes (``SERVICE`` defaults to ``TANGRAM_REWARD_SERVICE``; a path may name another):

- ``POST /rm``, ``POST /services/{service}/rm``: slime's ``--rm-url``
- ``POST /get_reward``, ``POST /services/{service}/get_reward``: OpenRLHF's ``--remote_rm_url``
- ``GET /healthz``

Errors are translated in one middleware: a bad body is 400 with what is wrong, an unknown
service 404, an overloaded front or mesh or a failed node 503 with ``Retry-After``, a
reward handle that raised or answered something else 502; the front serves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
from aiohttp import web

from services.reward_front import config, endpoints
from services.reward_front.config import FrontConfig
from tangram.client import Client
from tangram.config import MeshConfig
from tangram.errors import Busy, CallerError, NotFound, TangramError, Unavailable
from tangram.integrations import rewards
from tangram.integrations.rewards import BadReward, Reward, RewardFailed, RewardQuery
from tangram.runtime import Service

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RewardFront(Service):
    name = "reward_front"

    def __init__(self, cfg: FrontConfig, client: Client) -> None:
        super().__init__()
        self.cfg = cfg
        self.client = client
        self.in_flight = 0
        self.runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[_errors])
        app.router.add_post("/rm", self.slime)
        app.router.add_post("/services/{service}/rm", self.slime)
        app.router.add_post("/get_reward", self.openrlhf)
        app.router.add_post("/services/{service}/get_reward", self.openrlhf)
        app.router.add_get("/healthz", self.healthz)
        return app

    async def on_start(self) -> None:
        self.runner = web.AppRunner(self.app(), access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.cfg.host, self.cfg.port)
        await site.start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        log.info("reward front on %s, scoring with %r", self.url, self.cfg.reward.service)

    async def on_stop(self, grace_s: float) -> None:
        if self.runner is not None:  # stops listening, then waits for requests in flight
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.runner.cleanup(), grace_s)

    # ------------------------------------------------------------------ routes

    async def slime(self, request: web.Request) -> web.Response:
        query = endpoints.slime_query(await request.read())
        (reward,) = await self._score(request, [query])
        return web.json_response(reward.score)

    async def openrlhf(self, request: web.Request) -> web.Response:
        queries = endpoints.openrlhf_queries(await request.read())
        return web.json_response(endpoints.openrlhf_body(await self._score(request, queries)))

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "service": self.cfg.reward.service})

    async def _score(self, request: web.Request, queries: list[RewardQuery]) -> list[Reward]:
        if self.in_flight >= self.cfg.max_in_flight:
            raise Busy(f"{self.in_flight} requests are being scored", retry_after_s=1.0)
        cfg = self.cfg.reward
        service = request.match_info.get("service")
        if service:
            cfg = msgspec.structs.replace(cfg, service=service)
        self.in_flight += 1
        try:
            return list(
                await asyncio.gather(*(rewards.score(self.client, q, cfg) for q in queries))
            )
        finally:
            self.in_flight -= 1


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as a JSON ``{error, code}`` with the status that says whose it is."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except endpoints.BadRequest as exc:
        return _error(400, str(exc), "bad_request")
    except (TangramError, RewardFailed) as exc:
        status, retry = _status(exc)
        if status >= 500:
            log.warning("%s %s: %s", request.method, request.path, exc.message)
        return _error(status, exc.message, exc.code, retry)


def _status(exc: TangramError) -> tuple[int, float | None]:
    """The HTTP status of a mesh error, and how long to wait before retrying it."""
    match exc:
        case RewardFailed(result=result) if result.error and result.error.kind == "invalid_request":
            return (404 if "unknown service" in result.error.message else 400), None
        case RewardFailed() if exc.retryable:
            return 503, 1.0
        case RewardFailed() | BadReward():
            return 502, None
        case NotFound():
            return 404, None
        case CallerError():
            return 400, None
        case Busy() | Unavailable():
            return 503, exc.retry_after_s or 1.0
    return 500, None


def _error(status: int, message: str, code: str, retry_after: float | None = None) -> web.Response:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return web.json_response({"error": message, "code": code}, status=status, headers=headers)


async def build(
    stack: contextlib.AsyncExitStack, overrides: Mapping[str, Any] | None = None
) -> tuple[MeshConfig, RewardFront]:
    """The front as configured by the environment and ``overrides`` (see runtime.Build),
    given its client of the mesh; ``stack`` closes the client after the front stopped."""
    mesh, cfg = config.load(overrides)
    client = await Client.connect(mesh.nats_url)
    stack.push_async_callback(client.close)
    return mesh, RewardFront(cfg, client)
