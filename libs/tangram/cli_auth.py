"""tangram auth: the credentials of a mesh that something other than ``tangram up`` runs
(compose/docker-compose.yml runs both subcommands once, before anything else starts).

tangram auth nats DIR       one credential per principal in DIR/auth (kept across runs, as
                            ``tangram up`` keeps its own) and the broker's config with every
                            principal's subject permissions (DIR/auth/nats-auth.conf)
tangram auth postgres DIR   each service's own Postgres role, granted exactly what it needs,
                            its password in DIR/auth/pg-<role>.pgpass; prints each DSN

Both do what ``tangram up`` does on its embedded servers, with the same code
(:class:`tangram.auth.MeshAuth`, :func:`tangram.pg_roles.provision_at`), so a compose mesh is
locked down exactly as a ``tangram up`` one. DIR must exist: a mistyped path must not quietly
start a second keyring that no server knows.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Final

from tangram import auth, pg_roles
from tangram.errors import InvalidRequest

# compose's node ids when their variables are unset (TANGRAM_CPU_NODE_ID ... in the compose file)
DEFAULT_NODES: Final = {"cpu_manager": "node0", "quota_manager": "quota0", "gpu_manager": "gpu0"}
_NODE_FLAGS: Final = {
    "cpu_manager": "cpu_node",
    "quota_manager": "quota_node",
    "gpu_manager": "gpu_node",
}
ADMIN_DSN_VAR: Final = "TANGRAM_POSTGRES_ADMIN_DSN"


def keys_dir(path: str) -> Path:
    """``path`` as the deployment's key directory; it must exist already."""
    found = Path(path)
    if not found.is_dir():
        raise InvalidRequest(f"{path}: no such directory (make it first; nothing was written)")
    return found.resolve()


def node_agents(ids: dict[str, list[str]]) -> list[tuple[str, dict[str, str]]]:
    """(service, env) of every node agent given, each id checked as the broker's user name."""
    agents = []
    for service, given in ids.items():
        for node_id in given:
            auth.Principal(auth.NODE, node_id)  # a clear error on an empty or a bad id
            agents.append((service, {auth.NODE_ID_VARS[service]: node_id}))
    return agents


def write_nats(state_dir: Path, ids: dict[str, list[str]]) -> tuple[Path, list[Path]]:
    """The broker's config admitting every principal, and each one's credential file."""
    agents = node_agents(ids)  # every id checked before anything is written
    mesh = auth.MeshAuth(state_dir)
    conf = mesh.server_config(agents)
    others: list[tuple[str, dict[str, str]]] = [
        (name, {}) for name in auth.SERVICE_ROLES if name not in auth.NODE_ID_VARS
    ]
    made = [mesh.service_creds(name, env) for name, env in [*others, *agents]]
    files = [p for p in made if p is not None] + [mesh.client_creds, mesh.ops_creds]
    files.append(mesh.dashboard_token)  # the dashboard's pages ask for it
    return conf, files


async def write_postgres(state_dir: Path, admin_dsn: str) -> pg_roles.MeshRoles:
    """Each service's role on the cluster ``admin_dsn`` reaches, as ``tangram up`` makes them."""
    keys = state_dir / auth.AUTH_DIR

    def dsn_as(role: str, passfile: Path) -> str:
        return pg_roles.dsn_as(admin_dsn, role, passfile)

    dsn_as(pg_roles.OWNER, keys)  # a bad DSN is refused before anything is written
    return await pg_roles.provision_at(admin_dsn, keys, dsn_as)


async def cmd_auth(args: argparse.Namespace) -> int:
    state_dir = keys_dir(args.dir)
    if args.auth_cmd == "nats":
        ids = {s: getattr(args, f) or [DEFAULT_NODES[s]] for s, f in _NODE_FLAGS.items()}
        conf, files = write_nats(state_dir, ids)
        for path in files:
            print(f"credential  {path}")
        print(f"nats config {conf}")
        return 0
    if not args.admin_dsn:
        raise InvalidRequest(f"no admin DSN: give --admin-dsn or set {ADMIN_DSN_VAR}")
    roles = await write_postgres(state_dir, args.admin_dsn)
    for service, dsn in sorted(roles.dsns.items()):
        print(f"{service:<11} {dsn}")
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "auth",
        help="write a deployment's credentials (NATS, Postgres roles), as tangram up makes them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    kinds = p.add_subparsers(dest="auth_cmd", required=True)
    nats = kinds.add_parser("nats", help="NATS credentials per principal and the server config")
    nats.add_argument("dir", help="the key directory (exists; the keyring goes in DIR/auth)")
    for service, flag in _NODE_FLAGS.items():
        nats.add_argument(
            f"--{flag.replace('_', '-')}",
            dest=flag,
            action="append",
            metavar="ID",
            help=f"a {service}'s node id (repeat for several; default {DEFAULT_NODES[service]})",
        )
    pg = kinds.add_parser("postgres", help="each service's own Postgres role and password file")
    pg.add_argument("dir", help="the key directory (exists; passwords go in DIR/auth)")
    pg.add_argument(
        "--admin-dsn",
        default=os.environ.get(ADMIN_DSN_VAR),
        help=f"a superuser's postgresql:// URL (default ${ADMIN_DSN_VAR}: keeps it off ps)",
    )


COMMANDS = {"auth": cmd_auth}
