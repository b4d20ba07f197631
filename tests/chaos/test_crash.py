"""kill -9 of the scheduler and of the cpu_manager mid-run: every acknowledged action still
reaches exactly one terminal state, recorded in Postgres and delivered; nothing runs twice."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from tangram import ActionSpec, ErrorKind, ExecAction
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually, running_mesh

pytestmark = pytest.mark.slow


@pytest.fixture
async def own_mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(tmp_path / "mesh") as m:
        yield m


def specs(uid: str, log: Path, n: int, trajectories: int, sleep: str) -> list[ActionSpec]:
    cmd = f'echo "$TANGRAM_ACTION_ID" >> {log}; sleep {sleep}'
    return [
        ActionSpec(
            action_id=f"{uid}-{i}",
            job_id=uid,
            trajectory_id=f"{uid}-t{i % trajectories}",
            action=ExecAction(command=cmd),
        )
        for i in range(n)
    ]


async def terminal_records(dsn: str, ids: list[str]) -> tuple[dict[str, str], dict[str, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        # one snapshot for both reads: a terminal record committing between two statements
        # showed its event beside the row's status from before it ('running')
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            rows = await conn.fetch(
                "SELECT action_id, status FROM actions WHERE action_id = ANY($1)", ids
            )
            events = await conn.fetch(
                "SELECT action_id, count(*) AS n FROM action_events WHERE action_id = ANY($1)"
                " AND status IN ('succeeded', 'failed', 'cancelled') GROUP BY action_id",
                ids,
            )
    finally:
        await conn.close()
    return {r["action_id"]: r["status"] for r in rows}, {r["action_id"]: r["n"] for r in events}


async def settled(dsn: str, ids: list[str]) -> tuple[dict[str, str], dict[str, int]]:
    """Records once every action has its terminal event (results are pushed as actions end;
    their records commit moments later)."""

    async def all_terminal() -> tuple[dict[str, str], dict[str, int]] | None:
        statuses, terminal_events = await terminal_records(dsn, ids)
        return (statuses, terminal_events) if len(terminal_events) == len(ids) else None

    return await eventually(all_terminal, what="a terminal record of every action", timeout_s=10)


async def ran(log: Path, n: int) -> None:
    """Until ``n`` actions have started (each appends its id to ``log``)."""

    def lines() -> int:
        return len(log.read_text().split()) if log.exists() else 0

    await eventually(lambda: lines() >= n, what=f"{n} actions to start", timeout_s=30)


async def run_through_crash(mesh: Mesh, victim: str, uid: str, log: Path, n: int) -> list:
    async with Client.connect(mesh.nats_url) as client:
        todo = specs(uid, log, n, trajectories=8, sleep="0.2")
        acks = await asyncio.gather(*(client.submit(s) for s in todo))
        assert all(not a.duplicate for a in acks)
        await ran(log, n // 4)  # the crash lands mid-run: some done, some running, some queued
        await mesh.kill(victim)
        await asyncio.sleep(1.0)  # the scenario: the victim stays dead for a second
        name, _, index = victim.partition(".")
        await mesh.start_service(name, int(index or 0))
        results = await asyncio.gather(*(client.result(s.action_id, timeout=90) for s in todo))
    statuses, terminal_events = await settled(mesh.postgres_dsn, [s.action_id for s in todo])
    for s, r in zip(todo, results, strict=True):
        assert statuses[s.action_id] == r.status  # recorded == delivered
        assert terminal_events.get(s.action_id) == 1, s.action_id  # exactly one terminal state
    return results


async def test_scheduler_kill9_loses_nothing_and_runs_nothing_twice(
    own_mesh: Mesh, uid: str, tmp_path: Path
):
    log = tmp_path / "ran.log"
    results = await run_through_crash(own_mesh, "scheduler", uid, log, n=60)
    assert all(r.ok for r in results), [
        (r.action_id, r.exit_code, r.stderr, r.error, r.attempt) for r in results if not r.ok
    ]
    runs = collections.Counter(log.read_text().split())
    assert set(runs) == {r.action_id for r in results}
    assert max(runs.values()) == 1


async def test_node_agent_kill9_fails_in_flight_as_node_died_and_reruns_nothing(
    own_mesh: Mesh, uid: str, tmp_path: Path
):
    log = tmp_path / "ran.log"
    results = await run_through_crash(own_mesh, "cpu_manager.0", uid, log, n=60)
    kinds = collections.Counter(r.error.kind if r.error else "ok" for r in results)
    assert kinds[ErrorKind.NODE_DIED] >= 1, kinds
    assert set(kinds) <= {"ok", ErrorKind.NODE_DIED, ErrorKind.ENVIRONMENT_LOST}, kinds
    for r in results:
        assert r.ok or r.infrastructure_failure
    runs = collections.Counter(log.read_text().split())
    assert max(runs.values()) == 1
    ok_ids = {r.action_id for r in results if r.ok}
    assert ok_ids <= set(runs)


@pytest.mark.parametrize("server", ["nats", "postgres"])
async def test_server_kill9_mid_run_loses_nothing(
    own_mesh: Mesh, uid: str, tmp_path: Path, server: str
):
    """The broker or the database is killed -9 and restarted while actions are in flight."""
    log = tmp_path / "ran.log"
    restart = own_mesh.restart_nats if server == "nats" else own_mesh.restart_postgres
    async with Client.connect(own_mesh.nats_url) as client:
        todo = specs(uid, log, 40, trajectories=8, sleep="0.2")
        await asyncio.gather(*(client.submit(s) for s in todo))
        await ran(log, 8)  # actions are in flight when the server dies
        await restart()
        results = await asyncio.gather(*(client.result(s.action_id, timeout=90) for s in todo))
    assert all(r.ok for r in results), [(r.action_id, r.error) for r in results if not r.ok]
    runs = collections.Counter(log.read_text().split())
    assert max(runs.values()) == 1
    assert set(runs) == {s.action_id for s in todo}
    statuses, terminal_events = await settled(own_mesh.postgres_dsn, [s.action_id for s in todo])
    assert set(statuses.values()) == {"succeeded"}
    assert set(terminal_events.values()) == {1}
