"""Failure detection on a live mesh (issue 14): an agent stopped (SIGSTOP) past the suspect
bound with dispatches waiting in its socket runs each of them exactly once after SIGCONT and
loses no environment; stopped past the failure bound it is fenced, and nothing recorded
``node_died`` runs after SIGCONT; bad internal messages are refused and the mesh serves on.
The tests share the module's mesh, in this order (the last one replaces the agent)."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import msgspec
import pytest

from tangram import ActionResult, subjects
from tangram.client import Client
from tangram.contract import (
    ActionSpec,
    ErrorKind,
    ErrorReply,
    ExecAction,
    Kill,
    SchedulerStatus,
    UnifiedAction,
    codec,
    encode,
)
from tangram.launcher import Mesh

from ..support import eventually

pack = msgspec.msgpack.encode
AGENT = "cpu_manager.0"


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
