"""The permission table (``tangram.auth``): every subject of the mesh has its roles, each role
gets what it needs and nothing more, credentials are private files."""

from __future__ import annotations

import inspect
import stat
from pathlib import Path

import pytest

from services.gpu_manager.config import GpuManagerConfig
from services.quota_manager.config import QuotaManagerConfig
from tangram import auth, subjects
from tangram.auth import CLIENT, GATEWAY, NODE, OPS, ROUTES, SCHEDULER, Principal, grant
from tangram.errors import InvalidRequest
from tangram.subjects import Endpoint

# Functions of ``subjects`` that make subjects, each with an argument to make one from.
SUBJECT_MAKERS = {
    "node": lambda f: f("n1").subject,
    "prefetch": lambda f: f("n1").subject,
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
    assert g.publish == (subjects.GATEWAY.subject,)  # not even spans: the dashboard's is internal
    assert set(g.subscribe) == {"tangram.v1.results.alice.>", "_INBOX_client-alice.>"}
    assert not g.responds


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


def test_roles_that_are_not_the_scheduler_never_enqueue_but_through_the_gateway() -> None:
    for role in (CLIENT, NODE):
        who = Principal(role, "x")
        assert not any(matches(p, subjects.SCHED_ACTIONS.subject) for p in grant(who).publish)
    assert any(matches(p, subjects.SCHED_ACTIONS.subject) for p in grant(Principal(OPS)).publish)
    assert grant(Principal(GATEWAY)).responds


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
