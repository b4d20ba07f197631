"""Quotas through the real gateway and scheduler, with a FAKE quota agent (a test double that
speaks the agent protocol on the real bus): declared quotas, http calls granted within every
limit and retried on 429, leases held until released or expired, and bad inputs refused."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import msgspec
import pytest
from nats.aio.msg import Msg

from tangram import subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import (
    Ack,
    ActionSpec,
    Completion,
    Dispatch,
    Done,
    ErrorReply,
    HttpAction,
    HttpResponse,
    Inventory,
    LeaseAction,
    ListQuotas,
    NodeCommand,
    NodeReport,
    Outcome,
    Quotas,
    QuotaSpec,
    QuotaState,
    ReleaseLease,
    RunningAction,
    SetQuota,
    Submit,
    codec,
)
from tangram.errors import InvalidRequest, TangramError, from_reply
from tangram.launcher import Mesh

from ..support import commands_in, eventually, running_mesh

pytestmark = pytest.mark.slow

HOST = "api.example.com"


class FakeQuotaAgent:
    """Answers each Dispatch after ``delay_s``: ``/429`` always 429, ``/flaky`` 429 on its first
    try, anything else 200. Records what it saw: grants, concurrency, quota and tokens."""

    def __init__(self, bus: Bus, node_id: str = "fakeq", delay_s: float = 0.05) -> None:
        self.bus, self.node_id, self.delay_s = bus, node_id, delay_s
        self.incarnation = uuid.uuid4().hex[:8]
        self.running: dict[str, int] = {}
        self.peak = 0
        self.seen: list[Dispatch] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.bus.serve(subjects.node(self.node_id), self.on_command)
        await self.bus.start()
        self.tasks.add(asyncio.create_task(self._heartbeat()))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    def report(self) -> NodeReport:
        runs = tuple(
            RunningAction(action_id=a, attempt=n, trajectory_id="", cores=())
            for a, n in self.running.items()
        )
        inv = Inventory(kind="quota", backend="fake")
        return NodeReport(
            node_id=self.node_id, incarnation=self.incarnation, inventory=inv, running=runs
        )

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(TangramError):  # a scheduler restarting: report again
                await self.bus.request(
                    subjects.sched_node(self.node_id), self.report(), timeout=2.0
                )
            await asyncio.sleep(0.3)

    async def on_command(self, cmd: NodeCommand, msg: Msg) -> Ack | None:
        for one in commands_in(cmd):
            if isinstance(one, Dispatch) and one.incarnation == self.incarnation:
                self.seen.append(one)
                aid = one.action.spec.action_id
                self.running[aid] = one.action.attempt
                self.peak = max(self.peak, len(self.running))
                task = asyncio.create_task(self._call(one))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        return Ack()

    async def _call(self, cmd: Dispatch) -> None:
        started = time.time()
        await asyncio.sleep(self.delay_s)
        act = cmd.action.spec.action
        assert isinstance(act, HttpAction)
        status = 200
        if act.url.endswith("/429") or (act.url.endswith("/flaky") and cmd.action.attempt == 1):
            status = 429
        headers = {"Retry-After": "0.3"} if status == 429 else {"x-seen": "1"}
        outcome = Outcome(
            http=HttpResponse(status=status, headers=headers, body=b"hi"),
            tokens_used=cmd.tokens // 2,
            started_at=started,
            finished_at=time.time(),
        )
        del self.running[cmd.action.spec.action_id]
        done = Completion(
            node_id=self.node_id,
            incarnation=self.incarnation,
            action_id=cmd.action.spec.action_id,
            attempt=cmd.action.attempt,
            outcome=outcome,
        )
        await self.bus.request(subjects.sched_node(self.node_id), done, timeout=5.0)


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    root: Path = tmp_path_factory.mktemp("quota-mesh")
    async with running_mesh(root, quota_manager=False, gpu_manager=False) as m:
        yield m


@pytest.fixture
async def agent(mesh: Mesh) -> AsyncIterator[FakeQuotaAgent]:
    bus = await Bus.connect(mesh.nats_url, "fake-quota-agent")
    fake = FakeQuotaAgent(bus)
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()
        await bus.close()


@pytest.fixture
async def client(mesh: Mesh) -> AsyncIterator[Client]:
    async with Client.connect(mesh.nats_url) as c:
        yield c


async def gateway(mesh: Mesh, req: object) -> object:
    bus = await Bus.connect(mesh.nats_url, "quota-test")
    try:
        return await bus.request(subjects.GATEWAY, req, timeout=10.0)
    finally:
        await bus.close()


async def quota_state(mesh: Mesh, name: str) -> QuotaState:
    reply = await gateway(mesh, ListQuotas())
    assert isinstance(reply, Quotas)
    (state,) = [q for q in reply.quotas if q.spec.name == name]
    return state


def http_spec(aid: str, quota: str, path: str = "/x", job: str = "j", **kw: object) -> ActionSpec:
    act = HttpAction(method="GET", url=f"https://{HOST}{path}", quota=quota, **kw)  # type: ignore[arg-type]
    return ActionSpec(action_id=aid, job_id=job, trajectory_id="", action=act)


async def test_http_calls_held_to_every_limit_and_retried(
    mesh: Mesh, agent: FakeQuotaAgent, client: Client
) -> None:
    q = f"q{uuid.uuid4().hex[:6]}"
    spec = QuotaSpec(q, concurrency=2, per_second=5, tokens_per_minute=10_000, hosts=(HOST,))
    assert isinstance(await gateway(mesh, SetQuota(spec=spec)), Done)
    await eventually(lambda: quota_state(mesh, q), what="the scheduler knows the quota")
    ids = [f"{q}-{k}" for k in range(12)]
    for k, aid in enumerate(ids):
        await client.submit(http_spec(aid, q, job="jabc"[k % 3 + 1], tokens=100))
    await client.submit(http_spec(f"{q}-flaky", q, "/flaky"))
    await client.submit(http_spec(f"{q}-429", q, "/429", max_retries=1))
    results = [await client.result(a, timeout=30) for a in ids]
    assert all(r.ok and r.http is not None and r.http.status == 200 for r in results)
    assert results[0].allocation is not None
    assert results[0].allocation.quota == q
    flaky = await client.result(f"{q}-flaky", timeout=30)
    assert flaky.ok
    assert flaky.http is not None
    assert flaky.http.tries == 2
    limited = await client.result(f"{q}-429", timeout=30)
    assert limited.error is not None
    assert limited.error.kind == "rate_limited"
    assert limited.http is not None
    assert limited.http.status == 429
    assert agent.peak <= 2
    assert {d.tokens for d in agent.seen if d.quota is not None and d.quota.name == q} >= {100}
    grants = await _grant_times(mesh, q)
    assert len(grants) == 12 + 2 + 2  # every try is a grant
    assert all(sum(1 for g in grants if t <= g < t + 1.0) <= 5 for t in grants)
    state = await quota_state(mesh, q)
    assert (state.in_use, state.queued, state.calls, state.throttled) == (0, 0, 16, 3)
    assert state.learned_per_s is not None
    assert state.learned_per_s < 5


async def _grant_times(mesh: Mesh, quota: str) -> list[float]:
    conn = await asyncpg.connect(mesh.postgres_dsn)
    try:
        rows = await conn.fetch(
            "SELECT e.at FROM action_events e JOIN actions a USING (action_id)"
            " WHERE a.kind = 'http' AND e.status = 'running' AND a.action_id LIKE $1",
            f"{quota}-%",
        )
    finally:
        await conn.close()
    return sorted(float(r["at"]) for r in rows)


async def test_leases_held_until_released_or_expired(mesh: Mesh, client: Client) -> None:
    q = f"l{uuid.uuid4().hex[:6]}"
    assert isinstance(await gateway(mesh, SetQuota(spec=QuotaSpec(q, concurrency=3))), Done)
    held = await client.run(
        ActionSpec(
            action_id=f"{q}-a", job_id="j", trajectory_id="", action=LeaseAction(quota=q, units=2)
        )
    )
    assert held.ok
    assert held.lease is not None
    assert held.lease.units == 2
    assert held.lease.expires_at > time.time() + 30
    short = await client.run(
        ActionSpec(
            action_id=f"{q}-b", job_id="k", trajectory_id="", action=LeaseAction(quota=q, ttl_s=0.5)
        )
    )
    assert short.ok
    assert (await quota_state(mesh, q)).in_use in (2, 3)  # b may have expired already
    await eventually(lambda: _in_use(mesh, q, 2), what="the short lease expiring")
    release = ReleaseLease(lease_id=held.lease.lease_id, tokens_used=0, status=200)
    assert isinstance(await gateway(mesh, release), Done)
    await eventually(lambda: _in_use(mesh, q, 0), what="the released lease's units freed")
    assert isinstance(await gateway(mesh, release), Done)  # a second release is harmless


async def _in_use(mesh: Mesh, q: str, n: int) -> bool:
    return (await quota_state(mesh, q)).in_use == n


@pytest.mark.parametrize(
    ("req", "needle"),
    [
        ("other-host", "is not in quota"),
        ("file-scheme", "scheme 'file'"),
        ("unknown-quota", "unknown quota 'nope"),
        ("too-many-units", "exceeds concurrency=2"),
        ("bad-quota-name", "name"),
        ("no-limit", "at least one limit"),
        ("bad-release", "lease_id"),
    ],
)
async def test_bad_inputs_refused_naming_the_problem(
    mesh: Mesh, client: Client, req: str, needle: str
) -> None:
    q = "bad-inputs"
    await gateway(mesh, SetQuota(spec=QuotaSpec(q, concurrency=2, hosts=(HOST,))))
    aid = f"{q}-{uuid.uuid4().hex[:6]}"
    requests: dict[str, object] = {
        "other-host": _submit(aid, HttpAction(method="GET", url="https://evil.com/", quota=q)),
        "file-scheme": _submit(aid, HttpAction(method="GET", url="file:///etc/passwd", quota=q)),
        "unknown-quota": _submit(
            aid, HttpAction(method="GET", url=f"https://{HOST}/", quota="nope")
        ),
        "too-many-units": _submit(aid, LeaseAction(quota=q, units=3)),
        "bad-release": ReleaseLease(lease_id="bad id with spaces"),
    }
    if req == "no-limit":
        with pytest.raises(ValueError, match=needle):
            QuotaSpec(q)
        return
    if req == "bad-quota-name":
        raw = {"spec": {"name": "Bad Name!", "concurrency": 1}}
        with pytest.raises(InvalidRequest, match=needle):
            await _raw_gateway(mesh, "set_quota", raw)
        return
    with pytest.raises(InvalidRequest, match=needle):
        await gateway(mesh, requests[req])


def _submit(aid: str, act: HttpAction | LeaseAction) -> object:
    return Submit(spec=ActionSpec(action_id=aid, job_id="j", trajectory_id="", action=act))


async def _raw_gateway(mesh: Mesh, tag: str, body: dict[str, object]) -> object:
    """Send a hand-built request (one a typed client could not build) to the gateway."""
    bus = await Bus.connect(mesh.nats_url, "quota-test-raw")
    try:
        data = msgspec.msgpack.encode({"type": tag, **body})
        msg = await bus.nc.request(subjects.GATEWAY.subject, data, timeout=10.0)
    finally:
        await bus.close()
    reply = codec.decode(msg.data, ErrorReply)
    raise from_reply(reply)


async def test_restart_keeps_windows_and_live_leases(
    mesh: Mesh, agent: FakeQuotaAgent, client: Client
) -> None:
    """Grants made before a scheduler restart still count: a full per-minute window stays full
    and a live lease keeps its units (rebuilt from Postgres)."""
    q = f"r{uuid.uuid4().hex[:6]}"
    spec = QuotaSpec(q, concurrency=3, per_minute=3, hosts=(HOST,))
    await gateway(mesh, SetQuota(spec=spec))
    lease = LeaseAction(quota=q, units=1, ttl_s=600)
    held = await client.run(
        ActionSpec(action_id=f"{q}-L", job_id="j", trajectory_id="", action=lease)
    )
    assert held.ok
    for k in range(2):
        assert (await client.run(http_spec(f"{q}-{k}", q))).ok
    await mesh.stop_service("scheduler")
    await mesh.start_service("scheduler")
    await mesh.wait_ready()
    await eventually(lambda: _in_use(mesh, q, 1), what="the live lease held again")
    late = msgspec.structs.replace(http_spec(f"{q}-late", q), queue_timeout_s=2.0)
    result = await client.run(late, wait_s=30)
    assert result.error is not None
    assert result.error.kind == "queue_timeout"  # the window was still full
