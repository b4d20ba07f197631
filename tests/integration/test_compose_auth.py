"""compose is locked down as ``tangram up`` is: its one-shot services run ``tangram auth`` into
the tangram-keys volume before anything else starts, NATS runs with the config it wrote, and
every Tangram service presents its own credential and logs in as its own Postgres role.

The compose file is checked through a real compose tool (``docker compose config``: no engine
here); what ``tangram auth`` writes is checked for real: a nats-server started with its config
(as compose's nats is) refuses what it must, and the Postgres roles it makes have exactly the
privileges ``tangram up`` gives them.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
import yaml
from nats.aio.client import Client as NATS

from services.gateway.formulation import Limits, formulate
from tangram import auth, cli, cli_auth, db, pg_roles, subjects
from tangram.auth import NODE, SCHEDULER, Keyring, Principal
from tangram.bus import Bus
from tangram.contract import Dispatch, NodeReport, encode
from tangram.contract.agent import Inventory
from tangram.discovery import free_port
from tangram.embedded import EmbeddedNats, EmbeddedPostgres
from tangram.errors import Unavailable
from tests.integration.test_compose import COMPOSE, compose_tool
from tests.support import eventually, exec_spec, raw_nats

KEYS = Path("/var/lib/tangram-keys")  # where compose mounts the tangram-keys volume
SERVICES = ("gateway", "scheduler", "scheduler-standby", "cpu_manager", "quota_manager")
SERVICES += ("gpu_manager", "dashboard")
TANGRAM = str(Path(sys.executable).parent / "tangram")


def compose_config(**env: str) -> dict[str, Any]:
    out = subprocess.run(
        [*compose_tool(), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr
    services: dict[str, Any] = yaml.safe_load(out.stdout)["services"]
    return services


@pytest.fixture(scope="module")
def spec() -> dict[str, Any]:
    return compose_config()


def mounts(svc: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """target -> (source, read-only), from the short syntax (docker-compose 1) or the long one
    (docker compose 2 prints)."""
    found = {}
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            found[target] = (source, "ro" in mode)
        else:
            found[v["target"]] = (v["source"], bool(v.get("read_only")))
    return found


def base(name: str) -> str:
    return "scheduler" if name == "scheduler-standby" else name


# ------------------------------------------------------------------ the compose file


@pytest.mark.parametrize("name", SERVICES)
def test_each_service_has_its_own_credential_and_role(spec: dict[str, Any], name: str) -> None:
    env = spec[name]["environment"]
    who = auth.service_principal(base(name), env)
    assert who is not None
    assert env[auth.CREDS_VAR] == str(Keyring(KEYS).path(who))  # what auth-nats writes
    assert mounts(spec[name])[str(KEYS)] == ("tangram-keys", True)
    admin = spec["auth-postgres"]["environment"][cli_auth.ADMIN_DSN_VAR]
    if base(name) in pg_roles.GRANTS:
        role = pg_roles.role_of(base(name))
        keys = KEYS / auth.AUTH_DIR
        assert env["TANGRAM_POSTGRES_DSN"] == pg_roles.dsn_as(
            admin, role, pg_roles.passfile(keys, role)
        )
        assert urlsplit(env["TANGRAM_POSTGRES_DSN"]).password is None
    else:  # node agents use no Postgres
        assert env["TANGRAM_POSTGRES_DSN"] == ""


def test_only_the_one_shot_holds_the_superuser(spec: dict[str, Any]) -> None:
    superuser = spec["postgres"]["environment"]["POSTGRES_USER"]
    holders = [
        name
        for name, svc in spec.items()
        for value in (svc.get("environment") or {}).values()
        if f"://{superuser}:" in str(value)
    ]
    assert holders == ["auth-postgres"]


def test_nats_runs_with_the_config_auth_nats_writes(spec: dict[str, Any]) -> None:
    nats_svc = spec["nats"]
    cmd = nats_svc["command"]
    assert cmd[cmd.index("-c") + 1] == str(KEYS / auth.AUTH_DIR / auth.SERVER_CONF)
    assert "-js" in cmd
    assert cmd[cmd.index("-m") + 1] == "8222"
    assert mounts(nats_svc)[str(KEYS)] == ("tangram-keys", True)
    assert any("8222/healthz" in part for part in nats_svc["healthcheck"]["test"])
    assert nats_svc["depends_on"]["auth-nats"]["condition"] == "service_completed_successfully"


def test_the_keys_are_made_once_before_anything_else(spec: dict[str, Any]) -> None:
    made, roles = spec["auth-nats"], spec["auth-postgres"]
    args = cli.parser().parse_args(made["command"][1:])  # a command the CLI takes
    assert (args.cmd, args.auth_cmd, args.dir) == ("auth", "nats", str(KEYS))
    given = {"cpu_manager": args.cpu_node, "quota_manager": args.quota_node}
    given["gpu_manager"] = args.gpu_node
    for service, ids in given.items():  # the ids the node agents run with
        assert ids == [spec[service]["environment"][auth.NODE_ID_VARS[service]]]
    assert cli.parser().parse_args(roles["command"][1:]).auth_cmd == "postgres"
    assert roles["depends_on"]["auth-nats"]["condition"] == "service_completed_successfully"
    assert roles["depends_on"]["postgres"]["condition"] == "service_healthy"
    for one_shot in (made, roles):
        assert one_shot["restart"] == "no"
        assert mounts(one_shot)[str(KEYS)] == ("tangram-keys", False)
    dockerfile = (COMPOSE.parent / "Dockerfile").read_text()
    assert f"-o tangram -g tangram -m 0700 {KEYS}" in dockerfile  # the volume's owner


def test_a_node_id_from_the_environment_reaches_its_credential() -> None:
    spec = compose_config(TANGRAM_CPU_NODE_ID="rack7")
    assert "--cpu-node=rack7" in spec["auth-nats"]["command"]
    creds = spec["cpu_manager"]["environment"][auth.CREDS_VAR]
    assert creds == str(Keyring(KEYS).path(Principal(NODE, "rack7")))


# ------------------------------------------------------------------ what tangram auth writes


@dataclass
class Broker:
    url: str
    http_port: int
    ring: Keyring


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[Broker]:
    """A nats-server started as compose starts it: JetStream, monitoring, the written config."""
    proc = await asyncio.create_subprocess_exec(
        TANGRAM, "auth", "nats", str(tmp_path), "--cpu-node", "n1", "--cpu-node", "n2",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    conf = tmp_path / auth.AUTH_DIR / auth.SERVER_CONF
    assert f"nats config {conf}" in out.decode()
    port = free_port()
    server = EmbeddedNats(tmp_path / "nats", config=conf, http_port=port)
    await asyncio.to_thread(server.start)
    try:
        yield Broker(server.url, port, Keyring(tmp_path))
    finally:
        await asyncio.to_thread(server.stop)


async def connect(b: Broker, who: Principal, errors: list[Exception]) -> NATS:
    return await raw_nats(b.url, b.ring.path(who), errors)


def refused(errors: list[Exception], subject: str) -> bool:
    return any(f'publish to "{subject}"' in str(e).lower() for e in errors)


async def test_the_written_config_refuses_strangers_and_clients_inside(broker: Broker) -> None:
    health = f"http://127.0.0.1:{broker.http_port}/healthz"
    with await asyncio.to_thread(urllib.request.urlopen, health, timeout=5) as r:
        assert r.status == 200  # compose's healthcheck: monitoring needs no credential
    with pytest.raises(Unavailable, match="credentials required"):
        await Bus.connect(broker.url, "stranger", deadline_s=5)

    node_subject = subjects.node("n1").subject
    errors: list[Exception] = []
    node = await connect(broker, Principal(NODE, "n1"), errors)
    client = await connect(broker, auth.DEFAULT_CLIENT, errors)
    scheduler = await connect(broker, Principal(SCHEDULER), errors)
    try:
        heard = await node.subscribe(node_subject)
        await node.flush()
        forged = encode(Dispatch(action=_action(), cores=(0,), epoch=1))
        await client.publish(node_subject, forged)
        await client.flush()
        await eventually(lambda: refused(errors, node_subject), what="the broker's refusal")
        await scheduler.publish(node_subject, b"real")  # the one sender it lets through
        msg = await heard.next_msg(timeout=5)
        assert msg.data == b"real"  # the forged dispatch never reached the node
    finally:
        for nc in (node, client, scheduler):
            await nc.close()


async def test_a_node_speaks_on_its_own_subject_alone(broker: Broker) -> None:
    errors: list[Exception] = []
    node = await connect(broker, Principal(NODE, "n1"), errors)
    scheduler = await connect(broker, Principal(SCHEDULER), errors)
    try:
        heard = await scheduler.subscribe(subjects.SCHED_NODES.subject)
        await scheduler.flush()
        other = subjects.sched_node("n2").subject
        await node.publish(other, b"forged")
        report = encode(NodeReport(node_id="n1", incarnation="x", inventory=Inventory()))
        await node.publish(subjects.sched_node("n1").subject, report)
        await node.flush()
        msg = await heard.next_msg(timeout=5)
        assert (msg.subject, msg.data) == (subjects.sched_node("n1").subject, report)
        await eventually(lambda: refused(errors, other), what="n2's subject refused to n1")
    finally:
        await node.close()
        await scheduler.close()
    before = {p.name: p.read_bytes() for p in broker.ring.dir.iterdir()}
    again = {**{s: [i] for s, i in cli_auth.DEFAULT_NODES.items()}, "cpu_manager": ["n1", "n2"]}
    cli_auth.write_nats(broker.ring.dir.parent, again)  # as the broker's was, run again
    assert {p.name: p.read_bytes() for p in broker.ring.dir.iterdir()} == before  # kept


def _action() -> Any:
    return formulate(exec_spec("forged-1", "forged", "id"), now=time.time(), limits=Limits())


# ------------------------------------------------------------------ the Postgres roles

_ACLS = """
SELECT c.relname, c.relkind::text, pg_get_userbyid(c.relowner) AS owner, c.relacl::text AS acl,
  (SELECT array_agg(a.attname || '=' || a.attacl::text ORDER BY a.attname)
   FROM pg_attribute a WHERE a.attrelid = c.oid AND a.attacl IS NOT NULL) AS columns
FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname = 'public' ORDER BY c.relname
"""
_ROLES = """
SELECT rolname, rolsuper, rolcreaterole, rolcreatedb, rolcanlogin, rolbypassrls
FROM pg_roles WHERE rolname LIKE 'tangram%' ORDER BY rolname
"""


async def privileges(dsn: str) -> list[list[Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [[tuple(r) for r in await conn.fetch(sql)] for sql in (_ACLS, _ROLES)]
    finally:
        await conn.close()


async def test_the_roles_are_tangram_ups(tmp_path: Path) -> None:
    keys = tmp_path / auth.AUTH_DIR
    pw = pg_roles.superuser_passfile(keys)
    pg = await asyncio.to_thread(EmbeddedPostgres(tmp_path / "pg", fsync=False, passfile=pw).start)
    try:
        admin = await db.connect(pg.dsn, max_size=1)  # an older compose: its superuser's schema
        await db.migrate(admin)
        await admin.close()
        env = {**os.environ, cli_auth.ADMIN_DSN_VAR: pg.dsn}
        proc = await asyncio.create_subprocess_exec(
            TANGRAM, "auth", "postgres", str(tmp_path), env=env, stdout=asyncio.subprocess.PIPE
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        printed = dict(line.split(maxsplit=1) for line in out.decode().splitlines())
        made = await privileges(pg.dsn)
        kept = {p.name: p.read_text() for p in keys.iterdir()}
        await pg_roles.provision(pg, keys)  # exactly what `tangram up` does at its start
        assert await privileges(pg.dsn) == made
        assert {p.name: p.read_text() for p in keys.iterdir()} == kept  # passwords kept
        roles = {r[0] for r in made[1]}
        assert roles == {pg_roles.OWNER, *map(pg_roles.role_of, pg_roles.GRANTS)}
        assert not any(r[1] for r in made[1])  # no superuser among them
        assert {r[2] for r in made[0]} == {pg_roles.OWNER}  # the old tables adopted
        assert set(printed) == set(pg_roles.GRANTS)
        gw = await asyncpg.connect(printed["gateway"])  # the DSN it printed logs in
        try:
            assert await gw.fetchval("SELECT current_user") == "tangram_gateway"
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await gw.execute("UPDATE actions SET status = 'succeeded'")
        finally:
            await gw.close()
    finally:
        await asyncio.to_thread(pg.stop)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["nats", "{missing}"], "no such directory"),
        (["nats", "{dir}", "--cpu-node", "a.b"], "only letters, digits"),
        (["nats", "{dir}", "--gpu-node", ""], "needs id"),
        (["postgres", "{dir}", "--admin-dsn", "host=db user=x"], "postgresql://"),
        (["postgres", "{dir}", "--admin-dsn", ""], "no admin DSN"),
    ],
)
def test_bad_input_is_refused_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    where = {"dir": str(tmp_path), "missing": str(tmp_path / "nope")}
    assert cli.main(["auth", *(a.format(**where) for a in argv)]) == 2
    assert says in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_missing_directory_argument_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["auth", "nats"])
    assert exited.value.code == 2
    assert "required: dir" in capsys.readouterr().err
