"""Who may say what on the bus: one credential per principal, and NATS subject permissions
derived from one table of routes.

A *principal* is a role (``client``, ``gateway``, ``scheduler``, ``node``, ``dashboard``,
``front``, ``ops``) and, for
the roles that own subjects of their own, an id: a node agent owns ``tangram.v1.node.<id>``,
a client credential owns ``tangram.v1.results.<id>.>`` and asks the gateway on
``tangram.v1.gateway.<id>`` (the gateway knows whose actions and trajectories are whose;
``tangram client add NAME`` makes one more: :mod:`tangram.cli_clients`). An *admin* client
(the default one, or one added with ``--admin``) asks on ``tangram.v1.admin.<id>`` instead, which
the broker lets admin credentials alone publish on: there the gateway also takes what changes
the whole mesh (model services, quotas). :data:`ROUTES` names,
for every subject
of :mod:`tangram.subjects`, which roles serve it (subscribe) and which send on it (publish);
each principal's permissions are derived from it, so a new subject left out of the table is
caught by a test, never silently open or closed. Every principal reads replies on its own inbox
prefix (``_INBOX_<user>``), so no one reads another's replies; a serving role may answer only
the requests it received (NATS ``allow_responses``). ``ops`` is the operator's own (``tangram up``,
``tangram status``): it may ask the gateway on its shared subject (requests without an owner)
and the scheduler's status, never talk to nodes.
A node agent sends to the scheduler on a subject of its own id (the scheduler checks the
message is that node's); only the gateway changes the scheduler's books.

Credentials are user/password pairs (no extra dependency on either side), one JSON file per
principal, mode 0600 in a 0700 directory of the state dir; the server's config holds them all.
Identity is the credential: processes sharing one credential are one principal to the broker.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import msgspec

from tangram import discovery, subjects
from tangram.contract import Completions, NodeMessage
from tangram.errors import InvalidRequest

CREDS_VAR: Final = "TANGRAM_CREDS"
AUTH_DIR: Final = "auth"
# The dashboard's token (its pages show every client's commands and outputs), and its URL with
# the token, in the auth dir; mesh.json names the URL without it.
DASHBOARD_TOKEN: Final = "dashboard-token"
DASHBOARD_URL: Final = "dashboard-url"
SERVER_CONF: Final = "nats-auth.conf"
INBOX_ROOT: Final = "_INBOX_"
ID: Final = "{id}"  # a route's placeholder for the principal's own id

CLIENT, GATEWAY, SCHEDULER, NODE, OPS = "client", "gateway", "scheduler", "node", "ops"
DASHBOARD: Final = "dashboard"
FRONT: Final = "front"  # a service that is a client of the mesh (reward_front): and its spans
ROLES: Final = (CLIENT, GATEWAY, SCHEDULER, NODE, OPS, DASHBOARD, FRONT)
SERVICES: Final = (GATEWAY, SCHEDULER, NODE, DASHBOARD, FRONT)  # every service ships spans
OWNS_ID: Final = frozenset({CLIENT, NODE, FRONT})  # roles whose principals own subjects
_NAME_OK: Final = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class Route:
    """A subject (``{id}`` = the serving principal's own id), who serves it, who sends on it."""

    subject: str
    serve: tuple[str, ...]
    send: tuple[str, ...]
    replies: bool = True  # its servers answer requests (a push subject: False)
    # whose id ``{id}`` is: the server's (its senders may send to any id), or the sender's
    # (it may send under its own id alone; its servers hear every id)
    sender_id: bool = False
    admin: bool = False  # only the admin principals of ``send`` may send on it


# Every subject of the mesh. A sender of a subject with ``{id}`` may send to any id (``*``),
# unless the id is the sender's own. Only the gateway changes the scheduler's books (intake,
# cancels, services): the read-only roles ask its status subject alone.
ROUTES: Final = (
    # the operator's door: its requests have no owner (see services/gateway/ownership.py)
    Route(subjects.GATEWAY.subject, serve=(GATEWAY,), send=(OPS,)),
    # a client asks on its own subject: the gateway knows whose actions and trajectories
    # are whose without trusting the message
    Route(subjects.gateway_of(ID).subject, serve=(GATEWAY,), send=(CLIENT, FRONT), sender_id=True),
    # an admin client's door: the broker, not the message, tells the gateway who may change
    # what every client depends on (register services, set quotas)
    Route(
        subjects.admin_of(ID).subject, serve=(GATEWAY,), send=(CLIENT,), sender_id=True, admin=True
    ),
    Route(subjects.SCHED_ACTIONS.subject, serve=(SCHEDULER,), send=(GATEWAY,)),
    Route(subjects.SCHED_STATUS.subject, serve=(SCHEDULER,), send=(GATEWAY, OPS, DASHBOARD)),
    # a node speaks for itself alone (the scheduler refuses a message for another node id)
    Route(subjects.sched_node(ID).subject, serve=(SCHEDULER,), send=(NODE,), sender_id=True),
    Route(subjects.SCHED_PRESSURE.subject, serve=(GATEWAY,), send=(SCHEDULER,)),
    Route(subjects.NODES_BROADCAST.subject, serve=(NODE,), send=(SCHEDULER,)),
    Route(subjects.node(ID).subject, serve=(NODE,), send=(SCHEDULER,)),
    Route(subjects.prefetch(ID).subject, serve=(NODE,), send=(SCHEDULER,)),
    Route(subjects.results(ID) + ".>", serve=(CLIENT, FRONT), send=(SCHEDULER,), replies=False),
    Route(subjects.SPANS.subject, serve=(DASHBOARD,), send=SERVICES, replies=False),
    # heartbeats: each role on its own subject (the listener refuses a beat naming another
    # role); one credential per role, so any gateway may still beat as any gateway instance
    Route(subjects.GATEWAY_BEATS.subject, serve=(SCHEDULER,), send=(GATEWAY,), replies=False),
    Route(subjects.SCHEDULER_BEATS.subject, serve=(SCHEDULER,), send=(SCHEDULER,), replies=False),
)


@dataclass(frozen=True)
class Principal:
    """One identity on the bus: a role, and an id for roles that own subjects."""

    role: str
    id: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"unknown role {self.role!r}; one of {', '.join(ROLES)}")
        if (self.role in OWNS_ID) != bool(self.id):
            raise InvalidRequest(
                f"role {self.role!r} {'needs' if self.role in OWNS_ID else 'takes no'} id"
            )
        if not set(self.id) <= _NAME_OK:
            raise InvalidRequest(f"id {self.id!r}: only letters, digits, '_' and '-'")

    @property
    def user(self) -> str:
        return f"{self.role}-{self.id}" if self.id else self.role


@dataclass(frozen=True)
class Grant:
    """What one principal may publish and subscribe to."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responds: bool  # may answer requests it received (on the requester's inbox)


def inbox_prefix(user: str) -> str:
    """The inbox prefix of ``user``'s requests: only it may subscribe under it."""
    return f"{INBOX_ROOT}{user}"


def grant(who: Principal, admin: bool = False) -> Grant:
    """The permissions of ``who`` (an admin client's: ``admin``), derived from :data:`ROUTES`."""
    pub = [
        r.subject.replace(ID, who.id if r.sender_id else "*")
        for r in ROUTES
        if who.role in r.send and (admin or not r.admin)
    ]
    # a server of the senders' ids hears them all (``>``: a node id may hold dots unauthed)
    sub = [
        r.subject.replace(ID, ">" if r.sender_id else who.id) for r in ROUTES if who.role in r.serve
    ]
    sub.append(inbox_prefix(who.user) + ".>")
    responds = any(who.role in r.serve and r.replies for r in ROUTES)
    return Grant(tuple(pub), tuple(sub), responds)


def check_sender(msg: NodeMessage, subject: str) -> None:
    """Refuse ``msg``, heard on ``subject``, unless every node id it speaks for is the one of
    that :func:`~tangram.subjects.sched_node` subject (the broker lets a node's credential
    send on its own alone): one node must not report, complete or leave for another."""
    prefix = subjects.SCHED_NODES_PREFIX + "."
    sender = subject[len(prefix) :] if subject.startswith(prefix) else ""
    ids = [c.node_id for c in msg.items] if isinstance(msg, Completions) else [msg.node_id]
    for node_id in ids:
        if node_id != sender:
            raise InvalidRequest(
                f"{type(msg).__name__} for node {node_id!r} on {subject}: a node agent sends"
                " for itself alone, on its own subject"
            )


class Creds(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One credential file: what a process presents to the broker."""

    user: str
    password: str
    id: str = ""  # the principal's own id: its results (client) or node subjects live under it
    # a client that may change the whole mesh (see is_admin); what the broker's config grants
    # decides, this only tells the client which subject to ask on
    admin: bool = False

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.user)

    def login(self) -> dict[str, Any]:
        """nats-py's connect options that present this credential: the user, its password and
        its own inbox prefix (the only one it may read replies under)."""
        return {"user": self.user, "password": self.password, "inbox_prefix": self.inbox_prefix}


def is_admin(creds: Creds) -> bool:
    """Whether ``creds`` is an admin client's: one added with ``--admin``, or the default
    client (mesh.json's, which the README's examples register services and set quotas with;
    its file may predate the field)."""
    return creds.admin or creds.user == DEFAULT_CLIENT.user


def client_inboxes(owner: str) -> tuple[str, ...]:
    """The inbox prefixes (with their final dot) under which the principals that may ask on
    ``owner``'s gateway subjects read replies: a request heard there whose reply subject is not
    under one of them would have the gateway answer onto someone else's subject."""
    roles = {role for r in ROUTES if r.sender_id and GATEWAY in r.serve for role in r.send}
    return tuple(inbox_prefix(f"{role}-{owner}") + "." for role in sorted(roles))


def load_creds(path: str | Path) -> Creds:
    """The credential in ``path``; a clear error when it is missing or malformed."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Creds)
    except OSError as exc:
        raise InvalidRequest(f"cannot read credentials {path}: {exc.strerror}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"credentials {path} are malformed: {exc}") from exc


def find_creds(url: str | None = None, state_dir: Path | None = None) -> Path | None:
    """The client credential to use: ``TANGRAM_CREDS``, else the ``client_creds`` beside the
    live mesh found in the state dir (when no URL is given, or it is that mesh's URL)."""
    return _from_env() or _beside_mesh("client_creds", url, state_dir)


def ops_creds(url: str | None = None, state_dir: Path | None = None) -> Path | None:
    """The operator's credential (``tangram status``): the ``ops_creds`` beside the live mesh
    at ``url``, else ``TANGRAM_CREDS`` (a client's would be refused the scheduler's subject)."""
    return _beside_mesh("ops_creds", url, state_dir) or _from_env()


def _from_env() -> Path | None:
    value = os.environ.get(CREDS_VAR)
    return Path(value) if value else None


def _beside_mesh(key: str, url: str | None, state_dir: Path | None) -> Path | None:
    info = discovery.read_mesh((state_dir or discovery.default_state_dir()) / discovery.MESH_FILE)
    if info is None or (url and url != info.get("nats_url")):
        return None
    value = info.get(key)
    return Path(value) if isinstance(value, str) and value else None


class Keyring:
    """The credentials of one mesh, in ``<state_dir>/auth``: made once, kept across restarts
    (services reconnecting after a broker restart present the same ones)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir / AUTH_DIR

    def path(self, who: Principal) -> Path:
        return self.dir / f"{who.user}.json"

    def ensure(self, who: Principal, admin: bool = False) -> Path:
        """The credential file of ``who`` (an admin client's: ``admin``), made now if missing."""
        path = self.path(who)
        if not path.exists():
            password = secrets.token_urlsafe(24)
            creds = Creds(user=who.user, password=password, id=who.id, admin=admin)
            _write_private(path, msgspec.json.encode(creds))
        return path

    def dashboard_token(self) -> Path:
        """The file of the dashboard's token (:data:`DASHBOARD_TOKEN`), made now if missing."""
        path = self.dir / DASHBOARD_TOKEN
        if not path.exists():
            _write_private(path, secrets.token_urlsafe(32).encode())
        return path

    def write_dashboard_url(self, base: str) -> Path:
        """Write the dashboard's URL with its token (:data:`DASHBOARD_URL`): mesh.json, which
        others may read, names the URL without it."""
        path = self.dir / DASHBOARD_URL
        _write_private(path, (login_url(base, read_token(self.dashboard_token())) + "\n").encode())
        return path

    def clients(self) -> list[Principal]:
        """Every client credential in this keyring (the default one and those added)."""
        found = [load_creds(p) for p in sorted(self.dir.glob(f"{CLIENT}-*.json"))]
        return [Principal(CLIENT, c.id) for c in found if c.user == f"{CLIENT}-{c.id}"]

    def admitted(self) -> list[Principal]:
        """The principals the broker's config written last admits (none: not written yet)."""
        path = self.dir / SERVER_CONF
        try:
            text = path.read_text()
        except FileNotFoundError:
            return []
        users = json.loads(text.removeprefix("authorization: "))["users"]
        return [_principal_of(str(u["user"])) for u in users]

    def server_config(self, principals: list[Principal]) -> Path:
        """Write the broker's authorization for ``principals`` (their files made if missing)."""
        found = [(p, load_creds(self.ensure(p))) for p in principals]
        users = [_user_entry(c, grant(p, admin=p.role == CLIENT and is_admin(c))) for p, c in found]
        text = "authorization: " + json.dumps({"users": users}, indent=1) + "\n"
        path = self.dir / SERVER_CONF
        _write_private(path, text.encode())
        return path


def _principal_of(user: str) -> Principal:
    """The principal whose :attr:`Principal.user` is ``user`` (roles hold no '-')."""
    role, _, id_ = user.partition("-")
    return Principal(role, id_)


def _user_entry(creds: Creds, g: Grant) -> dict[str, object]:
    perms: dict[str, object] = {
        # an empty allow list would mean "everything": say "nothing" with a subject no one uses
        "publish": {"allow": list(g.publish) or ["_tangram_nothing"]},
        "subscribe": {"allow": list(g.subscribe)},
    }
    if g.responds:
        perms["allow_responses"] = True
    return {"user": creds.user, "password": creds.password, "permissions": perms}


def read_token(path: str | Path) -> str:
    """The dashboard token in ``path``; a clear error when it is missing or empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidRequest(f"cannot read the dashboard token {path}: {exc.strerror}") from exc
    if not token:
        raise InvalidRequest(f"the dashboard token file {path} is empty")
    return token


def login_url(base: str, token: str) -> str:
    """The dashboard's URL at ``base`` that logs a browser in (as Jupyter prints its own)."""
    return f"{base.rstrip('/')}/?token={token}"


def _write_private(path: Path, data: bytes) -> None:
    """Write ``data`` readable by this user alone (the directory too)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- a mesh's keyring

SERVICE_ROLES: Final = {
    "gateway": GATEWAY,
    "scheduler": SCHEDULER,
    "cpu_manager": NODE,
    "quota_manager": NODE,
    "gpu_manager": NODE,
    "dashboard": DASHBOARD,
    "reward_front": FRONT,
}
NODE_ID_VARS: Final = {
    "cpu_manager": "TANGRAM_CPU_NODE_ID",
    "quota_manager": "TANGRAM_QUOTA_NODE_ID",
    "gpu_manager": "TANGRAM_GPU_NODE_ID",
}
DEFAULT_CLIENT: Final = Principal(CLIENT, "default")


def default_node_id(service: str) -> str:
    """The node id an agent takes when its variable is unset (as its config's default is;
    a test pins the two together)."""
    host = socket.gethostname().split(".")[0]
    return {"quota_manager": f"quota-{host}", "gpu_manager": f"gpu-{host}"}.get(service, host)


def service_principal(service: str, env: Mapping[str, str]) -> Principal | None:
    """Who the service ``service`` started with ``env`` is to the broker (None: no role)."""
    role = SERVICE_ROLES.get(service)
    if role == NODE:
        return Principal(NODE, env.get(NODE_ID_VARS[service]) or default_node_id(service))
    if role == FRONT:  # results of its own, apart from the users' clients'
        return Principal(FRONT, service)
    return None if role is None else Principal(role)


class MeshAuth:
    """The credentials of a mesh that ``tangram up`` starts with auth on: the broker's users,
    one file per service principal, the default client's and the operator's."""

    def __init__(self, state_dir: Path) -> None:
        self.keyring = Keyring(state_dir)
        self.client_creds = self.keyring.ensure(DEFAULT_CLIENT, admin=True)
        self.ops_creds = self.keyring.ensure(Principal(OPS))
        self.dashboard_token = self.keyring.dashboard_token()  # compose's dashboard reads it

    def server_config(self, services: Iterable[tuple[str, Mapping[str, str]]]) -> Path:
        """The broker's config admitting ``services`` (name, env), the client and ops."""
        found = [service_principal(name, env) for name, env in services]
        found += [service_principal(name, {}) for name in SERVICE_ROLES if name not in NODE_ID_VARS]
        clients = self.keyring.clients()  # `tangram client add`'s, kept across restarts
        every = [Principal(OPS), DEFAULT_CLIENT, *found, *clients]
        principals = {p.user: p for p in every if p is not None}
        return self.keyring.server_config(list(principals.values()))

    def service_creds(self, service: str, env: Mapping[str, str]) -> Path | None:
        """The credential file ``service`` started with ``env`` connects with."""
        who = service_principal(service, env)
        return None if who is None else self.keyring.ensure(who)

    def mesh_fields(self) -> dict[str, str]:
        """What ``mesh.json`` says about credentials."""
        return {"client_creds": str(self.client_creds), "ops_creds": str(self.ops_creds)}
