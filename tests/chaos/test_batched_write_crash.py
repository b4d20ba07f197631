"""kill -9 of the scheduler while one of its batched writes is in flight: no action of that
batch (nor of any other) is lost or run twice.

How a write is caught in flight, deterministically: the test holds row locks on the actions
(``FOR UPDATE`` in an open transaction of its own), so the scheduler's batched ``UPDATE`` waits
on them. Postgres says which backend waits on whom (``pg_blocking_pids``) and, with
``log_statement = 'mod'``, logs a statement with its parameters when it starts executing, so
the test reads which actions the waiting batch carries. Then: kill -9, and either the orphaned
backend is terminated (the write rolls back) or the locks are released first (the write commits
after its writer died, which nobody will ever be told); then a new scheduler.

Every action appends its id to a file when it starts and runs until its gate file appears, so
the test decides when each one ends and counts how often each ran."""

from __future__ import annotations

import asyncio
import collections
import itertools
import re
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from asyncpg.transaction import Transaction

from tangram import ActionSpec, ExecAction
from tangram.client import Client
from tangram.launcher import Mesh

from ..support import eventually, running_mesh
from .test_crash import settled

pytestmark = pytest.mark.slow

N = 40
TERMINAL_WRITE = "SET status = t.status"  # a fragment of store._FINISHED alone
TERMINAL_ONE = "SET status = $3"  # of store._FINISHED_ONE alone (one record, by its key)
STARTED_WRITE = "SET status = 'running'"  # a fragment of store._STARTED alone
OUTCOMES = ["rolled-back", "committed"]  # what the write does once its scheduler is dead


@pytest.fixture
async def own_mesh(tmp_path: Path) -> AsyncIterator[Mesh]:
    async with running_mesh(tmp_path / "mesh", nodes=2, quota_manager=False) as m:
        conn = await asyncpg.connect(m.postgres_dsn)
        try:  # statements are logged with their parameters: which batch waits is readable
            await conn.execute("ALTER SYSTEM SET log_statement = 'mod'")
            db = await conn.fetchval("SELECT current_database()")
            # also for the database, which a session takes as it starts: CI twice found a
            # write waiting on the test's locks whose backend had logged nothing at all
            await conn.execute(f"ALTER DATABASE \"{db}\" SET log_statement = 'mod'")
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()
        # every session of the scheduler, whose writes the tests read, begun since
        await m.kill("scheduler")
        await m.start_service("scheduler")
        await m.wait_ready()
        yield m


class Box:
    """The actions' shared directory: who started (``ran``) and the gates they wait on."""

    def __init__(self, root: Path) -> None:
        self.ran = root / "ran"
        self.gates = root / "gates"
        self.gates.mkdir(parents=True)

    def command(self) -> str:
        me, gates = "$TANGRAM_ACTION_ID", self.gates
        return (
            f'echo "{me}" >> {self.ran}; '
            f'until [ -e {gates}/"{me}" ] || [ -e {gates}/all ]; do sleep 0.05; done'
        )

    def runs(self) -> collections.Counter[str]:
        return collections.Counter(self.ran.read_text().split() if self.ran.exists() else [])

    def open(self, *ids: str) -> None:
        for aid in ids or ("all",):
            (self.gates / aid).touch()


def specs(uid: str, box: Box, trajectories: int) -> list[ActionSpec]:
    """As many trajectories as cores: once every core has run one, no more environments are
    made, so a batch of terminal records is one statement (an environment's record would
    join it in one transaction, which cannot commit once its client is gone)."""
    return [
        ActionSpec(
            action_id=f"{uid}-{i:02d}",
            job_id=uid,
            trajectory_id=f"{uid}-t{i % trajectories}",
            action=ExecAction(command=box.command()),
        )
        for i in range(N)
    ]


class RowLocks:
    """Row locks on actions, held by an open transaction of the test's own connection."""

    def __init__(self, conn: asyncpg.Connection, tx: Transaction, pid: int) -> None:
        self.conn, self.tx, self.pid = conn, tx, pid

    @classmethod
    async def take(cls, dsn: str, ids: list[str]) -> RowLocks:
        conn = await asyncpg.connect(dsn)
        tx = conn.transaction()
        await tx.start()
        rows = await conn.fetch(
            "SELECT action_id FROM actions WHERE action_id = ANY($1) FOR UPDATE", ids
        )
        assert len(rows) == len(ids), (rows, ids)
        return cls(conn, tx, await conn.fetchval("SELECT pg_backend_pid()"))

    async def release(self) -> None:
        await self.tx.rollback()
        await self.conn.close()


async def waiting_write(
    mesh: Mesh, locks: RowLocks, fragment: str, read_batch: bool = True
) -> tuple[int, list[str]]:
    """The backend whose write (a statement containing ``fragment``) waits on ``locks``, and
    (``read_batch``) the action ids of its batch, as Postgres logged them when the statement
    began."""

    async def blocked() -> int | None:
        conn = await asyncpg.connect(mesh.postgres_dsn)
        try:
            pids = await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                " AND $1 = ANY(pg_blocking_pids(pid)) AND position($2 in query) > 0",
                locks.pid,
                fragment,
            )
        finally:
            await conn.close()
        assert len(pids) <= 1, pids
        return pids[0]["pid"] if pids else None

    pid = await eventually(blocked, what=f"a write with {fragment!r} waiting on the test's locks")
    if not read_batch:
        return pid, []
    try:
        batch = await eventually(
            lambda: logged_batch(mesh, pid, fragment),
            what=f"the log of {pid}'s write",
            timeout_s=5,
        )
    except AssertionError as exc:  # what the log did say of that backend
        assert mesh.pg is not None
        text = (mesh.pg.data_dir / "postgres.log").read_text(errors="replace")
        said = [line[:300] for line in text.splitlines() if f"[{pid}]" in line]
        raise AssertionError(f"{exc}; its lines in the log: {said[-6:]}") from exc
    return pid, batch


def logged_batch(mesh: Mesh, pid: int, fragment: str) -> list[str]:
    """The ``$1`` (the action ids: an array, or one id) of the last logged statement of
    ``pid`` with ``fragment``."""
    assert mesh.pg is not None
    text = (mesh.pg.data_dir / "postgres.log").read_text(errors="replace")
    entries = re.split(r"\n(?=\S)", text)  # a statement's lines after its first are indented
    batch: list[str] = []
    for entry, detail in itertools.pairwise(entries):
        if f"[{pid}]" in entry and "execute" in entry and fragment in entry:
            found = re.search(r"Parameters: \$1 = '(\{[^}]*\}|[^']*)'", detail)
            batch = found.group(1).strip("{}").split(",") if found else []
    return batch


async def backend_gone(dsn: str, pid: int) -> None:
    async def gone() -> bool:
        conn = await asyncpg.connect(dsn)
        try:
            return not await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", pid
            )
        finally:
            await conn.close()

    await eventually(gone, what=f"the orphaned backend {pid} to end")


async def orphan(mesh: Mesh, pid: int, locks: list[RowLocks], outcome: str) -> None:
    """The scheduler dies with its write waiting; that write then rolls back or commits."""
    await mesh.kill("scheduler")
    if outcome == "rolled-back":  # as when Postgres notices its client is gone
        conn = await asyncpg.connect(mesh.postgres_dsn)
        try:
            assert await conn.fetchval("SELECT pg_terminate_backend($1)", pid)
        finally:
            await conn.close()
    for held in locks:
        await held.release()
    await backend_gone(mesh.postgres_dsn, pid)


async def statuses(dsn: str, ids: list[str]) -> dict[str, str]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT action_id, status FROM actions WHERE action_id = ANY($1)", ids
        )
    finally:
        await conn.close()
    return {r["action_id"]: r["status"] for r in rows}


async def exactly_once(mesh: Mesh, client: Client, todo: list[ActionSpec], box: Box) -> None:
    """Every action succeeded, ran once, and has one terminal record that says what the client
    was told."""
    results = await asyncio.gather(*(client.result(s.action_id, timeout=40) for s in todo))
    assert all(r.ok for r in results), [
        (r.action_id, r.status, r.error, r.attempt) for r in results if not r.ok
    ]
    ids = [s.action_id for s in todo]
    recorded, terminal_events = await settled(mesh.postgres_dsn, ids)
    for r in results:
        assert recorded[r.action_id] == r.status, r.action_id  # recorded == delivered
        assert terminal_events.get(r.action_id) == 1, r.action_id  # one terminal state
    runs = box.runs()
    assert set(runs) == set(ids)
    assert {aid: n for aid, n in runs.items() if n != 1} == {}  # none ran twice


@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_kill9_during_a_batched_terminal_write(
    own_mesh: Mesh, uid: str, tmp_path: Path, outcome: str
) -> None:
    """Completions of several actions wait in one terminal write when the scheduler dies:
    their nodes resend them to the next scheduler, which records each once."""
    mesh, box = own_mesh, Box(tmp_path / "box")
    capacity = (await mesh.wait_ready()).free_cores
    assert capacity >= 3, capacity  # one plug and a batch of two or more
    async with Client.connect(mesh.nats_url) as client:
        todo = specs(uid, box, capacity)
        await asyncio.gather(*(client.submit(s) for s in todo))
        await eventually(lambda: len(box.runs()) == capacity, what="every core busy")
        plug, *wave = sorted(box.runs())
        # The plug's write waits on one lock while the others' completions queue behind it;
        # when it goes, they all go as the next batch, which waits on the other locks.
        plug_lock = await RowLocks.take(mesh.postgres_dsn, [plug])
        wave_locks = await RowLocks.take(mesh.postgres_dsn, wave)
        box.open(plug)
        await waiting_write(mesh, plug_lock, TERMINAL_ONE, read_batch=False)  # one, by its key
        box.open(*wave)
        # Pushed as soon as their completions arrive, queued for the writer first.
        await asyncio.gather(*(client.result(aid, timeout=15) for aid in wave))
        await plug_lock.release()
        pid, batch = await waiting_write(mesh, wave_locks, TERMINAL_WRITE)
        assert sorted(batch) == wave  # the write in flight carries the whole wave
        await orphan(mesh, pid, [wave_locks], outcome)
        after = await statuses(mesh.postgres_dsn, wave)
        expected = "succeeded" if outcome == "committed" else "running"
        assert set(after.values()) == {expected}, after
        box.open()
        await mesh.start_service("scheduler")
        await exactly_once(mesh, client, todo, box)


async def blocked_first_pass(
    mesh: Mesh, client: Client, uid: str, box: Box
) -> tuple[list[ActionSpec], RowLocks, int, list[str]]:
    """Actions accepted while the scheduler is away are all queued when it comes back: its
    first pass grants every core at once, as one ``started`` write, which waits on locks."""
    capacity = (await mesh.wait_ready()).free_cores
    await mesh.kill("scheduler")
    todo = specs(uid, box, capacity)
    await asyncio.gather(*(client.submit(s) for s in todo))
    locks = await RowLocks.take(mesh.postgres_dsn, [s.action_id for s in todo])
    await mesh.start_service("scheduler")
    pid, batch = await waiting_write(mesh, locks, STARTED_WRITE)
    return todo, locks, pid, batch


@pytest.mark.parametrize("outcome", OUTCOMES)
async def test_kill9_during_a_batched_started_write(
    own_mesh: Mesh, uid: str, tmp_path: Path, outcome: str
) -> None:
    """Several grants wait in one ``started`` write when the scheduler dies: none was
    dispatched, and the next scheduler runs each once (even when that write commits after
    its scheduler died, recording starts that never happened)."""
    mesh, box = own_mesh, Box(tmp_path / "box")
    async with Client.connect(mesh.nats_url) as client:
        todo, locks, pid, batch = await blocked_first_pass(mesh, client, uid, box)
        assert len(batch) >= 2, batch
        assert box.runs() == {}  # a dispatch leaves only once its start is recorded
        await orphan(mesh, pid, [locks], outcome)
        after = await statuses(mesh.postgres_dsn, batch)
        expected = "running" if outcome == "committed" else "queued"
        assert set(after.values()) == {expected}, after
        assert box.runs() == {}
        box.open()
        await mesh.start_service("scheduler")
        await exactly_once(mesh, client, todo, box)


async def test_a_new_scheduler_cuts_off_a_dead_ones_write_before_it_reads(
    own_mesh: Mesh, uid: str, tmp_path: Path
) -> None:
    """A dead scheduler's write still waiting in Postgres when the next one starts is ended
    by it (its session fenced off), so it can never commit later over the new one's books:
    the waiting start never lands, and each action runs once."""
    mesh, box = own_mesh, Box(tmp_path / "box")
    async with Client.connect(mesh.nats_url) as client:
        todo, locks, pid, batch = await blocked_first_pass(mesh, client, uid, box)
        await mesh.kill("scheduler")  # its write still waits on the locks
        await mesh.start_service("scheduler")  # fences before it reads
        await backend_gone(mesh.postgres_dsn, pid)
        await locks.release()
        box.open()
        await exactly_once(mesh, client, todo, box)
        assert set((await statuses(mesh.postgres_dsn, batch)).values()) == {"succeeded"}
