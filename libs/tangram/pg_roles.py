"""Least-privilege Postgres roles for a secure mesh on its embedded cluster.

The schema belongs to an owner role that logs in nowhere: the launcher migrates as it
(``SET ROLE``) once at start, before any service starts. Each service that uses Postgres logs
in as a role of its own, granted exactly what its SQL does (:data:`GRANTS`, derived from the
statements of ``services/<name>/``); the node agents and the reward front use no Postgres and
get no role (an empty DSN). Grants are revoked and given again at every start in one
transaction, so the table here is the whole truth, also after it shrinks.

What grants cannot express: any role may take advisory locks (a gateway could take the
scheduler's lead lock and stall a takeover) and call functions open to everyone; a role may
end only its own role's sessions (``pg_terminate_backend``), which is all the scheduler's
fencing needs -- every scheduler process shares the one scheduler role, and no role gets
``pg_signal_backend``.

Passwords live in ``<state>/auth/pg-<role>.pgpass`` (0600), named by each DSN; they are made
once and kept, and set again on the roles at every start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, NamedTuple
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import asyncpg

from tangram import db
from tangram.embedded import EmbeddedPostgres, ensure_passfile
from tangram.errors import InvalidRequest

OWNER: Final = "tangram_owner"
PUBLIC_SCHEMA: Final = "public"


class Grant(NamedTuple):
    """``GRANT <privileges> ON <on>``: column lists where a service uses only some columns."""

    privileges: str
    on: str


# What each service's SQL does, and nothing more.
GRANTS: Final[Mapping[str, tuple[Grant, ...]]] = {
    "gateway": (
        # intake (gateway/store.py): new rows only; reads back an action's status and result
        Grant(
            "INSERT (action_id, job_id, trajectory_id, kind, status, spec, submitted_at, owner),"
            " SELECT (action_id, status, result, owner)",
            "TABLE actions",
        ),
        Grant("SELECT, INSERT", "TABLE trajectory_owners"),  # gateway/ownership.py
        # registrations (services_api, quotas_api): upserts, which need SELECT on the columns
        # they set as well as on the key; the quota book reads the specs
        Grant(
            "INSERT (name, spec), UPDATE (spec, updated_at), SELECT (name, spec)", "TABLE services"
        ),
        Grant(
            "INSERT (name, spec), UPDATE (spec, updated_at), SELECT (name, spec)", "TABLE quotas"
        ),
    ),
    "scheduler": (
        # transitions (scheduler/store.py) and the rebuild of its books; never a new action
        Grant(
            "SELECT, UPDATE (status, attempt, node_id, incarnation, cores, started_at, result,"
            " error_kind, exit_code, finished_at, updated_at)",
            "TABLE actions",
        ),
        Grant("SELECT, INSERT", "TABLE action_events"),
        Grant(
            "SELECT, INSERT,"
            " UPDATE (job_id, node_id, incarnation, memory_mb, status, reason, updated_at)",
            "TABLE envs",
        ),
        # the epoch: FOR KEY SHARE / FOR UPDATE on the row need an UPDATE privilege too
        Grant("SELECT, UPDATE (epoch)", "TABLE scheduler_leader"),
        Grant("USAGE", "SEQUENCE scheduler_epoch"),
        Grant("SELECT", "TABLE services, quotas"),  # reloaded at start (gpu_shell, quota_store)
        Grant("SELECT, INSERT, DELETE", "TABLE health_events"),  # scheduler/health.py: prune
        Grant("USAGE", "SEQUENCE health_events_id_seq"),
    ),
    "dashboard": (
        Grant("SELECT", "TABLE actions, action_events"),  # dashboard/queries.py
        Grant("SELECT, INSERT, DELETE", "TABLE spans"),  # dashboard/spans.py: COPY, prune
    ),
}
# Every role: db.migrate reads which migrations are applied (and applies none).
EVERY_ROLE: Final = (Grant("SELECT", "TABLE schema_migrations"),)


def passfile(auth_dir: Path, role: str) -> Path:
    """Where the password of ``role`` is kept."""
    return auth_dir / f"pg-{role}.pgpass"


def superuser_passfile(auth_dir: Path) -> Path:
    """The cluster's superuser password (given to :class:`EmbeddedPostgres`)."""
    return passfile(auth_dir, "postgres")


@dataclass(frozen=True)
class MeshRoles:
    """The DSN each service of a provisioned cluster connects with."""

    dsns: Mapping[str, str]

    def dsn(self, service: str) -> str:
        """``service``'s own DSN; empty for a service that uses no Postgres."""
        return self.dsns.get(service, "")


async def provision(pg: EmbeddedPostgres, auth_dir: Path) -> MeshRoles:
    """Roles made (or their passwords set again), the schema migrated by its owner, and each
    service role granted exactly :data:`GRANTS`. Idempotent: run at every start."""
    return await provision_at(pg.dsn, auth_dir, pg.dsn_as)


async def provision_at(
    admin_dsn: str, auth_dir: Path, dsn_as: Callable[[str, Path], str]
) -> MeshRoles:
    """:func:`provision` on any cluster (compose's: ``tangram auth postgres``), as the
    superuser ``admin_dsn`` names; ``dsn_as(role, passfile)`` is how a service reaches it."""
    roles = {service: role_of(service) for service in GRANTS}
    passwords = {r: ensure_passfile(passfile(auth_dir, r), r)[0] for r in roles.values()}
    conn = await asyncpg.connect(admin_dsn)
    try:
        await _make_roles(conn, passwords)
        await _adopt(conn)
        await conn.execute(f"SET ROLE {OWNER}")
        await db.migrate_on(conn)
        await conn.execute("RESET ROLE")
        async with conn.transaction():
            for service, role in roles.items():
                await _grant(conn, role, GRANTS[service])
    finally:
        await conn.close()
    return MeshRoles({s: dsn_as(r, passfile(auth_dir, r)) for s, r in roles.items()})


async def _make_roles(conn: asyncpg.Connection, passwords: Mapping[str, str]) -> None:
    """The owner (no login) and the service roles, each with its kept password."""
    have = {r["rolname"] for r in await conn.fetch("SELECT rolname FROM pg_roles")}
    for role in [OWNER, *passwords]:
        if role not in have:
            await conn.execute(f"CREATE ROLE {role} NOLOGIN")
    for role, password in passwords.items():
        sql = "SELECT format('ALTER ROLE %I LOGIN PASSWORD %L', $1::text, $2::text)"
        await conn.execute(await conn.fetchval(sql, role, password))
    # Only the owner creates; before Postgres 15 everyone could in the public schema.
    await conn.execute(f"REVOKE CREATE ON SCHEMA {PUBLIC_SCHEMA} FROM PUBLIC")
    await conn.execute(f"GRANT USAGE, CREATE ON SCHEMA {PUBLIC_SCHEMA} TO {OWNER}")


_NOT_OWNED = """
SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = $1 AND c.relkind::text = ANY($2::text[]) AND pg_get_userbyid(c.relowner) <> $3
"""


async def _adopt(conn: asyncpg.Connection) -> None:
    """Tables and sequences made before the owner existed (a state dir of an earlier, trusting
    mesh) become the owner's. Tables first: that takes their own sequences (bigserial) along."""
    for kinds, what in ((["r", "p"], "TABLE"), (["S"], "SEQUENCE")):
        for row in await conn.fetch(_NOT_OWNED, PUBLIC_SCHEMA, kinds, OWNER):
            sql = f"SELECT format('ALTER {what} %I OWNER TO {OWNER}', $1::text)"
            await conn.execute(await conn.fetchval(sql, row["relname"]))


async def _grant(conn: asyncpg.Connection, role: str, grants: tuple[Grant, ...]) -> None:
    """Exactly ``grants`` (and :data:`EVERY_ROLE`'s) for ``role``: what it had is revoked."""
    await conn.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA {PUBLIC_SCHEMA} FROM {role}")
    await conn.execute(f"REVOKE ALL ON ALL SEQUENCES IN SCHEMA {PUBLIC_SCHEMA} FROM {role}")
    for g in (*EVERY_ROLE, *grants):
        await conn.execute(f"GRANT {g.privileges} ON {g.on} TO {role}")


_DSN_OWN: Final = frozenset({"user", "password", "passfile"})  # a login's, not the server's


def dsn_as(admin_dsn: str, role: str, passfile: Path) -> str:
    """``admin_dsn``'s server, database and options (``sslmode``...), logging in as ``role``
    with the password kept in ``passfile``: the admin's user and password left out."""
    url = urlsplit(admin_dsn)
    if url.scheme not in ("postgresql", "postgres") or not url.hostname:
        raise InvalidRequest(
            "the admin DSN must be a postgresql://USER:PASSWORD@HOST[:PORT]/DB URL naming a host"
        )
    host = url.netloc.rpartition("@")[2]
    query = [(k, v) for k, v in parse_qsl(url.query) if k not in _DSN_OWN]
    query.append(("passfile", str(passfile)))
    return urlunsplit(
        ("postgresql", f"{quote(role)}@{host}", url.path, urlencode(query, safe="/"), "")
    )


def role_of(service: str) -> str:
    """The Postgres role ``service`` logs in as (a service of :data:`GRANTS`)."""
    return f"tangram_{service}"
