"""The ops endpoint on a stand-in service, over real HTTP: readiness follows the service's state
and its dependency probes (bounded), liveness its loop, state gauges come from its hook; and
``mesh.json`` gains each service's metrics URL."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.metrics_core import Metric

from tangram import discovery, metrics, ops_http
from tangram.errors import TangramError
from tangram.runtime import Probe, Service, State


class Standin(Service):
    name = "standin"

    def __init__(self) -> None:
        super().__init__()
        self.probes: dict[str, Probe] = {}
        self.queued = 0

    def dependencies(self) -> Mapping[str, Probe]:
        return self.probes

    def collect(self) -> Iterable[Metric]:
        return metrics.queue_families({"node": self.queued}, {"node": 0})


async def ok() -> bool:
    return True


async def down() -> bool:
    raise ConnectionError("refused")


async def hangs() -> bool:
    await asyncio.Event().wait()
    return True


@pytest.fixture
async def served() -> AsyncIterator[tuple[Standin, str, aiohttp.ClientSession]]:
    svc = Standin()
    async with (
        ops_http.serving(svc, "127.0.0.1", 0) as server,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
    ):
        yield svc, server.url, http


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def test_ready_only_once_running_with_every_dependency_usable(
    served: tuple[Standin, str, aiohttp.ClientSession], monkeypatch: pytest.MonkeyPatch
):
    svc, url, http = served
    svc.probes = {"bus": ok}
    status, body = await get(http, f"{url}/readyz")
    assert (status, body["state"]) == (503, "new")
    await svc.start()
    status, body = await get(http, f"{url}/readyz")
    assert (status, body["checks"]) == (200, {"bus": True})
    monkeypatch.setattr(ops_http, "PROBE_TIMEOUT_S", 0.2)
    svc.probes = {"bus": ok, "postgres": down, "other": hangs}
    status, body = await get(http, f"{url}/readyz")
    assert (status, body["checks"]) == (503, {"bus": True, "postgres": False, "other": False})
    await svc.stop()


async def test_live_until_stopped(served: tuple[Standin, str, aiohttp.ClientSession]):
    svc, url, http = served
    status, body = await get(http, f"{url}/healthz")
    assert status == 200
    assert body["ok"] is True
    await svc.start()
    await svc.stop()
    status, body = await get(http, f"{url}/healthz")
    assert (status, body["state"]) == (503, State.STOPPED.value)


async def test_metrics_include_the_services_state_gauges(
    served: tuple[Standin, str, aiohttp.ClientSession],
):
    svc, url, http = served
    svc.queued = 7
    async with http.get(f"{url}/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    assert 'tangram_queue_length{queue="node"} 7.0' in text
    accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
    async with http.get(f"{url}/metrics", headers=accept) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        assert (await resp.text()).endswith("# EOF\n")


async def test_servers_in_turn_do_not_clash_and_close_is_idempotent():
    for _ in range(2):
        server = ops_http.OpsServer(Standin())
        await server.start()
        await server.close()
        await server.close()


async def test_a_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TangramError, match=f"127.0.0.1:{port}.*TANGRAM_OPS_PORT"):
            await ops_http.OpsServer(Standin(), port=port).start()


def test_mesh_json_gains_each_services_metrics_url(tmp_path: Path):
    discovery.write_mesh(tmp_path, "nats://x", "postgresql://y")
    url = discovery.metrics_url("http://127.0.0.1:1234/")
    assert url == "http://127.0.0.1:1234/metrics"
    assert discovery.update_mesh(tmp_path, metrics_urls={"gateway": url})
    assert discovery.update_mesh(tmp_path, metrics_urls={"scheduler": "u2"})
    info = json.loads((tmp_path / discovery.MESH_FILE).read_text())
    assert info["metrics_urls"] == {"gateway": url, "scheduler": "u2"}
    assert info["nats_url"] == "nats://x"


def test_a_mesh_json_of_another_process_is_left_alone(tmp_path: Path):
    assert not discovery.update_mesh(tmp_path, metrics_urls={"a": "b"})  # none there
    path = tmp_path / discovery.MESH_FILE
    path.write_text(json.dumps({"nats_url": "n", "pid": os.getppid()}))
    assert not discovery.update_mesh(tmp_path, metrics_urls={"a": "b"})
    assert "metrics_urls" not in json.loads(path.read_text())


class Broken(Standin):
    def collect(self) -> Iterable[Metric]:
        raise RuntimeError("a bug in the hook")


async def test_a_broken_state_hook_leaves_the_rest_of_metrics_served(
    caplog: pytest.LogCaptureFixture,
):
    async with (
        ops_http.serving(Broken(), "127.0.0.1", 0) as server,
        aiohttp.ClientSession() as http,
        http.get(f"{server.url}/metrics") as resp,
    ):
        assert resp.status == 200
        assert "process_cpu_seconds_total" in await resp.text()
    assert "state gauges failed" in caplog.text
