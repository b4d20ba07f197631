"""Failure detection on a live mesh (issue 14): an agent stopped (SIGSTOP) past the suspect
bound with dispatches waiting in its socket runs each of them exactly once after SIGCONT and
loses no environment; stopped past the failure bound it is fenced, and nothing recorded
``node_died`` runs after SIGCONT; bad internal messages are refused and the mesh serves on;
an executor wedged under a live bus loop answers its pings but not its canary and is failed,
while a busy healthy agent answers its canary beside its running actions; ``health_events``
is pruned by the scheduler. The tests share the module's mesh, in this order (the slow one
replaces the agent, the wedge test stops it and runs an agent of its own)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path

import asyncpg
import msgspec
import pytest

from services.cpu_manager.config import CpuManagerConfig
from services.cpu_manager.process.backend import ProcessBackend, ProcessConfig
from services.cpu_manager.service import node_agent
from services.scheduler.health import _INSERT as HEALTH_INSERT
from services.scheduler.health import prune
from tangram import ActionResult, subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import (
    Ack,
    ActionSpec,
    ErrorKind,
    ErrorReply,
    ExecAction,
    Kill,
    Ping,
    SchedulerStatus,
    UnifiedAction,
    codec,
    encode,
)
from tangram.errors import InvalidRequest
from tangram.launcher import Mesh

from ..support import eventually, running_mesh

pack = msgspec.msgpack.encode
AGENT = "cpu_manager.0"


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    """The module's mesh; its scheduler prunes ``health_events`` every half second (the
    default is hourly) so that the pruning test sees it done."""
    env = {"TANGRAM_HEALTH_PRUNE_S": "0.5"}
    async with running_mesh(tmp_path_factory.mktemp("mesh"), env=env) as m:
        yield m


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory the actions may write in (they may run as an unprivileged user)."""
    d = Path(tempfile.mkdtemp(prefix="tangram-health-"))
    d.chmod(0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def health(client: Client, mesh: Mesh) -> str:
    st: SchedulerStatus = await mesh.status(client.bus)
    return ",".join(f"{r.node_id}:{r.health}" for r in st.node_rows)


async def submit(client: Client, log: Path, uid: str, n: int) -> list[asyncio.Task[ActionResult]]:
    """``n`` actions of new trajectories, each appending its id to ``log``."""
    return [
        asyncio.create_task(
            client.exec(
                f'echo "$TANGRAM_ACTION_ID" >> {log}',
                trajectory_id=f"{uid}-t{k}",
                job_id=uid,
                action_id=f"{uid}-{k}",
                wait_s=60,
            )
        )
        for k in range(n)
    ]


def writable(log: Path) -> Path:
    """The log every action appends to (each trajectory may run as a user of its own)."""
    log.touch()
    log.chmod(0o666)
    return log


def runs(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


async def transitions(dsn: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT old_state, new_state FROM health_events ORDER BY id")
    finally:
        await conn.close()
    return [(r["old_state"], r["new_state"]) for r in rows]


async def test_bad_internal_messages_are_refused_and_the_mesh_serves_on(mesh: Mesh):
    action = {
        "spec": {
            "action_id": "bad-x",
            "job_id": "j",
            "trajectory_id": "t",
            "action": {"kind": "exec", "command": "true"},
        },
        "key_resource": "cpu",
        "env_memory_mb": 1,
        "submitted_at": 0.0,
    }
    cases = [
        ({"type": "enqueue", "action": {**action, "demands": []}}, "no demands"),
        (
            {
                "type": "enqueue",
                "action": {**action, "demands": [{"resource": "cpu", "choices": []}]},
            },
            "no choices",
        ),
        (
            {
                "type": "enqueue_many",
                "actions": [{**action, "demands": [{"resource": "cpu", "choices": [4, 2]}]}],
            },
            "sorted",
        ),
        (
            {
                "type": "enqueue",
                "action": {**action, "demands": [{"resource": "gpu", "choices": []}]},
            },
            "key resource",
        ),
    ]
    async with Client.connect(mesh.nats_url) as client:
        nc = client.bus.nc
        for payload, why in cases:
            reply = await nc.request(subjects.SCHED_ACTIONS.subject, pack(payload), timeout=10)
            assert why in codec.decode(reply.data, ErrorReply).message
        # a huge epoch in a node command is taken (it kills nothing here) but moves no floor
        kill = encode(Kill(action_id="nothing", epoch=2**62))
        await nc.request(subjects.node("node0").subject, kill, timeout=10)
        for junk in (b"\xc1", pack({"type": "ping", "epoch": "x"}), pack({"type": "node_report"})):
            await nc.request(subjects.sched_node("node0").subject, junk, timeout=10)
            await nc.request(subjects.node("node0").subject, junk, timeout=10)
        bad_ping = pack({"type": "ping", "canary": "yes", "incarnation": 5})  # the probe's fields
        reply = await nc.request(subjects.node("node0").subject, bad_ping, timeout=10)
        assert "canary" in codec.decode(reply.data, ErrorReply).message
        ok = await client.exec("echo alive", trajectory_id="after", job_id="j", wait_s=30)
        assert ok.ok
        assert ok.stdout.strip() == "alive"
        assert "node0:healthy" in await health(client, mesh)


async def test_a_durable_action_the_scheduler_cannot_read_ends_invalid_request(mesh: Mesh):
    """A row committed by a gateway of another version (or a bug) that breaks the scheduler's
    rules is not left queued for ever: the sweep ends it ``invalid_request``."""
    spec = ActionSpec(
        action_id="unreadable-1", job_id="j", trajectory_id="t", action=ExecAction(command="true")
    )
    bad = UnifiedAction(spec=spec, demands=(), key_resource="cpu", env_memory_mb=1, submitted_at=0)
    conn = await asyncpg.connect(mesh.postgres_dsn)
    try:
        await conn.execute(
            "INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec,"
            " submitted_at) VALUES ($1, 'j', 't', 'exec', 'queued', $2, $3)",
            spec.action_id,
            encode(bad),
            time.time() - 60,
        )
    finally:
        await conn.close()
    async with Client.connect(mesh.nats_url) as client:
        res = await client.result(spec.action_id, timeout=30)  # swept every 2 s
    assert res.error is not None
    assert res.error.kind is ErrorKind.INVALID_REQUEST
    assert "no demands" in res.error.message


async def test_a_pause_past_the_suspect_bound_runs_nothing_twice_and_loses_nothing(
    mesh: Mesh, shared: Path
):
    log = writable(shared / "ran")
    async with Client.connect(mesh.nats_url) as client:
        assert (await client.exec("true", trajectory_id="warm", job_id="w", wait_s=30)).ok
        pid = mesh.pid(AGENT)
        os.kill(pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            tasks = await submit(client, log, "p4", 12)  # their dispatches wait in its socket
            await eventually(lambda: suspect(client, mesh), what="the agent suspect")
            suspect_s = time.monotonic() - stopped
            # the pause of the probe: 4 s, past the dispatch grace (3 s) and the
            # suspect bound, short of the failure bound (5 s); its length is the fault itself
            await asyncio.sleep(max(0.0, 4.0 - suspect_s))
        finally:
            os.kill(pid, signal.SIGCONT)
        results = await asyncio.gather(*tasks)
    assert all(r.ok for r in results), [(r.error, r.stderr) for r in results if not r.ok]
    assert sorted(runs(log)) == sorted(r.action_id for r in results)  # each exactly once
    assert ("healthy", "suspect") in await transitions(mesh.postgres_dsn)
    assert ("suspect", "fenced") not in await transitions(mesh.postgres_dsn)
    print(f"suspect {suspect_s:.2f}s after SIGSTOP")


async def suspect(client: Client, mesh: Mesh) -> bool:
    return "suspect" in await health(client, mesh)


@pytest.mark.slow  # ~10 s: the failure bound (5 s), then a new agent
async def test_a_pause_past_the_failure_bound_fences_and_nothing_node_died_runs(
    mesh: Mesh, shared: Path
):
    log = writable(shared / "ran")
    async with Client.connect(mesh.nats_url) as client:
        assert (await client.exec("true", trajectory_id="warm", job_id="w", wait_s=30)).ok
        proc = mesh.procs[AGENT]
        os.kill(proc.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        try:
            tasks = await submit(client, log, "p8", 6)
            await eventually(lambda: failed(mesh.postgres_dsn), what="the agent declared failed")
            failed_s = time.monotonic() - stopped
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # told it is fenced, the agent stops; its supervisor (here: the test) starts another
        assert await asyncio.wait_for(proc.wait(), 20) != 0
        await mesh.start_service("cpu_manager", 0)
        results = await asyncio.gather(*tasks)
    died = {r.action_id for r in results if not r.ok}
    assert all(r.error.kind == "node_died" for r in results if not r.ok and r.error)
    ran = runs(log)
    assert len(ran) == len(set(ran))  # nothing ran twice
    assert not died & set(ran)  # nothing recorded node_died ran
    assert {r.action_id for r in results if r.ok} <= set(ran)
    print(
        f"failed {failed_s:.2f}s after SIGSTOP; node_died {len(died)}, re-queued and ran {len(ran)}"
    )


async def failed(dsn: str) -> bool:
    return ("fenced", "failed") in await transitions(dsn)


async def node_transitions(dsn: str, node_id: str) -> list[tuple[str, str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT old_state, new_state, reason FROM health_events WHERE node_id = $1 ORDER BY id",
            node_id,
        )
    finally:
        await conn.close()
    return [(r["old_state"], r["new_state"], r["reason"]) for r in rows]


async def node_incarnation(nc: object, node_id: str) -> str:
    """The incarnation in the node's next report (read beside the scheduler)."""
    got: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def on_report(msg: object) -> None:
        data = msgspec.msgpack.decode(msg.data)  # type: ignore[attr-defined]
        if data.get("type") == "node_report" and not got.done():
            got.set_result(data["incarnation"])

    sub = await nc.subscribe(subjects.sched_node(node_id).subject, cb=on_report)  # type: ignore[attr-defined]
    try:
        return await asyncio.wait_for(got, 10)
    finally:
        await sub.unsubscribe()


async def test_a_busy_healthy_agent_answers_its_canary_beside_its_running_actions(mesh: Mesh):
    async with Client.connect(mesh.nats_url) as client:
        await eventually(lambda: healthy_node0(client, mesh), what="node0 healthy")
        inc = await node_incarnation(client.bus.nc, "node0")
        st = await mesh.status(client.bus)
        (row,) = [r for r in st.node_rows if r.node_id == "node0"]
        tasks = [
            asyncio.create_task(
                client.exec("sleep 1.5", trajectory_id=f"busy-{k}", job_id="busy", wait_s=30)
            )
            for k in range(row.cores)
        ]
        await eventually(lambda: all_busy(client, mesh), what="every core of node0 busy")
        node = subjects.node("node0")
        t = time.monotonic()
        ack = await client.bus.request(node, Ping(incarnation=inc, canary=True), timeout=2.0)
        canary_s = time.monotonic() - t
        assert isinstance(ack, Ack)
        with pytest.raises(InvalidRequest, match="incarnation"):  # another incarnation's probe
            await client.bus.request(node, Ping(incarnation="gone", canary=True), timeout=2.0)
        results = await asyncio.gather(*tasks)
        assert all(r.ok for r in results)
        assert "node0:healthy" in await health(client, mesh)
    print(f"canary answered in {canary_s * 1000:.1f} ms with all {row.cores} cores busy")


async def healthy_node0(client: Client, mesh: Mesh) -> bool:
    return "node0:healthy" in await health(client, mesh)


async def all_busy(client: Client, mesh: Mesh) -> bool:
    st = await mesh.status(client.bus)
    return any(r.node_id == "node0" and r.free_cores == 0 for r in st.node_rows)


@contextlib.asynccontextmanager
async def own_agent(
    mesh: Mesh, root: Path, node_id: str, wedge: threading.Event
) -> AsyncIterator[ProcessBackend]:
    """A CPU agent of this test's own (the production classes, in this process), so that the
    test can reach its process backend's launcher thread from outside. ``wedge`` is set
    before the agent stops (its backend waits for the launcher thread)."""
    bus = await Bus.connect(mesh.nats_url, f"cpu_manager.{node_id}")
    cfg = CpuManagerConfig(node_id=node_id, heartbeat_s=0.5, trajectory_uids=False)
    backend = ProcessBackend(ProcessConfig(root=root, node_id=node_id, trajectory_uids=False))
    agent = node_agent(bus, cfg, backend)
    await agent.start()
    try:
        yield backend
    finally:
        wedge.set()
        await agent.stop(1.0)
        await bus.close()


async def test_a_wedged_executor_answers_its_pings_but_not_its_canary_and_is_failed(
    mesh: Mesh, shared: Path
):
    """Its launcher thread (every spawn goes through it) is held from outside: the bus loop
    answers pings and heartbeats go on, but nothing starts. Launches under way that do not
    end for the start bound (3 s, whatever the actions' default 600 s timeout) -> suspect ->
    ping answered -> canary unanswered -> fenced -> failed within ~10 s; what it was sent
    ends ``node_died`` and never runs, not even once the launcher frees up. (node0 is
    stopped for good: the tests after this one need no agent.)"""
    log = writable(shared / "ran")
    await mesh.stop_service(AGENT)  # the test's agent alone takes the work
    wedge = threading.Event()
    cores = len(os.sched_getaffinity(0))  # one action per core: all dispatched at once
    async with Client.connect(mesh.nats_url) as client:
        async with own_agent(mesh, shared / "wedged-env", "wedged", wedge) as backend:
            await eventually(lambda: has_node(client, mesh, "wedged"), what="the agent known")
            backend._launcher.submit(wedge.wait)  # the wedge, from outside
            t0 = time.monotonic()
            tasks = [
                asyncio.create_task(
                    client.exec(
                        f'echo "$TANGRAM_ACTION_ID" >> {log}',
                        trajectory_id=f"wedge-t{k}",
                        job_id="wedge",
                        action_id=f"wedge-{k}",
                        wait_s=60,  # the default timeout, 600 s: only the start phase is short
                    )
                )
                for k in range(cores)
            ]
            results = await asyncio.wait_for(asyncio.gather(*tasks), 20)
            failed_s = time.monotonic() - t0
    found = await node_transitions(mesh.postgres_dsn, "wedged")
    assert [(old, new) for old, new, _ in found] == [
        ("healthy", "suspect"),
        ("suspect", "fenced"),
        ("fenced", "failed"),
    ]
    assert "launches under way and none ended" in found[0][2]
    assert "its canary did not complete within 2s" in found[1][2]
    assert [r.error.kind if r.error else None for r in results] == [ErrorKind.NODE_DIED] * cores
    assert runs(log) == []  # nothing ran: not while wedged, not once the launcher was free
    # suspect after the start bound (3 s), fenced two probe timeouts later, failed once its
    # lease ran out: ~9 s, not twice the 600 s timeout
    assert failed_s < 12.0
    print(f"wedged executor: its actions ended node_died {failed_s:.2f}s after they were sent")


async def has_node(client: Client, mesh: Mesh, node_id: str) -> bool:
    st = await mesh.status(client.bus)
    return any(r.node_id == node_id for r in st.node_rows)


async def test_the_scheduler_prunes_old_health_events(mesh: Mesh):
    """Older than TANGRAM_HEALTH_EVENTS_KEEP_S (7 days) goes, by the scheduler's own task;
    beyond the newest TANGRAM_HEALTH_EVENTS_KEEP_ROWS goes too, but a fencing of the last
    day stays whatever the bounds (a new leader fences that incarnation again)."""
    now = datetime.datetime.now(datetime.UTC)
    old = now - datetime.timedelta(days=30)
    rows = [(old, "old-node", "suspect"), (old, "old-node", "fenced"), (now, "new-node", "fenced")]
    rows += [(now, "count-node", "suspect")] * 3
    pool = await asyncpg.create_pool(mesh.postgres_dsn, min_size=1, max_size=1)
    try:
        cols = [[r[0] for r in rows], [r[1] for r in rows], ["i"] * len(rows)]
        cols += [["cpu"] * len(rows), ["healthy"] * len(rows), [r[2] for r in rows]]
        await pool.execute(HEALTH_INSERT, *cols, [""] * len(rows))
        q = "SELECT node_id FROM health_events WHERE node_id LIKE '%-node' ORDER BY id"

        async def kept() -> list[str]:
            return [r["node_id"] for r in await pool.fetch(q)]

        new = ["new-node", *["count-node"] * 3]
        await eventually(lambda: _equal(kept(), new), what="the old transitions pruned")
        assert await prune(pool, keep_s=7 * 24 * 3600, keep_rows=1) > 0
        assert await kept() == ["new-node", "count-node"]  # the newest row, and the fencing
    finally:
        await pool.close()


async def _equal(got: Awaitable[list[str]], want: list[str]) -> bool:
    return await got == want
