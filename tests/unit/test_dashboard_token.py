"""The dashboard's token (services/dashboard/guard.py): no route answers without it; given once
as ``?token=`` it becomes an HttpOnly, SameSite=Strict cookie and a redirect to the URL without
it; a Bearer header does as well; where to find the URL is said on the 401 page; and the token
is made once, private, into the keyring, and printed by ``tangram dashboard``."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from services.dashboard import web as routes
from services.dashboard.config import DashboardConfig
from services.dashboard.service import token_of
from tangram import auth, cli, discovery
from tangram.errors import InvalidRequest

TOKEN = "s3cret-token_0123456789abcdefghijklmnop"


@pytest.fixture
async def http() -> AsyncIterator[TestClient[Any, Any]]:
    """The dashboard's routes (no pool or bus behind them: refused requests never reach one)."""
    app = routes.app(None, None, TOKEN)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        yield client


def data_paths(app: web.Application) -> list[str]:
    """A path of every route the dashboard serves (its pages and /api)."""
    paths = []
    for resource in app.router.resources():
        info = resource.get_info()
        path = info.get("path") or info["formatter"].replace("{action_id}", "some-action")
        paths.append(path)
    assert {"/actions", "/live", "/api/actions", "/api/live", "/actions/some-action"} <= set(paths)
    return paths


async def test_without_the_token_every_route_is_401_saying_where_it_is(
    http: TestClient[Any, Any],
) -> None:
    for path in [*data_paths(http.app), "/no/such/page"]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Cookie": "x=y"}):
            r = await http.get(path, headers=headers, allow_redirects=False)
            assert r.status == 401, (path, headers, r.status)
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
            text = await r.text()
            assert "tangram dashboard" in text
            assert "dashboard-token" in text
            if path.startswith("/api/"):
                assert "error" in json.loads(text)
    r = await http.get("/actions?token=wrong", allow_redirects=False)
    assert r.status == 401
    assert "not its token" in await r.text()
    assert not r.cookies


async def test_the_token_in_the_url_sets_a_strict_cookie_and_leaves_the_url(
    http: TestClient[Any, Any],
) -> None:
    r = await http.get(f"/actions?job=j1&token={TOKEN}", allow_redirects=False)
    assert r.status == 303
    assert r.headers["Location"] == "/actions?job=j1"  # the token gone, the rest kept
    cookie = r.headers["Set-Cookie"]
    assert "HttpOnly" in cookie
    assert "SameSite=Strict" in cookie
    assert TOKEN not in cookie  # a value derived from it
    # the cookie jar now holds it: the index answers (its redirect to /actions), 404s are said
    r = await http.get("/", allow_redirects=False)
    assert (r.status, r.headers["Location"]) == (302, "/actions")
    assert (await http.get("/no/such/page")).status == 404
    http.session.cookie_jar.clear()
    assert (await http.get("/", allow_redirects=False)).status == 401


async def test_a_bearer_header_is_taken(http: TestClient[Any, Any]) -> None:
    r = await http.get("/", headers={"Authorization": f"Bearer {TOKEN}"}, allow_redirects=False)
    assert r.status == 302
    r = await http.get("/", headers={"Authorization": f"Basic {TOKEN}"}, allow_redirects=False)
    assert r.status == 401


def test_the_token_is_configured_or_made_for_the_run(tmp_path: Path) -> None:
    assert token_of(DashboardConfig(token="given")) == ("given", False)
    path = auth.Keyring(tmp_path).dashboard_token()
    assert token_of(DashboardConfig(token_file=str(path))) == (path.read_text(), False)
    made, was_made = token_of(DashboardConfig())
    assert was_made
    assert len(made) >= 40
    with pytest.raises(InvalidRequest, match="cannot read the dashboard token"):
        token_of(DashboardConfig(token_file=str(tmp_path / "missing")))


def test_the_token_is_private_kept_and_printed_with_the_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ring = auth.Keyring(tmp_path)
    path = ring.dashboard_token()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    token = path.read_text()
    assert ring.dashboard_token() == path
    assert path.read_text() == token  # made once
    url_file = ring.write_dashboard_url("http://127.0.0.1:8265")
    assert url_file.read_text() == f"http://127.0.0.1:8265/?token={token}\n"
    assert stat.S_IMODE(url_file.stat().st_mode) == 0o600
    # mesh.json names the URL without it; `tangram dashboard` prints it with it
    monkeypatch.setenv("TANGRAM_STATE_DIR", str(tmp_path))  # main() sets it: restored after
    discovery.write_mesh(tmp_path, "nats://x", "", dashboard_url="http://127.0.0.1:8265")
    assert token not in (tmp_path / discovery.MESH_FILE).read_text()
    assert cli.main(["dashboard", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"http://127.0.0.1:8265/?token={token}\n"
    # compose: the token this environment's dashboard takes, at the URL given
    monkeypatch.setenv("TANGRAM_DASHBOARD_TOKEN", "from-env")
    assert cli.main(["dashboard", "--url", "http://h:1", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "http://h:1/?token=from-env\n"
    os.unlink(tmp_path / discovery.MESH_FILE)
    assert cli.main(["dashboard", "--state-dir", str(tmp_path)]) == 2
    assert "no mesh with a dashboard" in capsys.readouterr().err
