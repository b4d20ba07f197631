"""``tangram client add NAME [--admin] | list | remove NAME``: client credentials of a mesh, so
that RL jobs (teams) are principals of their own: each reads its own results alone, and the
gateway answers each for its own actions and trajectories (``services/gateway/ownership.py``).
Only an admin client (the default one, or one added with ``--admin``) may change what every
job depends on: register model services, set quotas.

``tangram dashboard`` prints the dashboard's URL with its token (the keyring keeps it).

A credential is a file in the mesh's keyring (``<state>/auth/client-NAME.json``, see
:mod:`tangram.auth`); the broker's config is rebuilt from every client file there, and the
running nats-server reloads it (SIGHUP to the pid it wrote in its data dir): no restart. A
later ``tangram up`` on the same state dir admits the same clients (``MeshAuth``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from tangram import auth, discovery
from tangram.auth import CLIENT, DEFAULT_CLIENT, FRONT, SERVICE_ROLES, Keyring, Principal
from tangram.bus import admits
from tangram.embedded import NATS_PID_FILE
from tangram.errors import InvalidRequest, NotFound, Unavailable

NAME_MAX = 64
RELOAD_WAIT_S = 5.0  # the broker admits a new client within this of the reload signal
LOCK_FILE = ".clients.lock"
TOKEN_VAR, TOKEN_FILE_VAR = "TANGRAM_DASHBOARD_TOKEN", "TANGRAM_DASHBOARD_TOKEN_FILE"
# the ids of the service principals that share the clients' subjects (auth.ROUTES)
SERVICE_IDS = frozenset(name for name, role in SERVICE_ROLES.items() if role == FRONT)


def client_name(text: str) -> str:
    """A client's name (an argparse type): what a NATS subject token and a file name take."""
    if not text or len(text) > NAME_MAX:
        raise argparse.ArgumentTypeError(f"a client name has 1 to {NAME_MAX} characters")
    try:
        Principal(CLIENT, text)
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return text


# ------------------------------------------------------------------ the keyring (no I/O but files)


def add_client(ring: Keyring, name: str, admin: bool = False) -> Path:
    """Make the credential of client ``name`` (an admin's: ``admin``); refused when it exists,
    or when a service principal owns subjects under that id (the reward front's results and
    gateway subject: a client of its name would read its results and act on its actions)."""
    who = Principal(CLIENT, name)
    if name in SERVICE_IDS:
        raise InvalidRequest(f"client name {name!r} is a service's own id: pick another")
    if ring.path(who).exists():
        raise InvalidRequest(
            f"client {name!r} exists: {ring.path(who)}",
            hint="to change whether it is an admin, remove it and add it again",
        )
    return ring.ensure(who, admin=admin)


def remove_client(ring: Keyring, name: str) -> Path:
    """Delete the credential of client ``name`` (never the default one, which mesh.json names)."""
    who = Principal(CLIENT, name)
    if who == DEFAULT_CLIENT:
        raise InvalidRequest(
            "the default client cannot be removed: mesh.json names it for every client that"
            " gives no credentials (the two-command setup)"
        )
    path = ring.path(who)
    if not path.exists():
        raise NotFound(f"no client {name!r} in {ring.dir}; `tangram client list` shows them")
    path.unlink()
    return path


def rewrite_config(ring: Keyring) -> Path | None:
    """The broker's config, its clients those of the keyring now (None: it has none yet, and
    the next ``tangram up`` writes one with them)."""
    admitted = ring.admitted()
    if not admitted:
        return None
    keep = [p for p in admitted if p.role != CLIENT]
    return ring.server_config(keep + ring.clients())


@contextlib.contextmanager
def locked(ring: Keyring) -> Iterator[None]:
    """One change of the keyring at a time (two `tangram client add` at once)."""
    if not ring.dir.is_dir():
        raise NotFound(
            f"no keyring in {ring.dir}: `tangram up` makes it (with auth) in its state dir;"
            " give that --state-dir"
        )
    fd = os.open(ring.dir / LOCK_FILE, os.O_WRONLY | os.O_CREAT, 0o600)  # as private as the rest
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the live broker


def nats_pid(state: Path, config: Path) -> int:
    """The pid of the mesh's embedded nats-server, as it wrote it at its last (re)start; checked
    to be a nats-server running ``config`` (a stale file's pid may be anyone's now)."""
    pid_file = state / "nats" / NATS_PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError) as exc:
        raise Unavailable(f"the mesh's nats-server is not running ({pid_file}: {exc})") from None
    if not (b"nats-server" in cmdline[0] and _runs(pid, cmdline, config)):
        raise Unavailable(f"pid {pid} in {pid_file} is not this mesh's nats-server")
    return pid


def _runs(pid: int, cmdline: list[bytes], config: Path) -> bool:
    """Whether the process ``pid`` was given ``config`` (a path relative to its cwd, maybe)."""
    cwd = Path(f"/proc/{pid}/cwd")
    for arg in cmdline:
        if arg.endswith(config.name.encode()):
            with contextlib.suppress(OSError):
                if os.path.samefile(cwd / os.fsdecode(arg), config):
                    return True
    return False


def reload(state: Path, config: Path) -> None:
    """Make the running nats-server reload ``config`` (its users: connected clients stay)."""
    os.kill(nats_pid(state, config), signal.SIGHUP)


async def wait_admitted(url: str, creds: Path) -> None:
    """Until the broker admits ``creds`` (the reload is asynchronous)."""
    deadline = time.monotonic() + RELOAD_WAIT_S
    while True:
        try:
            if await admits(url, creds):
                return
            why = "its login is refused still"
        except Unavailable as exc:
            why = str(exc)
        if time.monotonic() > deadline:
            raise Unavailable(
                f"the broker did not admit {creds} within {RELOAD_WAIT_S:.0f}s ({why}); the"
                " credential and the broker's config are written: the mesh's nats-server"
                " admits it when it (re)starts"
            )
        await asyncio.sleep(0.05)


# ------------------------------------------------------------------ the commands


def _live_mesh(state: Path) -> dict[str, object] | None:
    """The live mesh of ``state``; refused when it runs without auth (nothing to add)."""
    info = discovery.read_mesh(state / discovery.MESH_FILE)
    if info is not None and not info.get("client_creds"):
        raise InvalidRequest(
            f"the mesh of {state} runs without authentication: it admits any client as is"
        )
    return info


async def cmd_client(args: argparse.Namespace) -> int:
    if args.client_cmd == "list":
        return await asyncio.to_thread(_list, Keyring(Path(args.state_dir)))
    path, url = await asyncio.to_thread(change, Path(args.state_dir), args)
    if args.client_cmd == "add":
        if url:
            await wait_admitted(url, path)
        print(path)  # alone on stdout: CREDS=$(tangram client add team-a)
    where = "the live mesh" if url else "the next `tangram up`"
    if args.client_cmd == "add":
        use = f"TANGRAM_CREDS={path} or Client.connect(creds=...)"
        print(f"client {args.name}: {where} admits it; use it: {use}", flush=True)
    else:
        print(f"client {args.name}: removed; {where} refuses it", flush=True)
    return 0


def change(state: Path, args: argparse.Namespace) -> tuple[Path, str]:
    """Add or remove a client, rewrite the broker's config and have a live one reload it:
    the credential's path and the live mesh's NATS URL ("" when none runs)."""
    state = state.resolve()
    info = _live_mesh(state)
    ring = Keyring(state)
    with locked(ring):
        if args.client_cmd == "add":
            path = add_client(ring, args.name, admin=args.admin)
        else:
            path = remove_client(ring, args.name)
        config = rewrite_config(ring)
        if info is None or config is None:
            return path, ""
        try:
            reload(state, config)
        except Unavailable as exc:
            # The mesh lives but its broker does not run now: the supervisor of `tangram up`
            # restarts it, and the restarted one reads the config written above.
            print(f"tangram: {exc}; waiting for it to restart", file=sys.stderr, flush=True)
    return path, str(info["nats_url"])


def _list(ring: Keyring) -> int:
    if not ring.dir.is_dir():
        raise NotFound(f"no keyring in {ring.dir}: `tangram up` makes it in its state dir")
    for who in ring.clients():
        role = "admin" if auth.is_admin(auth.load_creds(ring.path(who))) else "client"
        note = "  (default: mesh.json's client_creds)" if who == DEFAULT_CLIENT else ""
        print(f"{who.id:<24} {role:<6} {ring.path(who)}{note}")
    return 0


def dashboard_url(state: Path) -> str:
    """The URL with its token of the dashboard of the live mesh in ``state``: mesh.json's
    ``dashboard_url`` (others may read that file) and the token in the keyring (they may not)."""
    info = discovery.read_mesh(state / discovery.MESH_FILE)
    if info is None or not info.get("dashboard_url"):
        raise NotFound(f"no mesh with a dashboard runs in {state}; `tangram up` starts one")
    token = auth.read_token(state / auth.AUTH_DIR / auth.DASHBOARD_TOKEN)
    return auth.login_url(str(info["dashboard_url"]), token)


async def cmd_dashboard(args: argparse.Namespace) -> int:
    """Print the dashboard's URL with its token: the live mesh's, or ``--url``'s (compose)."""
    state = Path(args.state_dir)
    if args.url:  # the token the dashboard of this environment takes (compose's container)
        path = os.environ.get(TOKEN_FILE_VAR) or state / auth.AUTH_DIR / auth.DASHBOARD_TOKEN
        token = os.environ.get(TOKEN_VAR) or auth.read_token(path)
        print(auth.login_url(args.url, token))
    else:
        print(await asyncio.to_thread(dashboard_url, state))
    return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser], state: str) -> None:
    cp = sub.add_parser(
        "client",
        help="client credentials: one principal per RL job or team (add NAME, list, remove)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cs = cp.add_subparsers(dest="client_cmd", required=True)
    for name, text in (
        ("add", "make client NAME's credential; the live mesh admits it at once"),
        ("remove", "delete client NAME's credential; the live mesh refuses it at once"),
        ("list", "the clients of the mesh and their credential files"),
    ):
        p = cs.add_parser(name, help=text)
        p.add_argument("--state-dir", default=state, help="the mesh's state dir (its keyring)")
        if name != "list":
            p.add_argument("name", type=client_name, help="letters, digits, '_' and '-'")
    cs.choices["add"].add_argument(
        "--admin",
        action="store_true",
        help="it may also register model services and set quotas (they change the whole mesh)",
    )
    dp = sub.add_parser(
        "dashboard",
        help="print the dashboard's URL with its token (the URL mesh.json names has none)",
    )
    dp.add_argument("--state-dir", default=state, help="the mesh's state dir (its keyring)")
    dp.add_argument(
        "--url",
        default=None,
        help="the dashboard's base URL, for a mesh that `tangram up` does not run (compose:"
        " --state-dir /var/lib/tangram-keys --url http://127.0.0.1:8265)",
    )


COMMANDS = {"client": cmd_client, "dashboard": cmd_dashboard}
