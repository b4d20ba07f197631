"""Per-client credentials: the keyring's clients (``tangram client``), the owner of a gateway
request (its subject), and what one client may see of another's (``services/gateway``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from services.gateway import ownership, store
from services.gateway.config import GatewayConfig
from services.gateway.formulation import Limits, check_reply_subject, formulate
from services.gateway.service import Gateway
from tangram import auth, cli, cli_clients, subjects
from tangram.auth import CLIENT, DEFAULT_CLIENT, Keyring, MeshAuth, Principal
from tangram.contract import (
    Done,
    QuotaSpec,
    RegisterService,
    Services,
    ServiceSpec,
    SetQuota,
)
from tangram.embedded import NATS_PID_FILE
from tangram.errors import InvalidRequest, NotFound, Unavailable
from tests.support import exec_spec


def users(conf: Path) -> dict[str, dict[str, object]]:
    text = conf.read_text().removeprefix("authorization: ")
    return {u["user"]: u for u in json.loads(text)["users"]}


def test_the_owner_of_a_request_is_the_subject_it_came_on() -> None:
    assert ownership.owner_of(subjects.gateway_of("alice").subject) == "alice"
    assert ownership.owner_of(subjects.GATEWAY.subject) == ""  # the operator's door
    assert ownership.owner_of("tangram.v1.gatewayx.alice") == ""
    assert ownership.may_see("", "alice")
    assert ownership.may_see("alice", "alice")
    assert not ownership.may_see("bob", "alice")
    assert not ownership.may_see("bob", "")


def test_a_client_names_a_reply_subject_under_its_own_results_alone() -> None:
    check_reply_subject(subjects.results("alice") + ".c1", "alice")
    check_reply_subject(subjects.results("bob") + ".c1")  # no owner: any client's, as before
    for bad in (subjects.results("bob") + ".c1", subjects.results("alice"), "tangram.v1.x"):
        with pytest.raises(InvalidRequest, match=r"tangram\.v1\.results\.alice\.<more>"):
            check_reply_subject(bad, "alice")
    reply = subjects.results("bob") + ".c1"
    with pytest.raises(InvalidRequest, match="reply_subject"):
        formulate(
            exec_spec("u", "a", "true"), now=0, limits=Limits(), reply_subject=reply, owner="alice"
        )


def test_another_clients_trajectory_or_action_id_is_refused() -> None:
    ownership.check_intake(store.Intake("a", duplicate=True, owner="alice"), "t", "alice")
    ownership.check_intake(store.Intake("a", duplicate=True, owner="alice"), "t", "")
    with pytest.raises(InvalidRequest, match="action_id 'a' is taken"):
        ownership.check_intake(store.Intake("a", duplicate=True, owner="alice"), "t", "bob")
    with pytest.raises(InvalidRequest, match="trajectory 't' belongs to another client"):
        ownership.check_intake(store.Intake("a", duplicate=False, foreign=True), "t", "bob")
    assert not store.Intake("a", duplicate=False, foreign=True).new


def test_clients_are_added_and_removed_and_the_broker_config_follows(tmp_path: Path) -> None:
    mesh = MeshAuth(tmp_path)
    agents = [("cpu_manager", {"TANGRAM_CPU_NODE_ID": "n0"})]
    conf = mesh.server_config(agents)
    ring = mesh.keyring
    path = cli_clients.add_client(ring, "team-a")
    assert path == ring.path(Principal(CLIENT, "team-a"))
    assert path.stat().st_mode & 0o077 == 0
    assert cli_clients.rewrite_config(ring) == conf
    admitted = users(conf)
    assert {"client-default", "client-team-a", "node-n0", "ops", "gateway"} <= set(admitted)
    perms = admitted["client-team-a"]["permissions"]
    assert perms["publish"] == {"allow": [subjects.gateway_of("team-a").subject]}  # type: ignore[index]
    with pytest.raises(InvalidRequest, match="exists"):
        cli_clients.add_client(ring, "team-a")
    # a restart of the mesh (tangram up again) admits the clients added
    assert "client-team-a" in users(MeshAuth(tmp_path).server_config(agents))
    cli_clients.remove_client(ring, "team-a")
    cli_clients.rewrite_config(ring)
    assert "client-team-a" not in users(conf)
    assert "node-n0" in users(conf)
    with pytest.raises(NotFound, match="no client 'team-a'"):
        cli_clients.remove_client(ring, "team-a")
    with pytest.raises(InvalidRequest, match="default client cannot be removed"):
        cli_clients.remove_client(ring, DEFAULT_CLIENT.id)
    assert cli_clients.rewrite_config(Keyring(tmp_path / "none")) is None  # no broker yet


def test_the_broker_lets_admin_clients_alone_ask_on_their_admin_subject(tmp_path: Path) -> None:
    """The default client is an admin (the README registers services and sets quotas with
    it), even from a file written before admins were; one added is not, unless --admin."""
    mesh = MeshAuth(tmp_path)
    conf = mesh.server_config([])
    ring = mesh.keyring
    cli_clients.add_client(ring, "boss", admin=True)
    cli_clients.add_client(ring, "team-a")
    legacy = ring.path(DEFAULT_CLIENT)  # as an earlier `tangram up` wrote it: no admin field
    fields = json.loads(legacy.read_text())
    del fields["admin"]
    legacy.write_text(json.dumps(fields))
    cli_clients.rewrite_config(ring)
    for name, admin in (("boss", True), ("default", True), ("team-a", False)):
        perms = users(conf)[f"client-{name}"]["permissions"]
        allowed = perms["publish"]["allow"]  # type: ignore[index]
        assert (subjects.admin_of(name).subject in allowed) == admin, name
        assert subjects.gateway_of(name).subject in allowed
        assert auth.is_admin(auth.load_creds(ring.path(Principal(CLIENT, name)))) == admin


@pytest.mark.parametrize("name", ["", "a.b", "a b", "x" * 65, "a/b", "*"])
def test_a_bad_client_name_is_a_usage_error(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANGRAM_STATE_DIR", "/nonexistent")  # main() sets it: restored after
    with pytest.raises(SystemExit) as exc:
        cli.main(["client", "add", name, "--state-dir", "/nonexistent"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument name:" in err
    assert "characters" in err or "only letters, digits" in err


def test_the_cli_says_what_is_wrong_and_exits_non_zero(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    state = str(tmp_path)
    monkeypatch.setenv("TANGRAM_STATE_DIR", state)  # main() sets it: restored after
    assert cli.main(["client", "add", "x", "--state-dir", state]) == 2  # no keyring there
    assert "no keyring" in capsys.readouterr().err
    MeshAuth(tmp_path).server_config([])
    assert cli.main(["client", "add", "x", "--state-dir", state]) == 0  # no live mesh: later
    out = capsys.readouterr().out
    assert out.splitlines()[0] == str(Keyring(tmp_path).path(Principal(CLIENT, "x")))
    assert "the next `tangram up` admits it" in out
    assert cli.main(["client", "add", "x", "--state-dir", state]) == 2
    assert "client 'x' exists" in capsys.readouterr().err
    assert cli.main(["client", "remove", "nobody", "--state-dir", state]) == 2
    assert "no client 'nobody'" in capsys.readouterr().err
    assert cli.main(["client", "list", "--state-dir", state]) == 0
    listed = capsys.readouterr().out
    assert "mesh.json's client_creds" in listed
    assert "\nx " in listed
    assert auth.load_creds(Keyring(tmp_path).path(Principal(CLIENT, "x"))).id == "x"


def test_a_stale_or_missing_broker_pid_is_said_not_signalled(tmp_path: Path) -> None:
    conf = MeshAuth(tmp_path).server_config([])
    with pytest.raises(Unavailable, match="the mesh's nats-server is not running"):
        cli_clients.nats_pid(tmp_path, conf)
    (tmp_path / "nats").mkdir()
    (tmp_path / "nats" / NATS_PID_FILE).write_text(str(os.getpid()))  # a pid reused by another
    with pytest.raises(Unavailable, match="is not this mesh's nats-server"):
        cli_clients.nats_pid(tmp_path, conf)


def test_a_client_may_not_take_a_service_principals_id(tmp_path: Path) -> None:
    """The reward front asks on ``gateway_of("reward_front")`` and reads its results there: a
    client of that name would share both (its results, its actions)."""
    ring = MeshAuth(tmp_path).keyring
    front = auth.service_principal("reward_front", {})
    assert front is not None
    assert front.id in cli_clients.SERVICE_IDS
    with pytest.raises(InvalidRequest, match="a service's own id"):
        cli_clients.add_client(ring, front.id)
    assert not ring.path(Principal(CLIENT, front.id)).exists()


# ------------------------------------------------------------------ admins, and where answers go


class _Bus:
    """The gateway's bus, recording what it would forward to the scheduler."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    async def request(self, endpoint: object, msg: object, timeout: float) -> object:
        self.sent.append(msg)
        return Services(services=())


class _Server:
    """A served subscription, recording what the gateway refused to answer."""

    def __init__(self) -> None:
        self.refused: list[str] = []

    def refuse(self, why: str) -> None:
        self.refused.append(why)


def _quota() -> SetQuota:
    return SetQuota(spec=QuotaSpec(name="search", hosts=("api.example.com",), concurrency=4))


def _msg(subject: str, reply: str) -> Msg:
    return Msg(_client=None, subject=subject, reply=reply)  # type: ignore[arg-type]


async def test_a_client_that_is_no_admin_may_not_change_the_whole_mesh() -> None:
    bus = _Bus()
    gateway = Gateway(GatewayConfig(), bus, pool=None)  # type: ignore[arg-type]
    gateway.quotas.set = _fake_set  # type: ignore[method-assign]  # no Postgres here
    register = RegisterService(spec=ServiceSpec(name="rm", factory="m:f"))
    for req, what in ((_quota(), "set a quota"), (register, "register a model service")):
        with pytest.raises(InvalidRequest, match=rf"client 'bob' may not {what}") as exc:
            await gateway._answer(req, "bob", admin=False)
        assert "tangram client add NAME --admin" in str(exc.value)
    assert bus.sent == []
    # an admin client's, and the operator's (the shared subject: no owner), go through
    assert isinstance(await gateway._answer(_quota(), "boss", admin=True), Done)
    assert isinstance(await gateway._answer(_quota(), "", admin=False), Done)
    # and who is an admin is the subject the request came on, never the message
    heard = _msg(subjects.admin_of("boss").subject, "_INBOX_client-boss.abc.1")
    assert isinstance(await gateway.handle_admin(_quota(), heard), Done)
    heard = _msg(subjects.gateway_of("boss").subject, "_INBOX_client-boss.abc.1")
    with pytest.raises(InvalidRequest, match="--admin"):
        await gateway.handle(_quota(), heard)


async def _fake_set(bus: object, spec: QuotaSpec) -> Done:
    return Done(detail=f"quota {spec.name!r} set")


async def test_a_client_request_answered_elsewhere_than_its_inbox_is_dropped() -> None:
    """The gateway may answer any request it hears: a reply subject naming another client's
    results (or anyone's) is dropped, logged, never acted on."""
    gateway = Gateway(GatewayConfig(), _Bus(), pool=None)  # type: ignore[arg-type]
    owned, admins = _Server(), _Server()
    gateway._owned, gateway._admins = owned, admins  # type: ignore[assignment]
    for subject, server in (
        (subjects.gateway_of("bob").subject, owned),
        (subjects.admin_of("bob").subject, admins),
    ):
        handle = gateway.handle_admin if server is admins else gateway.handle
        for reply in (
            subjects.results("alice") + ".c1",
            "_INBOX_client-alice.x.1",
            "_INBOX_client-bob",  # the prefix itself is no inbox under it
            "_INBOX_client-bobby.x.1",
            "",
        ):
            assert await handle(_quota(), _msg(subject, reply)) is None
        assert len(server.refused) == 5
        assert "not under its own inbox" in server.refused[-1]
        assert "_INBOX_client-bob." in server.refused[-1]
    assert ownership.replies_home("_INBOX_client-bob.x.1", "bob")
    assert ownership.replies_home("_INBOX_front-bob.x.1", "bob")  # the reward front's door
    assert ownership.replies_home("anything", "")  # the shared subject: the operator's
