"""The dashboard in a real headless browser (Debian's chromium, driven by playwright) against a
running mesh: logging in with the URL `tangram up` prints (its token), search an action by id,
its trace waterfall from stored spans, the live view, the ACT plot; and over plain HTTP and
NATS, what bad requests get, and that nothing answers without the token. Screenshots are kept
under ``test-artifacts/screenshots/`` (gitignored)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
import msgspec
import pytest

from services.dashboard.config import DashboardConfig
from services.dashboard.spans import COLUMNS, SpanWriter
from tangram import subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import ErrorReply, codec, encode
from tangram.contract.spans import SpanBatch, SpanRecord
from tangram.launcher import Mesh

from ..support import eventually, exec_spec, running_mesh

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "screenshots"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """A mesh of this module's own, with its dashboard (and no quota agent: not shown here)."""
    async with running_mesh(
        tmp_path_factory.mktemp("mesh"), dashboard=True, quota_manager=False
    ) as m:
        yield m


def make_shots_dir() -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)


def chromium_present() -> bool:
    return CHROMIUM.exists()


@pytest.fixture(scope="module")
async def page(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Any]:
    """A page of a fresh headless chromium (its own user-data-dir)."""
    if not chromium_present():
        pytest.skip("/usr/bin/chromium is absent: run scripts/chromium.sh to install it")
    from playwright.async_api import async_playwright

    make_shots_dir()
    async with async_playwright() as pw:
        ctx = await pw.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium")),
            executable_path=str(CHROMIUM),
            args=ARGS,
            headless=True,
        )
        try:
            yield ctx.pages[0] if ctx.pages else await ctx.new_page()
        finally:
            await ctx.close()


async def get(url: str, token: str | None = None) -> tuple[int, str]:
    """GET ``url`` (with the dashboard's ``token``, as a script sends it)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.get(url, allow_redirects=False, headers=headers) as r,
    ):
        return r.status, await r.text()


async def logged_in(page: Any, mesh: Mesh) -> None:
    """Open the URL `tangram up` prints: the token leaves it, a cookie stays."""
    await page.goto(mesh.dashboard_login_url)
    assert page.url == f"{mesh.dashboard_url}/actions", page.url


async def dashboard_up(mesh: Mesh) -> None:
    async def answers() -> bool:
        try:
            return (await get(f"{mesh.dashboard_url}/actions", mesh.dashboard_token))[0] == 200
        except aiohttp.ClientError:
            return False

    await eventually(answers, what="the dashboard to answer", timeout_s=15)


async def stored_spans(mesh: Mesh, action_id: str, services: set[str]) -> dict[str, Any]:
    """The action's detail once its waterfall shows stored spans of every one of ``services``."""

    async def probe() -> dict[str, Any] | None:
        url = f"{mesh.dashboard_url}/api/actions/{action_id}"
        status, text = await get(url, mesh.dashboard_token)
        detail: dict[str, Any] = msgspec.json.decode(text) if status == 200 else {}
        bars = detail.get("waterfall", {}).get("bars", [])
        seen = {b["service"] for b in bars if b["kind"] == "span"}
        return detail if services <= seen else None

    return await eventually(probe, what=f"spans of {action_id} from {services}", timeout_s=10)


async def test_search_an_action_and_see_its_waterfall(
    mesh: Mesh, client: Client, page: Any
) -> None:
    uid = uuid.uuid4().hex[:8]
    ok = await client.run(exec_spec(uid, "ok", "echo hello"))
    bad = await client.run(exec_spec(uid, "bad", "exit 3"))
    assert ok.status == "succeeded"
    assert bad.status == "failed"
    await dashboard_up(mesh)
    await stored_spans(mesh, ok.action_id, {"tangram-gateway", "tangram-cpu_manager"})

    await logged_in(page, mesh)
    await page.fill("input[name=id]", ok.action_id)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"**/actions/{ok.action_id}")
    assert ok.action_id in await page.inner_text("h2")
    waterfall = page.locator("[data-testid=waterfall]")
    phases = await waterfall.locator("[data-kind=phase]").all_inner_texts()
    assert [p.split("\n")[0] for p in phases][:2] == ["submit", "queue"]
    assert any(p.startswith("exec") for p in phases)
    spans = "\n".join(await waterfall.locator("[data-kind=span]").all_inner_texts())
    assert "tangram-gateway: tangram.v1.gateway Submit" in spans
    assert "tangram-cpu_manager: tangram.v1.node." in spans
    await page.screenshot(path=str(SHOTS / "waterfall.png"), full_page=True)

    await page.goto(f"{mesh.dashboard_url}/actions?job={uid}")
    rows = await page.locator("[data-testid=actions] tr").all_inner_texts()
    assert len(rows) == 3  # the header and both actions
    assert any(bad.action_id in r and "failed" in r for r in rows)
    await page.screenshot(path=str(SHOTS / "actions.png"), full_page=True)


async def test_live_view_and_act_plot(mesh: Mesh, client: Client, page: Any) -> None:
    await client.run(exec_spec(uuid.uuid4().hex[:8], "live", "true"))
    await dashboard_up(mesh)
    await logged_in(page, mesh)
    await page.goto(f"{mesh.dashboard_url}/live")
    nodes = await page.inner_text("[data-testid=nodes]")
    assert "node0" in nodes
    assert "scheduler epoch" in await page.inner_text("[data-testid=summary]")
    await page.screenshot(path=str(SHOTS / "live.png"), full_page=True)
    await page.goto(f"{mesh.dashboard_url}/act?minutes=5")
    bars = page.locator("[data-testid=act-plot] rect title")
    assert await bars.count() > 0
    assert "actions" in " ".join(await bars.all_text_contents())
    await page.screenshot(path=str(SHOTS / "act.png"), full_page=True)


@pytest.mark.parametrize(
    ("path", "status", "says"),
    [
        ("/actions?limit=abc", 400, "limit"),
        ("/actions?limit=0", 400, "limit"),
        ("/actions?status=exploded", 400, "status"),
        ("/actions?colour=red", 400, "colour"),
        ("/act?minutes=-1", 400, "minutes"),
        ("/api/act?buckets=100000", 400, "buckets"),
        (f"/actions/{'x' * 200}", 400, "128"),
        ("/actions/no-such-action", 404, "no-such-action"),
        ("/no/such/page", 404, "Not Found"),
    ],
)
async def test_bad_requests_are_answered_and_it_keeps_serving(
    mesh: Mesh, path: str, status: int, says: str
) -> None:
    await dashboard_up(mesh)
    got, text = await get(mesh.dashboard_url + path, mesh.dashboard_token)
    assert (got, says in text) == (status, True), text[:500]
    assert (await get(f"{mesh.dashboard_url}/live", mesh.dashboard_token))[0] == 200


async def test_nothing_answers_without_the_token_and_the_url_with_it_logs_in(
    mesh: Mesh, page: Any
) -> None:
    """Any local process can reach the port: without the token every page and /api route is
    401 (saying where the URL is); the printed URL sets an HttpOnly, SameSite=Strict cookie."""
    await dashboard_up(mesh)
    assert mesh.dashboard_token not in (mesh.opts.state_dir / "mesh.json").read_text()
    paths = ["/", "/actions", "/actions/x", "/live", "/act", "/api/actions", "/api/actions/x"]
    for path in [*paths, "/api/live", "/api/act"]:
        status, text = await get(mesh.dashboard_url + path)
        assert status == 401, path
        assert "tangram dashboard" in text
        assert (await get(mesh.dashboard_url + path, "not-the-token"))[0] == 401
    jar = aiohttp.CookieJar(unsafe=True)  # a browser's: cookies of 127.0.0.1 kept
    async with aiohttp.ClientSession(cookie_jar=jar) as s:
        async with s.get(mesh.dashboard_login_url, allow_redirects=False) as r:
            assert r.status == 303
            assert r.headers["Location"] == "/"
            assert "HttpOnly" in r.headers["Set-Cookie"]
            assert "SameSite=Strict" in r.headers["Set-Cookie"]
        async with s.get(f"{mesh.dashboard_url}/api/live") as r:
            assert r.status == 200
            assert "scheduler" in await r.text()
    await logged_in(page, mesh)
    cookies = await page.context.cookies(mesh.dashboard_url)
    assert [(c["httpOnly"], c["sameSite"]) for c in cookies] == [(True, "Strict")]
    assert "Actions" in await page.inner_text("h2")


async def test_bad_span_batches_get_an_error_reply_and_good_ones_are_stored(mesh: Mesh) -> None:
    await dashboard_up(mesh)
    trace = uuid.uuid4().hex
    good = SpanBatch(
        spans=(
            SpanRecord(
                trace_id=trace,
                span_id="1" * 16,
                name="probe",
                service="test",
                start=time.time(),
                end=time.time(),
            ),
        )
    )
    bus = await Bus.connect(mesh.nats_url, "test-spans")
    try:
        for raw in (
            b"\xc1garbage",
            encode(SpanBatch(spans=())).replace(b"spans", b"spanz")[:3],
            encode(msgspec.structs.replace(good.spans[0], trace_id="NOT-HEX")),
        ):
            reply = await bus.nc.request(subjects.SPANS.subject, raw, timeout=5)
            err = codec.decode(reply.data, ErrorReply)
            assert err.code == "invalid_request", err
        await bus.publish(subjects.SPANS, good)
    finally:
        await bus.close()
    pool = await asyncpg.connect(mesh.postgres_dsn)
    try:
        await eventually(
            lambda: pool.fetchval("SELECT count(*) FROM spans WHERE trace_id = $1", trace),
            what="the good batch stored",
        )
    finally:
        await pool.close()


async def test_retention_bounds_the_span_table(mesh: Mesh) -> None:
    """Spans past the retention age go, then the oldest beyond ``max_spans``: the newest
    (the mesh's own) stay."""
    pool = await asyncpg.create_pool(mesh.postgres_dsn, min_size=1, max_size=2)
    assert pool is not None
    mark = uuid.uuid4().hex[:12]
    try:
        await pool.copy_records_to_table(
            "spans",
            records=[
                (mark, f"{i:016x}", "", "", "old", "test", 1000.0 + i, 1000.0 + i, False)
                for i in range(1500)
            ],
            columns=COLUMNS,
        )
        others = await pool.fetchval("SELECT count(*) FROM spans WHERE trace_id <> $1", mark)
        now = time.time()
        cfg = DashboardConfig(retention_s=now - 1500.0, max_spans=1000)
        await SpanWriter(cfg, pool, lambda: now).prune()
        mine = await pool.fetch("SELECT start_at FROM spans WHERE trace_id = $1", mark)
        assert min(r["start_at"] for r in mine) >= 1500.0  # past the age: gone
        assert len(mine) <= 1000 - min(others, 1000)  # beyond the row bound: the oldest gone
        after = await pool.fetchval("SELECT count(*) FROM spans WHERE trace_id <> $1", mark)
        assert after >= others
    finally:
        await pool.execute("DELETE FROM spans WHERE trace_id = $1", mark)
        await pool.close()
