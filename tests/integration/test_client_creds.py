"""Two clients of one mesh with auth (``tangram up``'s), added while it runs (``tangram client
add``, no restart): neither reads, waits on, cancels or touches the other's results, actions
or trajectories, and the broker refuses what the gateway would never see."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import asyncpg
import msgspec
import pytest

from services.gateway import ownership, store
from services.gateway.config import GatewayConfig
from services.gateway.formulation import Limits, formulate
from services.gateway.service import Gateway
from tangram import auth, cli, subjects
from tangram.auth import CLIENT, Keyring, Principal
from tangram.bus import Bus, admits
from tangram.client import Client
from tangram.contract import (
    Done,
    ErrorReply,
    ListQuotas,
    QuotaSpec,
    ReleaseLease,
    Submit,
    codec,
    encode,
)
from tangram.embedded import NATS_PID_FILE
from tangram.errors import InvalidRequest, NotFound, Unavailable
from tangram.launcher import Mesh
from tangram.supervisor import RestartPolicy
from tests.support import eventually, exec_spec, postgres_pool, raw_nats, running_mesh


async def tangram(*argv: str) -> int:
    """The CLI, as a user runs it (its own event loop: in a thread)."""
    return await asyncio.to_thread(cli.main, list(argv))


async def broker_refuses(url: str, creds: Path, subscribe: str = "", publish: str = "") -> bool:
    """Whether the broker refuses ``creds`` reading or writing that subject."""
    errors: list[Exception] = []
    nc = await raw_nats(url, creds, errors)
    try:
        if subscribe:
            await nc.subscribe(subscribe)
        if publish:
            await nc.publish(publish, b"x")
        await nc.flush()
        what = f'subscription to "{subscribe}"' if subscribe else f'publish to "{publish}"'
        await eventually(
            lambda: any(f"permissions violation for {what}" in str(e).lower() for e in errors),
            what=f"a refusal of {what}",
        )
        return True
    finally:
        await nc.close()


async def test_two_clients_added_to_a_live_mesh_are_apart(
    open_state: Path, uid: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANGRAM_NATS_URL", raising=False)
    monkeypatch.delenv(auth.CREDS_VAR, raising=False)
    monkeypatch.setenv("TANGRAM_STATE_DIR", str(open_state))
    state = str(open_state)
    ring = Keyring(open_state)
    a_creds, b_creds = (ring.path(Principal(CLIENT, n)) for n in ("a", "b"))
    async with running_mesh(open_state, secure=True, quota_manager=False) as mesh:
        url = mesh.nats_url
        with pytest.raises(Unavailable, match="wrong credentials"):  # not admitted yet
            await Bus.connect(url, "early", creds=ring.ensure(Principal(CLIENT, "early")))
        ring.path(Principal(CLIENT, "early")).unlink()
        assert await tangram("client", "add", "a", "--state-dir", state) == 0
        assert await tangram("client", "add", "b", "--state-dir", state) == 0
        assert await tangram("client", "add", "boss", "--admin", "--state-dir", state) == 0
        assert await tangram("client", "add", "a", "--state-dir", state) == 2  # duplicate
        assert await tangram("client", "remove", "nobody", "--state-dir", state) == 2
        async with (
            Client.connect(url, creds=a_creds) as a,
            Client.connect(url, creds=b_creds) as b,
            Client.connect() as default,  # the README's: mesh.json's client_creds
            Client.connect(url, creds=ring.path(Principal(CLIENT, "boss"))) as boss,
        ):
            await only_admins_change_the_mesh(url, uid, a, default, boss, a_creds)
            await answers_go_home_alone(open_state, a, b)
            mine = exec_spec(uid, "a", "echo secret")
            assert (await a.run(mine)).stdout == "secret\n"
            assert (await default.exec("true", trajectory_id=f"{uid}-d", job_id=uid)).ok
            # b cannot see, wait on or cancel a's action: as if it did not exist
            with pytest.raises(NotFound, match=r"of client 'b' .* ask with the one that submitted"):
                await b.result(mine.action_id, timeout=5)
            with pytest.raises(NotFound):
                await b.cancel(mine.action_id)
            with pytest.raises(NotFound):
                await default.result(mine.action_id, timeout=5)
            # nor run in, or close, a's trajectory; nor take a's action id for its own
            with pytest.raises(InvalidRequest, match="belongs to another client"):
                await b.exec("cat secret", trajectory_id=mine.trajectory_id, job_id=uid)
            with pytest.raises(InvalidRequest, match="belongs to another client"):
                await b.close_env(mine.trajectory_id)
            with pytest.raises(InvalidRequest, match="is taken"):
                await b.run(msgspec.structs.replace(mine, trajectory_id=f"{uid}-b"))
            # nor have its results pushed to a's subject
            spy = Submit(spec=exec_spec(uid, "spy", "true"), reply_subject=a.results_subject)
            with pytest.raises(InvalidRequest, match="reply_subject"):
                await b.bus.request(b.gateway, spy)
            # a garbled request on a client's own subject: a clear error, the gateway serves on
            reply = await b.bus.nc.request(b.gateway.subject, b"\xc1garbled", timeout=10)
            assert codec.decode(reply.data, ErrorReply).code == "invalid_request"
            # the broker: b reads none of a's results and asks on a's subject never
            assert await broker_refuses(url, b_creds, subscribe=subjects.results("a") + ".>")
            assert await broker_refuses(url, b_creds, publish=subjects.gateway_of("a").subject)
            assert await broker_refuses(url, b_creds, publish=subjects.GATEWAY.subject)
            # a's own work goes on: its trajectory, its result, its close
            assert (await a.result(mine.action_id, timeout=5)).stdout == "secret\n"
            again = await a.exec("true", trajectory_id=mine.trajectory_id, job_id=uid)
            assert again.ok
            await a.close_env(mine.trajectory_id)
        kept = open_state / "b-copy.json"  # what b still holds after its file is removed
        shutil.copy(b_creds, kept)
        assert await tangram("client", "remove", "b", "--state-dir", state) == 0
        assert not b_creds.exists()
        await eventually(lambda: refused(url, kept), what="the broker to refuse b")


async def only_admins_change_the_mesh(
    url: str, uid: str, a: Client, default: Client, boss: Client, a_creds: Path
) -> None:
    """A quota's hosts and limits are every job's: a client added without --admin may not
    set one (told how), the default client and an admin may; the broker keeps the others off
    the admin subjects, so the gateway trusts the subject, not the message."""
    quota = QuotaSpec(name=f"q-{uid}", hosts=("api.example.com",), concurrency=2)
    with pytest.raises(InvalidRequest, match="tangram client add NAME --admin"):
        await a.set_quota(quota)
    await default.set_quota(quota)
    await boss.set_quota(msgspec.structs.replace(quota, concurrency=3))
    assert [q.spec.concurrency for q in await a.list_quotas() if q.spec.name == quota.name] == [3]
    assert await broker_refuses(url, a_creds, publish=subjects.admin_of("a").subject)


async def answers_go_home_alone(state: Path, a: Client, b: Client) -> None:
    """b names a's results as the reply subject of its own request: the gateway drops it (and
    logs it), rather than publish its answer where b may not."""
    target = subjects.results("a") + ".spy"
    spied = await a.bus.nc.subscribe(target)
    await b.bus.nc.publish(b.gateway.subject, encode(ListQuotas()), reply=target)
    log = state / "logs" / "gateway.log"
    await eventually(
        lambda: f"named reply subject {target!r}" in log.read_text(), what="the drop logged"
    )
    await a.bus.nc.flush()
    assert spied.pending_msgs == 0
    await spied.unsubscribe()


async def refused(url: str, creds: Path) -> bool:
    return not await admits(url, creds)


# ------------------------------------------------------------------ the intake statement


def owned(uid: str, name: str, trajectory: str, owner: str) -> store.Owned:
    spec = msgspec.structs.replace(
        exec_spec(uid, name, "true"), trajectory_id=f"{uid}-{trajectory}"
    )
    return store.Owned(formulate(spec, now=1.0, limits=Limits()), owner)


@pytest.fixture(scope="module")
async def pool(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[asyncpg.Pool]:
    async with postgres_pool(tmp_path_factory.mktemp("pg")) as p:
        yield p


async def test_a_claim_committed_by_a_concurrent_batch_is_the_claimers_own(
    pool: asyncpg.Pool, uid: str
) -> None:
    """Two gateways take the first two actions of one client's new trajectory in batches of
    their own: the second, which waited on the first's claim, is accepted (its statement's
    snapshot predates that claim), and another client's is still refused."""
    async with pool.acquire() as first, pool.acquire() as second:
        tx = first.transaction()
        await tx.start()
        one = await store.insert_actions(first, [owned(uid, "1", "t", "alice")])
        waiting = asyncio.create_task(
            store.insert_actions(
                second, [owned(uid, "2", "t", "alice"), owned(uid, "3", "t", "bob")]
            )
        )
        await eventually(
            lambda: blocked(pool), what="the second batch to wait on the first's claim"
        )
        await tx.commit()
        two, three = await waiting
    assert one[0].new
    assert two.new, two
    assert two.owner == "alice"
    assert three.foreign, three
    assert await store.trajectory_owner(pool, f"{uid}-t") == "alice"


async def blocked(pool: asyncpg.Pool) -> bool:
    waits = "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    return bool(await pool.fetchval(waits))


async def test_a_refused_copy_of_an_action_id_does_not_hide_the_accepted_one(
    pool: asyncpg.Pool, uid: str
) -> None:
    """One batch: bob's copy of an action id in alice's trajectory (refused) ahead of alice's
    own copy in her new trajectory (inserted): alice's is new and handed on, bob's refused."""
    async with pool.acquire() as conn:
        await store.insert_actions(conn, [owned(uid, "claim", "a", "alice")])
        bob = owned(uid, "x", "a", "bob")
        alice = owned(uid, "x", "b", "alice")
        refused, accepted = await store.insert_actions(conn, [bob, alice])
    assert refused.foreign
    assert accepted.new, accepted
    assert accepted.owner == "alice"
    stored = await store.fetch_result(pool, alice.action.spec.action_id)
    assert stored is not None
    assert stored.owner == "alice"


async def test_a_claim_seen_once_is_not_checked_again(pool: asyncpg.Pool, uid: str) -> None:
    """A gateway's next batch in a trajectory it saw claimed by the same owner skips the claim
    statement; another owner's action there is still refused, and duplicates still found."""
    claims = store.Claims()
    async with pool.acquire() as conn:
        (first,) = await store.insert_actions(conn, [owned(uid, "c1", "c", "alice")], claims)
        assert claims.hits == 0
        second, again = await store.insert_actions(
            conn, [owned(uid, "c2", "c", "alice"), owned(uid, "c1", "c", "alice")], claims
        )
        assert claims.hits == 1
        (bob,) = await store.insert_actions(conn, [owned(uid, "c3", "c", "bob")], claims)
    assert first.new
    assert second.new
    assert second.owner == "alice"
    assert again.duplicate
    assert again.owner == "alice"
    assert bob.foreign
    stored = await store.fetch_result(pool, f"{uid}-c2")
    assert stored is not None
    assert stored.owner == "alice"


async def test_a_refused_copy_teaches_no_claim(pool: asyncpg.Pool, uid: str) -> None:
    """One batch: alice's action in her trajectory, and a copy of its action id in bob's
    (refused). The inserted copy proves nothing about bob's trajectory: alice's next action
    there is still refused (the claim statement runs), not taken as hers from the cache."""
    claims = store.Claims()
    async with pool.acquire() as conn:
        await store.insert_actions(conn, [owned(uid, "claim", "bobs", "bob")], claims)
        mine, theirs = owned(uid, "y", "alices", "alice"), owned(uid, "y", "bobs", "alice")
        accepted, refused = await store.insert_actions(conn, [mine, theirs], claims)
        (later,) = await store.insert_actions(conn, [owned(uid, "z", "bobs", "alice")], claims)
    assert await store.fetch_result(pool, f"{uid}-z") is None, "inserted in bob's trajectory"
    assert later.foreign, later
    assert accepted.new
    assert refused.foreign, refused


def test_claims_are_bounded_newest_kept() -> None:
    claims = store.Claims(limit=2)
    items = [owned("u", str(i), str(i), "alice") for i in range(3)]
    claims.learn(items, {i.action.spec.action_id: "alice" for i in items})
    assert not claims.covers(items[:1])  # the oldest forgotten: checked in Postgres again
    assert claims.covers(items[1:])
    claims.learn(items[1:2], {items[1].action.spec.action_id: "bob"})  # not its owner's row
    assert claims.covers(items[1:])


async def test_a_client_ends_its_own_leases_alone(pool: asyncpg.Pool, uid: str) -> None:
    """A lease's id is its action's: another client's release is answered as for an unknown
    lease (nothing forwarded to the limiter), the owner's and the operator's go through."""
    async with pool.acquire() as conn:
        await store.insert_actions(conn, [owned(uid, "lease", "l", "alice")])
    lease_id = f"{uid}-lease"
    assert not await ownership.owns_lease(pool, "bob", lease_id)
    assert not await ownership.owns_lease(pool, "bob", f"{uid}-unknown")
    assert await ownership.owns_lease(pool, "alice", lease_id)
    assert await ownership.owns_lease(pool, "", lease_id)
    forwarded: list[object] = []

    class Bus:
        async def request(self, endpoint: object, msg: object, timeout: float) -> None:
            forwarded.append(msg)

    gateway = Gateway(GatewayConfig(), Bus(), pool)  # type: ignore[arg-type]
    release = ReleaseLease(lease_id=lease_id, status=429, retry_after_s=3600)
    assert isinstance(await gateway._answer(release, "bob"), Done)
    assert forwarded == []
    await gateway._answer(release, "alice")
    assert len(forwarded) == 1


# ------------------------------------------------------------------ a broker the supervisor restarts


async def test_a_client_is_added_while_and_after_the_supervisor_restarts_nats(
    open_state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker's pid file is rewritten at each start: `tangram client add` signals the
    new one; while none runs, the config it wrote is what the restarted broker reads."""
    monkeypatch.setenv("TANGRAM_STATE_DIR", str(open_state))
    state = str(open_state)
    ring = Keyring(open_state)
    policy = RestartPolicy(first_s=1.0)
    async with running_mesh(open_state, servers_only=True, secure=True, restart=policy) as mesh:
        mesh.supervise()
        for name in ("gap", "after"):
            assert mesh.nats is not None
            assert mesh.nats.proc is not None
            old = mesh.nats.proc.pid
            os.kill(old, signal.SIGKILL)
            if name == "after":
                await eventually(partial(restarted, mesh, open_state, old), what="a new broker")
            assert await tangram("client", "add", name, "--state-dir", state) == 0
            bus = await Bus.connect(mesh.nats_url, name, creds=ring.path(Principal(CLIENT, name)))
            await bus.close()


def restarted(mesh: Mesh, state: Path, old: int) -> bool:
    """The supervisor's new broker runs and has written its pid."""
    proc = mesh.nats.proc if mesh.nats is not None else None
    if proc is None or proc.pid == old:
        return False
    pid_file = state / "nats" / NATS_PID_FILE
    return pid_file.exists() and pid_file.read_text().strip() == str(proc.pid)
