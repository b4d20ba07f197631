"""Every service of a running mesh serves /metrics, /healthz and /readyz over real HTTP, at the
URLs ``mesh.json`` names; counters move with actions, ACT histograms carry trace-id exemplars
in the OpenMetrics format, and bad requests are refused while the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as parse_openmetrics,
)
from prometheus_client.parser import text_string_to_metric_families as parse_text

from tangram import subjects
from tangram.client import Client
from tangram.contract import Accepted, Submit, codec, encode
from tangram.discovery import MESH_FILE
from tangram.launcher import Mesh

from ..support import eventually, exec_spec

# What each service's readiness checks (see their ``dependencies`` hooks).
NEEDS = {
    "gateway": ("bus", "postgres"),
    "scheduler": ("bus", "postgres"),
    "cpu_manager": ("bus",),
    "quota_manager": ("bus",),
    "gpu_manager": ("bus",),
}
OPENMETRICS = "application/openmetrics-text; version=1.0.0; charset=utf-8"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        yield session


def metrics_urls(mesh: Mesh) -> dict[str, str]:
    info = json.loads((mesh.opts.state_dir / MESH_FILE).read_text())
    return dict(info["metrics_urls"])


def base(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


async def scrape(http: aiohttp.ClientSession, url: str, accept: str = "") -> str:
    async with http.get(url, headers={"Accept": accept} if accept else {}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.text()


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one sample in the Prometheus text format (0 when absent)."""
    for family in parse_text(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def test_mesh_json_names_a_metrics_url_per_service(mesh: Mesh, http: aiohttp.ClientSession):
    urls = metrics_urls(mesh)
    assert set(urls) == set(mesh.procs)
    for key, url in urls.items():
        assert urlsplit(url).hostname == "127.0.0.1", key
        text = await scrape(http, url)
        assert "process_cpu_seconds_total" in text, key


async def test_counters_and_histograms_move_with_actions(
    mesh: Mesh, http: aiohttp.ClientSession, uid: str
):
    url = metrics_urls(mesh)["scheduler"]
    before = sample(await scrape(http, url), "tangram_actions_total", kind="exec")
    async with Client.connect(mesh.nats_url) as client:
        results = await asyncio.gather(
            *(client.exec("true", trajectory_id=f"{uid}-{k}", job_id=uid) for k in range(3))
        )
    assert all(r.ok for r in results)

    async def counted() -> bool:
        text = await scrape(http, url)
        return sample(text, "tangram_actions_total", kind="exec", status="succeeded") >= before + 3

    await eventually(counted, what="the scheduler to count 3 more exec actions")
    text = await scrape(http, url)
    for part in ("queue", "execution", "overhead"):
        assert sample(text, "tangram_act_part_seconds_count", kind="exec", part=part) >= 3
    assert sample(text, "tangram_act_seconds_count", kind="exec") >= 3
    assert sample(text, "tangram_units", node="node0", unit="core") >= 1
    assert "tangram_queue_length" in text
    agent = await scrape(http, metrics_urls(mesh)["cpu_manager.0"])
    assert sample(agent, "tangram_units", node="node0", unit="core") >= 1
    assert "tangram_units_busy" in agent


async def test_act_histograms_carry_the_trace_id_as_exemplar(
    mesh: Mesh, http: aiohttp.ClientSession, uid: str
):
    trace_id = uuid.uuid4().hex
    traceparent = f"00-{trace_id}-{uuid.uuid4().hex[:16]}-01"
    async with Client.connect(mesh.nats_url) as client:
        req = Submit(spec=exec_spec(uid, "traced", "true"), reply_subject=subjects.results(uid))
        raw = await client.bus.nc.request(
            subjects.GATEWAY.subject, encode(req), timeout=10, headers={"traceparent": traceparent}
        )
        assert isinstance(codec.decode(raw.data, subjects.GATEWAY.reply), Accepted)
        assert (await client.result(f"{uid}-traced", timeout=30)).ok
    url = metrics_urls(mesh)["scheduler"]

    async def exemplar() -> dict[str, str] | None:
        text = await scrape(http, url, accept=OPENMETRICS)
        assert text.rstrip().endswith("# EOF")
        for family in parse_openmetrics(text):
            if family.name != "tangram_act_seconds":
                continue
            for s in family.samples:
                if s.exemplar is not None and s.exemplar.labels.get("trace_id") == trace_id:
                    return s.labels
        return None

    labels = await eventually(exemplar, what=f"an exemplar with trace id {trace_id}")
    assert labels["kind"] == "exec"
    plain = await scrape(http, url)
    assert trace_id not in plain  # the Prometheus text format has no exemplars


async def test_every_service_is_live_and_ready(mesh: Mesh, http: aiohttp.ClientSession):
    for key, url in metrics_urls(mesh).items():
        async with http.get(f"{base(url)}/healthz") as resp:
            assert resp.status == 200, key
            health = await resp.json()
        assert health["ok"], (key, health)
        assert health["state"] == "running", (key, health)

        async def ready(url: str = url) -> dict[str, object] | None:
            async with http.get(f"{base(url)}/readyz") as resp:
                body = await resp.json()
                return body if resp.status == 200 else None

        body = await eventually(ready, what=f"{key} to be ready")
        checks = body["checks"]
        assert isinstance(checks, dict)
        if key.split(".")[0] in NEEDS:  # the services whose dependencies are wired here
            assert checks == dict.fromkeys(NEEDS[key.split(".")[0]], True), key


async def test_bad_requests_are_refused_and_the_server_keeps_serving(
    mesh: Mesh, http: aiohttp.ClientSession
):
    root = base(metrics_urls(mesh)["gateway"])
    async with http.get(f"{root}/no-such-path") as resp:
        assert resp.status == 404
    async with http.post(f"{root}/metrics", data=b"x" * 1000) as resp:
        assert resp.status == 405
    async with http.delete(f"{root}/readyz") as resp:
        assert resp.status == 405
    host, port = urlsplit(root).hostname, urlsplit(root).port
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"\x00\xffNOT HTTP AT ALL\r\n\r\n")
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert re.match(rb"HTTP/1\.[01] 400 ", answer), answer[:80]
    async with http.get(f"{root}/healthz") as resp:
        assert resp.status == 200
    assert "tangram_" in await scrape(http, f"{root}/metrics")
