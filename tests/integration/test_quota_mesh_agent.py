"""The quota_manager as its own process on the real bus, driven by a stand-in scheduler (as
tests/integration/test_drain_durability.py does), against the real rate-limited server:
it registers as a quota node, makes exactly one call per dispatch, keeps its API key out of
every message on the bus, refuses bad commands, and a kill -9 mid-call is never replayed by
the next incarnation (the scheduler alone decides a retry, spending quota for it)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from tangram import subjects
from tangram.bus import Bus
from tangram.contract import (
    Ack,
    ActionSpec,
    Completion,
    Dispatch,
    ErrorKind,
    HttpAction,
    NodeMessage,
    NodeReport,
    QuotaSpec,
    UnifiedAction,
    codec,
)
from tangram.launcher import Mesh
from tests.ratelimited_server import RateLimitedServer, ServerConfig

from ..support import eventually, running_mesh, unbatched

pytestmark = pytest.mark.slow

SECRET = "sk-live-quota-mesh-test-7f3a9c"
NODE = "quota-test"
ENV = {
    "TANGRAM_QUOTA_NODE_ID": NODE,
    "TANGRAM_QUOTA_HEARTBEAT_S": "0.5",
    "QUOTA_MESH_KEY": SECRET,
}


class StandIn:
    """Acks every node message, keeps reports and completions, and hears ALL bus traffic."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.reports: list[NodeReport] = []
        self.completions: list[Completion] = []
        self.wire: list[bytes] = []

    async def start(self) -> None:
        await self.bus.nc.subscribe(subjects.SCHED_NODES.subject, cb=self._on_msg)
        await self.bus.nc.subscribe(">", cb=self._on_any)
        await self.bus.nc.flush()

    async def _on_any(self, msg: Msg) -> None:
        self.wire.append(msg.subject.encode() + bytes(msg.data) + repr(msg.headers).encode())

    async def _on_msg(self, msg: Msg) -> None:
        for m in unbatched(codec.decode(msg.data, NodeMessage)):
            if isinstance(m, NodeReport):
                self.reports.append(m)
            elif isinstance(m, Completion):
                self.completions.append(m)
        if msg.reply:
            await self.bus.reply(msg, Ack())

    async def report(self, not_incarnation: str = "") -> NodeReport:
        def fresh() -> NodeReport | None:
            found = [r for r in self.reports if r.incarnation != not_incarnation]
            return found[-1] if found else None

        return await eventually(fresh, what="a quota node report", timeout_s=30)

    async def dispatch(self, report: NodeReport, aid: str, url: str, quota: QuotaSpec) -> None:
        action = HttpAction(method="GET", url=url, quota=quota.name, headers={"X-Job": aid})
        spec = ActionSpec(action_id=aid, job_id="j", trajectory_id="", action=action)
        ua = UnifiedAction(
            spec=spec,
            demands=(),
            key_resource=f"quota:{quota.name}",
            env_memory_mb=0,
            submitted_at=time.time(),
            attempt=1,
        )
        cmd = Dispatch(action=ua, epoch=1, incarnation=report.incarnation, quota=quota)
        await self.bus.publish(subjects.node(report.node_id), cmd)
        await self.bus.nc.flush()

    async def completion(self, aid: str) -> Completion:
        found = lambda: next((c for c in self.completions if c.action_id == aid), None)  # noqa: E731
        return await eventually(found, what=f"the completion of {aid}", timeout_s=30)


@pytest.fixture
async def quota_mesh(tmp_path: Path) -> AsyncIterator[tuple[Mesh, StandIn]]:
    async with running_mesh(tmp_path / "mesh", servers_only=True, env=ENV) as mesh:
        bus = await Bus.connect(mesh.nats_url, "stand-in-scheduler")
        standin = StandIn(bus)
        await standin.start()
        await mesh.start_service("quota_manager")
        try:
            yield mesh, standin
        finally:
            await mesh.stop_service("quota_manager")
            await bus.close()


def quota_for(server: RateLimitedServer, **kw: object) -> QuotaSpec:
    host = server.url.removeprefix("http://")
    return QuotaSpec("api", concurrency=4, hosts=(host,), **kw)  # type: ignore[arg-type]


async def test_one_call_per_dispatch_and_the_key_stays_in_the_agent(quota_mesh, uid):
    mesh, standin = quota_mesh
    report = await standin.report()
    assert report.inventory.kind == "quota"
    async with RateLimitedServer(ServerConfig(per_second=100, concurrency=4)) as server:
        quota = quota_for(server, api_key_env="QUOTA_MESH_KEY")
        await standin.dispatch(report, f"{uid}-ok", f"{server.url}/call", quota)
        done = await standin.completion(f"{uid}-ok")
        assert server.counters.arrived == 1
        assert server.counters.credentials == {f"Bearer {SECRET}"}
    assert done.outcome.failure is None
    assert done.outcome.http is not None
    assert done.outcome.http.status == 200
    assert standin.wire, "the bus tap heard nothing"
    assert not [w for w in standin.wire if SECRET.encode() in w], "the key went over the bus"
    log = (mesh.opts.state_dir / "logs" / "quota_manager.log").read_bytes()
    assert SECRET.encode() not in log


async def test_ssrf_through_the_mesh_is_a_typed_refusal(quota_mesh, uid):
    _, standin = quota_mesh
    report = await standin.report()
    async with RateLimitedServer() as server, RateLimitedServer() as other:
        quota = quota_for(server)
        cases = {
            "other-host": f"{other.url}/call",
            "file": "file:///etc/passwd",
            "metadata": "http://169.254.169.254/latest/meta-data",
            "redirect-off": f"{server.url}/redirect?to={other.url}/call",
            "by-name": f"http://localhost:{server.url.rsplit(':', 1)[1]}/call",
        }
        for name, url in cases.items():
            await standin.dispatch(report, f"{uid}-{name}", url, quota)
        for name in cases:
            outcome = (await standin.completion(f"{uid}-{name}")).outcome
            assert outcome.failure is ErrorKind.INVALID_REQUEST, (name, outcome)
        assert other.counters.arrived == 0


async def test_bad_commands_are_refused(quota_mesh):
    _, standin = quota_mesh
    await standin.report()
    nc = standin.bus.nc
    for junk in (b"", b"\xff\x00garbage", msgspec.msgpack.encode({"kind": "dispatch"})):
        reply = await nc.request(subjects.node(NODE).subject, junk, timeout=5)
        assert b"invalid_request" in reply.data, reply.data


async def test_kill_9_mid_call_is_not_replayed(quota_mesh, uid):
    mesh, standin = quota_mesh
    first = await standin.report()
    async with RateLimitedServer(ServerConfig(per_second=100, concurrency=4)) as server:
        server.gate.clear()
        await standin.dispatch(first, f"{uid}-held", f"{server.url}/call", quota_for(server))
        await eventually(lambda: server.counters.in_flight == 1, what="the call in flight")
        await mesh.kill("quota_manager")
        await mesh.start_service("quota_manager")
        second = await standin.report(not_incarnation=first.incarnation)
        server.gate.set()
        assert second.running == ()  # the new incarnation knows nothing of the killed call
        assert server.counters.arrived == 1  # and made no call of its own
    assert all(c.incarnation == first.incarnation for c in standin.completions)
