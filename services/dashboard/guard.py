"""Who may read the dashboard: whoever holds its token, as with Jupyter.

The pages show every client's commands, environments and outputs, and any local process can
connect to a loopback port, so every route asks for the token. A browser gives it once as
``?token=...``: the answer sets an HttpOnly, SameSite=Strict cookie and redirects to the same
URL without the token, so the token leaves the address bar and the history. A script gives it in
an ``Authorization: Bearer`` header. Tokens are compared in constant time. A missing or wrong one
gets a 401 page that says where the URL with the token is. The dashboard serves no /healthz,
/readyz or /metrics of its own: those are on the process's ops endpoint
(:mod:`tangram.ops_http`), a separate server, so no route here needs to stay open.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web

from services.dashboard import pages

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PARAM: Final = "token"
COOKIE_MAX_AGE_S: Final = 30 * 24 * 3600
WHERE: Final = (
    "Open the URL that `tangram up` printed (it ends in"
    " ?token=...), or print it again with `tangram dashboard --state-dir DIR`; the token is in"
    " DIR/auth/dashboard-token (compose: TANGRAM_DASHBOARD_TOKEN, else the dashboard-token file"
    " in the keys volume). Scripts send the header 'Authorization: Bearer TOKEN'."
)


def same(given: str, expected: bytes) -> bool:
    """Whether ``given`` is the expected secret (constant time: no prefix is timed)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected)


class Guard:
    """The token check in front of every route (an aiohttp middleware)."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the dashboard's token is empty")
        self._token = token.encode()
        # The cookie holds a value derived from the token, not the token: a browser's cookie
        # store never holds what logs a script in. Its name is this dashboard's own, so two
        # dashboards on one host (cookies ignore ports) do not log each other out.
        digest = hmac.new(self._token, b"tangram-dashboard-cookie", hashlib.sha256).hexdigest()
        self._session = digest.encode()
        self.cookie = f"tangram-dashboard-{hashlib.sha256(self._token).hexdigest()[:8]}"

    def allows(self, request: web.Request) -> bool:
        """Whether ``request`` carries the token (header) or the session cookie."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() == "bearer" and same(given.strip(), self._token):
            return True
        cookie = request.cookies.get(self.cookie)
        return cookie is not None and same(cookie, self._session)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        given = request.query.get(PARAM)
        if given is not None:
            if not same(given, self._token):
                return refused(request, "the token in this URL is not its token")
            return self.log_in(request)
        if not self.allows(request):
            return refused(request, "none was given")
        return await handler(request)

    def log_in(self, request: web.Request) -> web.Response:
        """The session cookie, and a redirect to the URL without the token."""
        target = request.rel_url.without_query_params(PARAM)
        response = web.Response(status=303, headers={"Location": str(target)})
        response.headers["Cache-Control"] = "no-store"
        response.set_cookie(
            self.cookie,
            self._session.decode(),
            max_age=COOKIE_MAX_AGE_S,
            path="/",
            httponly=True,
            samesite="Strict",
        )
        return response


def refused(request: web.Request, why: str) -> web.Response:
    """401: where the URL with the token is (JSON under /api)."""
    headers = {"WWW-Authenticate": 'Bearer realm="tangram dashboard"', "Cache-Control": "no-store"}
    message = f"This dashboard needs its token ({why}). {WHERE}"
    if request.path.startswith("/api/"):
        return web.json_response({"error": message}, status=401, headers=headers)
    page = pages.error_page(401, message)
    return web.Response(text=page, status=401, content_type="text/html", headers=headers)
