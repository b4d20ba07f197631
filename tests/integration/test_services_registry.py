"""Registration and infer through the real gateway and scheduler on NATS and Postgres, against a
FAKE GPU agent (a test double speaking the agent protocol: it prepares what it is told, fails
factories from the ``broken`` module, and answers each dispatch with its payload and GPUs)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from nats.aio.msg import Msg

from services.gateway.config import GatewayConfig
from services.gateway.service import Gateway
from services.scheduler.config import SchedulerConfig
from services.scheduler.core.scheduler import CoreConfig
from services.scheduler.service import Scheduler
from tangram import db, subjects
from tangram.bus import Bus, decode_reply
from tangram.contract import (
    Accepted,
    Ack,
    ActionResult,
    ActionSpec,
    Completion,
    Dispatch,
    GetResult,
    GpuDevice,
    InferAction,
    Inventory,
    ListServices,
    NodeCommand,
    NodeReport,
    Outcome,
    Prepare,
    PreparedService,
    Reconcile,
    RegisterService,
    Services,
    ServiceSpec,
    Submit,
)
from tangram.embedded import EmbeddedNats, EmbeddedPostgres
from tangram.errors import InvalidRequest, TangramError

from ..support import commands_in, eventually

pytestmark = pytest.mark.slow


class FakeGpuAgent:
    """Node ``g0`` with 4 GPUs: reports on every command and every 0.3 s."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.prepared: dict[tuple[str, int], PreparedService] = {}
        self.dispatches: list[Dispatch] = []
        bus.serve(subjects.node("g0"), self.on_command)
        bus.serve(subjects.NODES_BROADCAST, self.on_command)

    def report(self) -> NodeReport:
        inv = Inventory(
            kind="gpu",
            gpus=tuple(GpuDevice(index=i, memory_mb=1000) for i in range(4)),
            restore_gb_per_s=5.0,
        )
        return NodeReport(
            node_id="g0",
            incarnation="fake",
            inventory=inv,
            full=True,
            services=tuple(self.prepared.values()),
        )

    async def send_report(self) -> None:
        await self.bus.request(subjects.sched_node("g0"), self.report())

    async def on_command(self, cmd: NodeCommand, msg: Msg) -> Ack:
        for one in commands_in(cmd):
            self.on_one(one)
        return Ack()

    def on_one(self, cmd: NodeCommand) -> None:
        match cmd:
            case Prepare(services=specs):
                for spec in specs:
                    for d in spec.dops:
                        err = "ModuleNotFoundError: No module named 'broken'"
                        bad = spec.factory.startswith("broken")
                        self.prepared[spec.name, d] = PreparedService(
                            name=spec.name, dop=d, footprint_mb=100 * d, error=err if bad else ""
                        )
                asyncio.get_running_loop().create_task(self.send_report())
            case Dispatch():
                self.dispatches.append(cmd)
                asyncio.get_running_loop().create_task(self.complete(cmd))
            case Reconcile():
                asyncio.get_running_loop().create_task(self.send_report())

    async def complete(self, d: Dispatch) -> None:
        assert isinstance(d.action.spec.action, InferAction)
        assert d.service is not None
        out = {"echo": d.action.spec.action.payload, "gpus": list(d.gpus)}
        done = Completion(
            node_id="g0",
            incarnation="fake",
            action_id=d.action.spec.action_id,
            attempt=d.action.attempt,
            outcome=Outcome(output=out, started_at=1.0, finished_at=1.5, restore_s=0.1),
        )
        await self.bus.request(subjects.sched_node("g0"), done)

    async def heartbeat(self) -> None:
        while True:
            await self.send_report()
            await asyncio.sleep(0.3)


@pytest.fixture(scope="module")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, str]]:
    root: Path = tmp_path_factory.mktemp("registry")
    pg = await asyncio.to_thread(EmbeddedPostgres(root / "pg", fsync=False).start)
    nats = await asyncio.to_thread(EmbeddedNats(root / "nats").start)
    try:
        pool = await db.connect(pg.dsn, max_size=2)
        await db.migrate(pool)
        await pool.close()
        yield pg.dsn, nats.url
    finally:
        await asyncio.to_thread(nats.stop)
        await asyncio.to_thread(pg.stop)


@contextlib.asynccontextmanager
async def scheduler(dsn: str, url: str) -> AsyncIterator[Scheduler]:
    pool = await db.connect(dsn, max_size=6)
    cfg = SchedulerConfig(
        policy="min", reconcile_grace_s=0.2, core=CoreConfig(prepare_timeout_s=5.0)
    )
    bus = await Bus.connect(url, "scheduler")
    s = Scheduler(cfg, bus, pool)
    try:
        async with s:
            yield s
    finally:
        await bus.close()
        await pool.close()


@pytest.fixture
async def mesh(servers: tuple[str, str]) -> AsyncIterator[tuple[Bus, FakeGpuAgent, str, str]]:
    dsn, url = servers
    gw_pool = await db.connect(dsn, max_size=5)
    agent = FakeGpuAgent(await Bus.connect(url, "fake-gpu"))
    await agent.bus.start()
    beat = asyncio.create_task(agent.heartbeat())
    client = await Bus.connect(url, "client")
    gw_bus = await Bus.connect(url, "gateway")
    try:
        async with scheduler(dsn, url):
            async with Gateway(GatewayConfig(), gw_bus, gw_pool):
                yield client, agent, dsn, url
    finally:
        beat.cancel()
        await client.close()
        await gw_bus.close()
        await agent.bus.close()
        await gw_pool.close()


async def raw_request(bus: Bus, request: dict[str, Any]) -> Any:
    msg = await bus.nc.request(subjects.GATEWAY.subject, msgspec.msgpack.encode(request), 10)
    return decode_reply(subjects.GATEWAY.subject, msg.data, subjects.GATEWAY.reply)


async def infer(bus: Bus, aid: str, service: str) -> ActionResult:
    spec = ActionSpec(
        action_id=aid,
        job_id="j",
        trajectory_id="",
        action=InferAction(service=service, payload=[1, 2]),
    )
    assert isinstance(await bus.request(subjects.GATEWAY, Submit(spec=spec)), Accepted)

    async def result() -> ActionResult | None:
        got = await bus.request(subjects.GATEWAY, GetResult(action_id=aid))
        return got if isinstance(got, ActionResult) else None

    return await eventually(result, what=f"the result of {aid}")


async def test_register_infer_list_and_reload(
    mesh: tuple[Bus, FakeGpuAgent, str, str],
) -> None:
    client, agent, dsn, _url = mesh
    spec = ServiceSpec("judge", "models.judge:build", dops=(1, 2))
    reply = await client.request(subjects.GATEWAY, RegisterService(spec=spec), timeout=30)
    assert isinstance(reply, Services)
    (state,) = reply.services
    assert state.prepared_on == ("g0",)
    assert state.footprint_mb == 100
    assert not state.error

    out = await infer(client, "call-1", "judge")
    assert out.status == "succeeded", out.error
    assert out.output == {"echo": [1, 2], "gpus": list(agent.dispatches[-1].gpus)}
    assert out.allocation is not None
    assert out.allocation.gpus == agent.dispatches[-1].gpus
    assert out.timings is not None
    assert out.timings.restore_s == pytest.approx(0.1)
    assert agent.dispatches[-1].service == spec

    unknown = await infer(client, "call-2", "nope")
    assert unknown.error is not None
    assert unknown.error.kind == "invalid_request"
    assert "'nope'" in unknown.error.message
    assert "judge" in unknown.error.message

    listed = await client.request(subjects.GATEWAY, ListServices())
    assert isinstance(listed, Services)
    assert [s.spec.name for s in listed.services] == ["judge"]

    pool = await asyncpg.connect(dsn)
    try:
        assert await pool.fetchval("SELECT count(*) FROM services WHERE name = 'judge'") == 1
    finally:
        await pool.close()


async def test_a_factory_every_node_fails_is_refused_naming_its_error(
    mesh: tuple[Bus, FakeGpuAgent, str, str],
) -> None:
    client, _, _, _ = mesh
    spec = ServiceSpec("bad", "broken.models:build")
    with pytest.raises(InvalidRequest, match="No module named 'broken'"):
        await client.request(subjects.GATEWAY, RegisterService(spec=spec), timeout=30)
    failed = await infer(client, "call-bad", "bad")
    assert failed.error is not None
    assert "No module named 'broken'" in failed.error.message


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"name": "x", "factory": "not a factory"}, "factory"),
        ({"name": "x", "factory": "m:f", "dops": [3]}, "powers of two"),
        ({"name": "x", "factory": "m:f", "dops": [1], "max_batch": 0}, "max_batch"),
        ({"name": "", "factory": "m:f"}, "name"),
    ],
)
async def test_bad_service_specs_are_refused_naming_the_problem(
    mesh: tuple[Bus, FakeGpuAgent, str, str], spec: dict[str, Any], named: str
) -> None:
    client, _, _, _ = mesh
    with pytest.raises(TangramError, match=named) as err:
        await raw_request(client, {"type": "register_service", "spec": spec})
    assert err.value.code == "invalid_request"


async def test_a_restarted_scheduler_reloads_services_from_postgres(
    mesh: tuple[Bus, FakeGpuAgent, str, str],
) -> None:
    client, _, dsn, url = mesh
    spec = ServiceSpec("kept", "models.kept:build")
    await client.request(subjects.GATEWAY, RegisterService(spec=spec), timeout=30)
    async with scheduler(dsn, url) as second:  # a second scheduler starts from Postgres
        assert "kept" in {s.spec.name for s in second.core.service_states()}
