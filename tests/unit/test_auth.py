"""The permission table (``tangram.auth``): every subject of the mesh has its roles, each role
gets what it needs and nothing more, credentials are private files."""

from __future__ import annotations

import inspect
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from services.gpu_manager.config import GpuManagerConfig
from services.quota_manager.config import QuotaManagerConfig
from tangram import auth, subjects
from tangram.auth import (
    CLIENT,
    DASHBOARD,
    GATEWAY,
    NODE,
    OPS,
    ROUTES,
    SCHEDULER,
    Principal,
    grant,
)
from tangram.contract import (
    Completion,
    Completions,
    EnvExpired,
    Inventory,
    NodeLeaving,
    NodeMessage,
    NodeReport,
    Outcome,
)
from tangram.errors import InvalidRequest
from tangram.subjects import Endpoint

# Functions of ``subjects`` that make subjects, each with an argument to make one from.
SUBJECT_MAKERS = {
    "node": lambda f: f("n1").subject,
    "prefetch": lambda f: f("n1").subject,
    "sched_node": lambda f: f("n1").subject,
    "gateway_of": lambda f: f("alice").subject,
    "admin_of": lambda f: f("alice").subject,
    "results": lambda f: f("alice") + ".c1",
    "result_push": lambda f: f(subjects.results("alice") + ".c1").subject,
}


def matches(pattern: str, subject: str) -> bool:
    """NATS matching: ``*`` is one token, a final ``>`` one or more."""
    pat, sub = pattern.split("."), subject.split(".")
    for i, token in enumerate(pat):
        if token == ">":
            return len(sub) > i
        if i >= len(sub) or token not in ("*", sub[i]):
            return False
    return len(pat) == len(sub)


def test_every_subject_of_the_mesh_has_a_route() -> None:
    found = [v.subject for v in vars(subjects).values() if isinstance(v, Endpoint)]
    for name, fn in inspect.getmembers(subjects, inspect.isfunction):
        if fn.__module__ == subjects.__name__:
            assert name in SUBJECT_MAKERS, f"subjects.{name} is new: route it in auth.ROUTES"
            found.append(SUBJECT_MAKERS[name](fn))
    for subject in found:
        routes = [r for r in ROUTES if matches(r.subject.replace(auth.ID, "*"), subject)]
        assert routes, f"{subject} is in no route of auth.ROUTES: no role may use it"
        assert all(r.serve and r.send for r in routes)


def test_a_client_may_ask_the_gateway_and_read_its_own_results_only() -> None:
    g = grant(Principal(CLIENT, "alice"))
    # its own gateway subject alone (not the shared one: the gateway knows who asks); not
    # even spans: the dashboard's is internal
    assert g.publish == (subjects.gateway_of("alice").subject,)
    assert set(g.subscribe) == {"tangram.v1.results.alice.>", "_INBOX_client-alice.>"}
    assert not g.responds


def test_an_admin_client_alone_may_ask_on_its_admin_subject() -> None:
    """The gateway takes mesh-wide changes there: the broker, not the message, says who."""
    admin = grant(Principal(CLIENT, "boss"), admin=True)
    assert set(admin.publish) == {
        subjects.gateway_of("boss").subject,
        subjects.admin_of("boss").subject,
    }
    for who in (Principal(CLIENT, "alice"), Principal(auth.FRONT, "f"), Principal(OPS)):
        assert not any(matches(p, "tangram.v1.admin.x") for p in grant(who).publish)
    serves = grant(Principal(GATEWAY)).subscribe
    assert any(matches(p, subjects.admin_of("boss").subject) for p in serves)
    assert auth.client_inboxes("boss") == ("_INBOX_client-boss.", "_INBOX_front-boss.")


def test_only_the_scheduler_commands_nodes() -> None:
    commanding = [
        r for r in ROUTES if matches(r.subject.replace(auth.ID, "*"), "tangram.v1.node.x")
    ]
    broadcast = [r for r in ROUTES if r.subject == subjects.NODES_BROADCAST.subject]
    assert {s for r in commanding + broadcast for s in r.send} == {SCHEDULER}
    node = grant(Principal(NODE, "n1"))
    assert "tangram.v1.node.n1" in node.subscribe
    assert not any(matches(p, "tangram.v1.node.n2") for p in node.subscribe)
    assert not any(matches(p, "tangram.v1.node.n2") for p in node.publish)


def test_only_the_gateway_changes_the_schedulers_books() -> None:
    for who in (Principal(CLIENT, "x"), Principal(NODE, "x"), Principal(OPS), Principal(DASHBOARD)):
        assert not any(matches(p, subjects.SCHED_ACTIONS.subject) for p in grant(who).publish)
    assert subjects.SCHED_ACTIONS.subject in grant(Principal(GATEWAY)).publish
    assert grant(Principal(GATEWAY)).responds
    for who in (Principal(OPS), Principal(DASHBOARD), Principal(GATEWAY)):  # read-only asks
        assert subjects.SCHED_STATUS.subject in grant(who).publish
    assert subjects.SCHED_STATUS.subject in grant(Principal(SCHEDULER)).subscribe


def test_a_node_sends_to_the_scheduler_for_itself_alone() -> None:
    node = grant(Principal(NODE, "n1"))
    assert subjects.sched_node("n1").subject in node.publish
    assert not any(matches(p, subjects.sched_node("n2").subject) for p in node.publish)
    assert subjects.SCHED_NODES.subject in grant(Principal(SCHEDULER)).subscribe


def _outcome() -> Outcome:
    return Outcome(exit_code=0)


def _done(node_id: str) -> Completion:
    return Completion(
        node_id=node_id, incarnation="i", action_id="a", attempt=1, outcome=_outcome()
    )


NODE_MESSAGES: dict[str, Callable[[str], NodeMessage]] = {
    "report": lambda n: NodeReport(node_id=n, incarnation="i", inventory=Inventory(kind="cpu")),
    "completion": _done,
    "batch": lambda n: Completions(items=(_done("n1"), _done(n))),
    "env_expired": lambda n: EnvExpired(node_id=n, incarnation="i", trajectory_id="t"),
    "leaving": lambda n: NodeLeaving(node_id=n, incarnation="i"),
}


@pytest.mark.parametrize("kind", list(NODE_MESSAGES))
def test_the_scheduler_refuses_a_message_for_another_node(kind: str) -> None:
    make = NODE_MESSAGES[kind]
    auth.check_sender(make("n1"), subjects.sched_node("n1").subject)  # its own: taken
    for subject in (subjects.sched_node("n2").subject, "tangram.v1.elsewhere"):
        with pytest.raises(InvalidRequest, match="sends for itself alone"):
            auth.check_sender(make("n1"), subject)
    with pytest.raises(InvalidRequest, match="for node 'n2'"):  # any item of a batch too
        auth.check_sender(make("n2"), subjects.sched_node("n1").subject)


def test_principals_are_checked() -> None:
    with pytest.raises(InvalidRequest, match="unknown role"):
        Principal("root")
    with pytest.raises(InvalidRequest, match="needs"):
        Principal(CLIENT)
    with pytest.raises(InvalidRequest, match="only letters"):
        Principal(NODE, "a.b")


def test_credentials_are_private_and_kept(tmp_path: Path) -> None:
    ring = auth.Keyring(tmp_path)
    path = ring.ensure(Principal(NODE, "n1"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    first = auth.load_creds(path)
    assert (first.id, first.user) == ("n1", "node-n1")
    conf = ring.server_config([Principal(NODE, "n1"), Principal(SCHEDULER)])
    assert stat.S_IMODE(conf.stat().st_mode) == 0o600
    assert auth.load_creds(ring.ensure(Principal(NODE, "n1"))) == first  # not re-made


def test_a_bad_credentials_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="cannot read credentials"):
        auth.load_creds(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"user": 1}')
    with pytest.raises(InvalidRequest, match="malformed"):
        auth.load_creds(tmp_path / "bad.json")


def test_agents_get_the_node_ids_they_run_with() -> None:
    assert auth.default_node_id("quota_manager") == QuotaManagerConfig().node_id
    assert auth.default_node_id("gpu_manager") == GpuManagerConfig().node_id
    env = {"TANGRAM_CPU_NODE_ID": "node3"}
    assert auth.service_principal("cpu_manager", env) == Principal(NODE, "node3")
    assert auth.service_principal("scheduler", env) == Principal(SCHEDULER)
    assert auth.service_principal("reward_front", env) == Principal(auth.FRONT, "reward_front")
    assert auth.service_principal("unknown", env) is None
