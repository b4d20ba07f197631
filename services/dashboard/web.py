"""The dashboard's routes: pages for people, the same data as JSON under ``/api``; every one
behind the dashboard's token (:mod:`services.dashboard.guard`).

Query parameters decode into typed Structs (unknown or bad ones answer 400 naming the
problem); an unknown path answers 404; a failure behind a page answers 503 or 500 with its
reason. Nothing a request carries stops the server.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar
from urllib.parse import quote

import asyncpg
import msgspec
from aiohttp import web

from services.dashboard import guard, pages, queries
from services.dashboard.queries import ActionQuery, ActQuery
from tangram import db
from tangram.bus import BaseBus

log = logging.getLogger(__name__)

Q = TypeVar("Q", bound=msgspec.Struct)
Handler = guard.Handler

POOL = web.AppKey("pool", asyncpg.Pool)
BUS = web.AppKey("bus", BaseBus)


def app(pool: asyncpg.Pool, bus: BaseBus, token: str) -> web.Application:
    """The routes, each asking for ``token`` first (even a 404 is for a holder of it)."""
    application = web.Application(middlewares=[guard.Guard(token).middleware, errors])
    application[POOL] = pool
    application[BUS] = bus
    application.add_routes(
        [
            web.get("/", index),
            web.get("/actions", actions),
            web.get("/actions/{action_id}", action),
            web.get("/live", live),
            web.get("/act", act_plot),
            web.get("/api/actions", api_actions),
            web.get("/api/actions/{action_id}", api_action),
            web.get("/api/live", api_live),
            web.get("/api/act", api_act),
        ]
    )
    return application


class BadQuery(Exception):
    """A request's parameters that do not decode (answered 400)."""


def params(request: web.Request, typ: type[Q]) -> Q:
    """The query string as ``typ``; raises BadQuery naming the bad parameter."""
    try:
        return msgspec.convert(dict(request.query), typ, strict=False)
    except msgspec.ValidationError as exc:
        raise BadQuery(f"bad query parameter: {exc}") from None


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as a page (or JSON under /api) with its status and reason."""
    try:
        return await handler(request)
    except BadQuery as exc:
        return _error(request, 400, str(exc))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(request, exc.status, exc.reason)
    except Exception as exc:
        if db.transient(exc):
            return _error(request, 503, f"Postgres is unavailable: {exc}")
        log.exception("dashboard: %s failed", request.path)
        return _error(request, 500, "internal error; see the dashboard's log")


def _error(request: web.Request, status: int, message: str) -> web.Response:
    if request.path.startswith("/api/"):
        return web.json_response({"error": message}, status=status)
    return web.Response(
        text=pages.error_page(status, message), status=status, content_type="text/html"
    )


def _html(text: str) -> web.Response:
    return web.Response(text=text, content_type="text/html")


def _json(data: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), content_type="application/json")


async def index(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/actions")


async def actions(request: web.Request) -> web.Response:
    q = params(request, ActionQuery)
    rows = await queries.search(request.app[POOL], q)
    if q.id and len(rows) == 1 and rows[0].action_id == q.id:
        raise web.HTTPFound(f"/actions/{quote(q.id, safe='')}")
    return _html(pages.actions_page(q, rows))


async def _detail(request: web.Request) -> queries.ActionDetail:
    action_id = request.match_info["action_id"]
    if len(action_id) > 128:
        raise BadQuery("an action id has at most 128 characters")
    found = await queries.detail(request.app[POOL], action_id)
    if found is None:
        raise web.HTTPNotFound(reason=f"no action {action_id!r}")
    return found


async def action(request: web.Request) -> web.Response:
    return _html(pages.action_page(await _detail(request)))


async def live(request: web.Request) -> web.Response:
    return _html(pages.live_page(await queries.live(request.app[POOL], request.app[BUS])))


async def act_plot(request: web.Request) -> web.Response:
    q = params(request, ActQuery)
    series = await queries.act_series(request.app[POOL], q.minutes, q.buckets)
    return _html(pages.act_page(series, q.minutes))


async def api_actions(request: web.Request) -> web.Response:
    return _json(await queries.search(request.app[POOL], params(request, ActionQuery)))


async def api_action(request: web.Request) -> web.Response:
    return _json(await _detail(request))


async def api_live(request: web.Request) -> web.Response:
    return _json(await queries.live(request.app[POOL], request.app[BUS]))


async def api_act(request: web.Request) -> web.Response:
    q = params(request, ActQuery)
    return _json(await queries.act_series(request.app[POOL], q.minutes, q.buckets))
