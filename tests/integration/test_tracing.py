"""One action = one trace: client, gateway, scheduler and node agent spans share a trace id.

The services export real OTLP/HTTP (protobuf) to a collector endpoint served by this test.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from tangram import telemetry
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually, running_mesh


class Collector:
    """An OTLP/HTTP endpoint: accepts POST /v1/traces and keeps (service, trace id, name)."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, str, dict[str, str]]] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                self._record(await reader.readexactly(length))
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                await writer.drain()
        writer.close()

    def _record(self, body: bytes) -> None:
        req = ExportTraceServiceRequest.FromString(body)
        for rs in req.resource_spans:
            attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for span in ss.spans:
                    sattrs = {a.key: a.value.string_value for a in span.attributes}
                    self.spans.append(
                        (attrs.get("service.name", ""), span.trace_id.hex(), span.name, sattrs)
                    )

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def traced_mesh(tmp_path: Path) -> AsyncIterator[tuple[Mesh, Collector]]:
    collector = Collector()
    await collector.start()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{collector.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    try:
        async with running_mesh(tmp_path / "mesh", env=env) as m:
            yield m, collector
    finally:
        await collector.close()


async def test_one_action_is_one_trace_across_every_hop(traced_mesh, uid: str):
    mesh, collector = traced_mesh
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    telemetry.setup("tangram-test-client", f"http://127.0.0.1:{collector.port}")
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "add_span_processor"):  # a provider set earlier: export here too
        exporter = OTLPSpanExporter(endpoint=f"http://127.0.0.1:{collector.port}/v1/traces")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    async with Client.connect(mesh.nats_url) as client:
        res = await client.exec(
            "echo traced", trajectory_id=uid, job_id=uid, action_id=f"{uid}-traced"
        )
    assert res.ok
    # in a thread: the exporter posts to the collector this event loop serves
    await asyncio.to_thread(provider.force_flush)  # type: ignore[attr-defined]
    await asyncio.to_thread(provider.shutdown)  # type: ignore[attr-defined]  # later tests export nothing
    wanted = {"tangram-gateway", "tangram-scheduler", "tangram-cpu_manager"}

    def whole_trace() -> tuple[set[str], set[str]]:
        services, names = _trace(collector, f"{uid}-traced")
        seen = {(svc, name) for svc, _, name, _ in collector.spans}
        assert wanted <= services, f"services {services}, names {names}; all spans: {seen}"
        assert any("Completion" in n for n in names), names
        return services, names

    # Each service exports in its own batches: wait for the whole trace.
    services, names = await eventually(whole_trace, what="every service's spans of the action")
    assert wanted <= services, services
    assert any("dispatch" in n.lower() or "Dispatch" in n for n in names), names
    assert any("Completion" in n for n in names), names


def _trace(collector: Collector, action_id: str) -> tuple[set[str], set[str]]:
    """The services and span names in the trace whose root carries ``action_id``."""
    # the client's span is the root (the services label their spans with the action id too)
    roots = [
        t
        for svc, t, _, a in collector.spans
        if svc == "tangram-test-client" and a.get("tangram.action_id") == action_id
    ]
    if not roots:
        return set(), set()
    spans = [(svc, name) for svc, t, name, _ in collector.spans if t == roots[0]]
    return {svc for svc, _ in spans}, {name for _, name in spans}
