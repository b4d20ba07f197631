"""Least-privilege Postgres roles (``tangram.pg_roles``) on a secure embedded cluster: no
password, no entry; each service's role runs its service's own statements and is refused what
another service writes or what it has no business reading; a secure mesh runs actions under
them, and again after a restart on the same state dir."""

from __future__ import annotations

import asyncio
import datetime
import stat
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from services.dashboard.config import DashboardConfig
from services.dashboard.queries import ActionQuery, search
from services.dashboard.spans import SpanWriter
from services.gateway import quotas_api, services_api
from services.gateway import store as gateway_store
from services.scheduler import gpu_shell, quota_store
from services.scheduler import store as scheduler_store
from services.scheduler.health import _INSERT as HEALTH_INSERT
from services.scheduler.health import prune as prune_health
from tangram import db, pg_roles
from tangram.client import Client
from tangram.contract.spans import SpanRecord
from tangram.embedded import EmbeddedPostgres
from tests.support import running_mesh

Refused = asyncpg.InsufficientPrivilegeError


@dataclass
class Secured:
    pg: EmbeddedPostgres
    roles: pg_roles.MeshRoles
    keys: Path

    async def pool(self, service: str, name: str = "") -> asyncpg.Pool:
        return await db.connect(self.roles.dsn(service), max_size=2, name=name)


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[Secured]:
    keys = tmp_path / "auth"
    pw = pg_roles.superuser_passfile(keys)
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False, passfile=pw).start)
    try:
        yield Secured(pg, await pg_roles.provision(pg, keys), keys)
    finally:
        await asyncio.to_thread(pg.stop)


async def test_no_password_no_entry(
    secured: Secured, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PGPASSWORD", raising=False)
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "none"))  # not ~/.pgpass either
    port = secured.pg.port
    for role in ("postgres", "tangram_gateway"):
        tcp = f"postgresql://{role}@127.0.0.1:{port}/postgres"
        sock = f"postgresql://{role}@/postgres?host={secured.pg.data_dir}&port={port}"
        for dsn in (tcp, sock):
            with pytest.raises(asyncpg.InvalidPasswordError):
                await asyncpg.connect(dsn, password="guessed")
            with pytest.raises((asyncpg.InvalidPasswordError, asyncpg.InterfaceError)):
                await asyncpg.connect(dsn)
    assert (secured.keys.stat().st_mode & 0o777) == 0o700
    for f in secured.keys.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert "password" not in secured.roles.dsn("gateway").split("?")[0]
    assert secured.roles.dsn("cpu_manager") == ""  # node agents use no Postgres: no role


async def test_the_gateway_role_does_intake_and_nothing_of_the_scheduler(secured: Secured) -> None:
    admin = await asyncpg.connect(secured.pg.dsn)  # the superuser's DSN names its passfile
    await admin.execute("GRANT UPDATE, DELETE ON actions TO tangram_gateway")  # a stale grant
    await admin.close()
    await pg_roles.provision(secured.pg, secured.keys)  # at every start: exactly the table
    gw = await secured.pool("gateway")
    try:
        assert await db.migrate(gw) == []  # nothing pending: no DDL right needed
        aid = "pgr-1"
        cols = [[aid], ["job"], ["traj"], ["exec"], [b"spec"], [1.0], ["alice"]]  # claims traj
        assert [r["action_id"] for r in await gw.fetch(gateway_store._INSERT, *cols)] == [aid]
        one = ["pgr-1b", "job", "traj", "exec", b"spec", 1.0, "alice"]  # alone, by its key
        assert [r["action_id"] for r in await gw.fetch(gateway_store._INSERT_ONE, *one)] == [
            "pgr-1b"
        ]
        assert await gateway_store.fetch_result(gw, aid) == gateway_store.Existing(
            "queued", None, "alice"
        )
        assert await gateway_store.trajectory_owner(gw, "traj") == "alice"
        assert await gateway_store.fetch_existing(gw, [aid])
        await gw.execute(services_api._UPSERT, "svc", b"x")
        await gw.execute(quotas_api._UPSERT, "q", b"x")
        await gw.execute(quotas_api._UPSERT, "q", b"y")
        assert [r["spec"] for r in await gw.fetch("SELECT spec FROM quotas")] == [b"y"]
        for sql in (
            "UPDATE actions SET status = 'succeeded' WHERE action_id = 'pgr-1'",
            "DELETE FROM actions",
            "SELECT spec FROM actions",
            "SELECT * FROM action_events",
            "INSERT INTO action_events (action_id, attempt, status, at) VALUES ('a', 1, 'x', 1)",
            "SELECT * FROM scheduler_leader",
            "UPDATE scheduler_leader SET epoch = epoch + 1000",
            "SELECT nextval('scheduler_epoch')",
            "SELECT * FROM health_events",
            "SELECT * FROM envs",
            "SELECT * FROM spans",
            "DELETE FROM quotas",
            "CREATE TABLE mine (a int)",
            "ALTER TABLE actions ADD COLUMN x int",
        ):
            with pytest.raises(Refused):
                await gw.execute(sql)
    finally:
        await gw.close()


async def test_the_scheduler_role_leads_fences_and_writes_transitions(secured: Secured) -> None:
    own = f"{scheduler_store.SESSIONS} own"
    sched = await secured.pool("scheduler", own)
    other = await secured.pool("scheduler", f"{scheduler_store.SESSIONS} replaced")
    gw = await secured.pool("gateway")
    try:
        cols = [["pgr-2"], ["job"], ["traj"], ["exec"], [b"spec"], [1.0], [""]]
        await gw.fetch(gateway_store._INSERT, *cols)
        assert await db.migrate(sched) == []
        assert await sched.fetchval("SELECT pg_try_advisory_lock(1234)")
        assert await scheduler_store.fence(sched, own) == 1  # its own role's other session
        with pytest.raises(Refused):  # but not another role's
            await sched.fetchval(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE usename = 'tangram_gateway'"
            )
        epoch = await scheduler_store.take_lead(sched)
        async with sched.acquire() as conn:
            await scheduler_store.check_lead(conn, epoch)
        finished = [["pgr-2"], [1], ["succeeded"], [b"r"], [None], [0], [2.0], ["n0"], epoch]
        assert await sched.execute(scheduler_store._FINISHED, *finished) == "INSERT 0 1"
        done = "SELECT status FROM actions WHERE action_id = 'pgr-2'"
        assert await gw.fetchval(done) == "succeeded"  # what the gateway reads back
        await gw.fetch(gateway_store._INSERT_ONE, "pgr-3", "job", "traj", "exec", b"s", 1.0, "")
        started = ["pgr-3", 1, "n0", "i0", "{0}", 2.0, epoch]  # one record alone, by its key
        assert await sched.execute(scheduler_store._STARTED_ONE, *started) == "INSERT 0 1"
        finished = ["pgr-3", 1, "succeeded", b"r", None, 0, 3.0, "n0", epoch]
        assert await sched.execute(scheduler_store._FINISHED_ONE, *finished) == "INSERT 0 1"
        assert await gw.fetchval(done.replace("pgr-2", "pgr-3")) == "succeeded"
        health = [datetime.datetime.now(datetime.UTC), "n", "i", "node", "suspect", "failed", ""]
        await sched.execute(HEALTH_INSERT, *[[x] for x in health])
        assert await prune_health(sched, 1.0, 1) == 0  # may delete (a recent fencing stays)
        assert await scheduler_store.load_open(sched) == []
        await scheduler_store.load_envs(sched)
        await quota_store.load_quotas(sched)
        await gpu_shell.load_services(sched)
        for sql in (
            "INSERT INTO actions (action_id, job_id, trajectory_id, kind, status, spec,"
            " submitted_at) VALUES ('forged', 'j', 't', 'exec', 'queued', '', 1)",
            "DELETE FROM actions",
            "UPDATE actions SET spec = ''",
            "INSERT INTO quotas (name, spec) VALUES ('q', '')",
            "SELECT * FROM spans",
        ):
            with pytest.raises(Refused):
                await sched.execute(sql)
    finally:
        for pool in (sched, other, gw):
            pool.terminate()


async def test_the_dashboard_role_reads_actions_and_keeps_spans(secured: Secured) -> None:
    dash = await secured.pool("dashboard")
    try:
        assert await db.migrate(dash) == []
        await search(dash, ActionQuery())
        writer = SpanWriter(DashboardConfig(), dash, lambda: 10.0)
        writer.add([SpanRecord(trace_id="ab", span_id="cd", name="n", start=1.0, end=2.0)])
        await writer.flush()
        assert writer.written == 1
        await writer.prune()
        for sql in ("UPDATE actions SET status = 'failed'", "SELECT * FROM scheduler_leader"):
            with pytest.raises(Refused):
                await dash.execute(sql)
    finally:
        await dash.close()


async def test_a_secure_mesh_runs_under_its_roles_and_after_a_restart(
    open_state: Path, uid: str
) -> None:
    for n in (1, 2):  # the second start: the same state dir, passwords kept
        mesh_cm = running_mesh(open_state, secure=True, quota_manager=False, dashboard=True)
        async with mesh_cm as mesh:
            assert mesh.service_env("cpu_manager")["TANGRAM_POSTGRES_DSN"] == ""
            async with Client.connect(mesh.nats_url, creds=mesh.client_creds) as client:
                res = await client.exec("true", trajectory_id=f"{uid}-{n}", job_id=uid)
            assert res.exit_code == 0, res
            conn = await asyncpg.connect(mesh.postgres_dsn)  # the superuser's, by its passfile
            try:
                rows = await conn.fetch(
                    "SELECT DISTINCT usename FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
                    " AND backend_type = 'client backend'"
                )
            finally:
                await conn.close()
            users = {r["usename"] for r in rows}
            assert users == {"tangram_gateway", "tangram_scheduler", "tangram_dashboard"}
    for log in (open_state / "logs").iterdir():
        assert "permission denied" not in log.read_text(), log.name


async def test_a_trusting_cluster_of_an_earlier_mesh_is_locked_down(tmp_path: Path) -> None:
    """A state dir of a mesh before roles (tables the superuser's, local users trusted): its
    next secure start demands passwords and hands the schema to the owner."""
    trusting = EmbeddedPostgres(tmp_path / "pg", fsync=False)
    pg = await asyncio.to_thread(trusting.start)
    try:
        pool = await db.connect(pg.dsn, max_size=1)
        await db.migrate(pool)
        await pool.close()
    finally:
        await asyncio.to_thread(pg.stop)
    keys = tmp_path / "auth"
    locked = EmbeddedPostgres(
        tmp_path / "pg", fsync=False, passfile=pg_roles.superuser_passfile(keys)
    )
    pg = await asyncio.to_thread(locked.start)
    try:
        with pytest.raises(asyncpg.InvalidPasswordError):
            await asyncpg.connect(locked.dsn_as("postgres", None), password="guessed")
        roles = await pg_roles.provision(pg, keys)
        conn = await asyncpg.connect(pg.dsn)
        owners = await conn.fetch(
            "SELECT DISTINCT pg_get_userbyid(relowner) AS o FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'"
        )
        await conn.close()
        assert [r["o"] for r in owners] == [pg_roles.OWNER]
        gw = await asyncpg.connect(roles.dsn("gateway"))
        with pytest.raises(Refused):
            await gw.execute("DELETE FROM actions")
        await gw.close()
    finally:
        await asyncio.to_thread(pg.stop)
