"""A mesh as ``tangram up`` runs it: supervised, with a standby scheduler.

kill -9 of a service or embedded server: it comes back and serves, and the launcher says so in
one line; a service that cannot start backs off and is reported as a crash loop. kill -9 of the
leading scheduler under a steady trickle of actions: the standby leads within 5 s, every
acknowledged action reaches exactly one terminal state, none runs twice. A leader that loses
its lead lock while alive stops serving; the standby leads; the old one comes back as standby.
The tests share one mesh and run in this order."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import asyncpg
import pytest

from services.scheduler.leadership import lock_sessions
from tangram import ActionSpec, ExecAction
from tangram.bus import Bus
from tangram.client import Client
from tangram.errors import TangramError
from tangram.launcher import Mesh
from tangram.supervisor import RestartPolicy

from ..support import eventually, running_mesh
from .test_crash import settled

pytestmark = pytest.mark.slow
log = logging.getLogger(__name__)

TAKEOVER_BOUND_S = 5.0
# Fast enough for a test; the crash loop is said at the third exit in a row.
POLICY = RestartPolicy(first_s=0.2, max_s=0.8, stable_s=30.0, crash_loop=3)


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    root = tmp_path_factory.mktemp("supervised") / "mesh"
    opts = {"quota_manager": False, "schedulers": 2, "supervise": True, "restart": POLICY}
    async with running_mesh(root, **opts) as m:
        yield m


class Said:
    """What the supervisor has said so far."""

    def __init__(self, caplog: pytest.LogCaptureFixture) -> None:
        self.caplog = caplog

    def __contains__(self, line: str) -> bool:
        return line in self.caplog.messages

    def about(self, key: str) -> list[str]:
        return [m for m in self.caplog.messages if m.startswith(f"{key} ")]


@pytest.fixture
def said(caplog: pytest.LogCaptureFixture) -> Said:
    caplog.set_level(logging.INFO, logger="tangram.supervisor")
    return Said(caplog)


@contextlib.asynccontextmanager
async def probe_bus(mesh: Mesh) -> AsyncIterator[Bus]:
    bus = await Bus.connect(mesh.nats_url, "test-probe")
    try:
        yield bus
    finally:
        await bus.close()


async def serves(mesh: Mesh, uid: str, name: str) -> None:
    """An action goes through the whole mesh."""
    async with Client.connect(mesh.nats_url) as client:
        result = await client.exec("true", trajectory_id=f"{uid}-{name}", job_id=uid)
        assert result.ok, result.error


async def gateway_back(mesh: Mesh, old_pid: int) -> bool:
    if mesh.procs["gateway"].pid == old_pid:
        return False
    async with probe_bus(mesh) as bus:
        return await mesh.gateway_answers(bus)


# ---------------------------------------------------------------------- supervision


async def test_a_gateway_killed_9_comes_back_and_serves(mesh: Mesh, said: Said, uid: str):
    pid = mesh.pid("gateway")
    os.kill(pid, signal.SIGKILL)
    await eventually(lambda: gateway_back(mesh, pid), what="a new gateway answering")
    assert "gateway killed by SIGKILL; restart 1 in 0.2s" in said
    await serves(mesh, uid, "after-gateway")


async def test_nats_server_killed_9_comes_back_and_the_mesh_serves(
    mesh: Mesh, said: Said, uid: str
):
    assert mesh.nats is not None
    assert mesh.nats.proc is not None
    os.kill(mesh.nats.proc.pid, signal.SIGKILL)
    await eventually(lambda: "nats-server restarted" in said, what="nats-server restarted")
    assert "nats-server killed by SIGKILL; restart 1 in 0.2s" in said
    await eventually(lambda: gateway_back(mesh, 0), what="the gateway answering again")
    await serves(mesh, uid, "after-nats")


async def test_a_service_that_cannot_start_backs_off_and_is_reported(
    mesh: Mesh, said: Said, uid: str
):
    mesh.opts.env["TANGRAM_GATEWAY_MAX_BATCH"] = "not-a-number"  # every start exits at once
    try:
        pid = mesh.pid("gateway")
        os.kill(pid, signal.SIGKILL)
        await eventually(
            lambda: any("is crash-looping" in line for line in said.about("gateway")),
            what="the crash loop reported",
            timeout_s=20,
        )
    finally:
        del mesh.opts.env["TANGRAM_GATEWAY_MAX_BATCH"]
    restarts = [re.search(r"; restart \d+ in ([\d.]+)s$", line) for line in said.about("gateway")]
    delays = [float(m.group(1)) for m in restarts if m]
    assert delays == sorted(delays), delays  # backed off
    assert delays[-1] <= POLICY.max_s, delays
    assert any("gateway exited with 1" in line for line in said.about("gateway"))
    await eventually(lambda: gateway_back(mesh, pid), what="the gateway back once it can start")
    await serves(mesh, uid, "after-crash-loop")


# ---------------------------------------------------------------------- the standby


class Trickle:
    """Submits one action every ``every_s`` until stopped; keeps those acknowledged."""

    def __init__(self, client: Client, uid: str, ran: Path, every_s: float = 0.1) -> None:
        self.client, self.uid, self.ran, self.every_s = client, uid, ran, every_s
        self.acked: list[ActionSpec] = []
        self.stopping = asyncio.Event()

    def spec(self, i: int) -> ActionSpec:
        cmd = f'echo "$TANGRAM_ACTION_ID" >> {self.ran}'
        return ActionSpec(
            action_id=f"{self.uid}-{i}",
            job_id=self.uid,
            trajectory_id=f"{self.uid}-t{i % 6}",
            action=ExecAction(command=cmd),
        )

    async def run(self) -> None:
        i = 0
        while not self.stopping.is_set():
            spec = self.spec(i)
            i += 1
            try:
                await self.client.submit(spec)
            except TangramError as exc:  # not acknowledged: nothing is promised for it
                log.info("not acknowledged: %s", exc)
            else:
                self.acked.append(spec)
            await asyncio.sleep(self.every_s)  # the trickle's pace, not a wait for an event


@pytest.fixture
def ran() -> Iterator[Path]:
    """A file every action may append to, whichever user it runs as (the process backend runs
    each trajectory as an unprivileged uid of its own)."""
    root = Path(tempfile.mkdtemp(prefix="tangram-ran-"))
    root.chmod(0o755)
    path = root / "ran.log"
    path.touch(mode=0o666)
    path.chmod(0o666)
    yield path
    shutil.rmtree(root)


async def standby_waiting(mesh: Mesh) -> str:
    """The key of the leading scheduler once a standby waits for the lead (else '')."""
    conn = await asyncpg.connect(mesh.postgres_dsn)
    try:
        holder, waiting = await lock_sessions(conn)
    finally:
        await conn.close()
    if holder is None or not waiting:
        return ""
    pid = int(holder.split()[1].rsplit(":", 1)[1])  # the session is named by host:pid
    return next((k for k in mesh.procs if mesh.pid(k) == pid), "")


async def led_by_a_new_epoch(mesh: Mesh, bus: Bus, old: int) -> int:
    try:
        st = await mesh.status(bus, timeout=0.25)
    except TangramError:
        return 0
    return st.epoch if st.epoch > old else 0


async def test_a_waiting_standby_is_alive_and_not_ready(mesh: Mesh):
    """Its ops endpoint answers while it waits for the lead (a liveness probe leaves it be)."""
    leader = await eventually(lambda: standby_waiting(mesh), what="a standby waiting")
    (standby,) = [k for k in mesh.procs if k.startswith("scheduler") and k != leader]
    url = f"http://127.0.0.1:{mesh.ops_ports[standby]}"
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/healthz") as alive:
            assert alive.status == 200
        async with http.get(f"{url}/readyz") as ready:
            assert ready.status == 503
            assert (await ready.json())["state"] == "new"


async def test_the_standby_leads_within_5s_and_nothing_is_lost_or_run_twice(
    mesh: Mesh, ran: Path, uid: str
):
    async with Client.connect(mesh.nats_url) as client, probe_bus(mesh) as bus:
        leader = await eventually(lambda: standby_waiting(mesh), what="a standby waiting")
        old = (await mesh.status(bus)).epoch
        trickle = Trickle(client, uid, ran)
        submitting = asyncio.create_task(trickle.run())
        await eventually(lambda: len(trickle.acked) >= 10, what="the trickle flowing")
        at_kill = len(trickle.acked)
        killed = time.monotonic()
        os.kill(mesh.pid(leader), signal.SIGKILL)
        await eventually(
            lambda: led_by_a_new_epoch(mesh, bus, old), what="a new leader", timeout_s=10
        )
        takeover_s = time.monotonic() - killed
        probe = await client.exec("true", trajectory_id=f"{uid}-probe", job_id=uid)
        served_s = time.monotonic() - killed  # an action submitted after the takeover is done
        assert probe.ok, probe.error
        await eventually(lambda: len(trickle.acked) >= at_kill + 10, what="the trickle going on")
        trickle.stopping.set()
        await submitting
        results = await asyncio.gather(
            *(client.result(s.action_id, timeout=60) for s in trickle.acked)
        )
    ids = [s.action_id for s in trickle.acked]
    statuses, terminal_events = await settled(mesh.postgres_dsn, ids)
    log.warning(
        "kill -9 of the leader: new leader after %.2fs, an action done after %.2fs (%d actions,"
        " %d before)",
        takeover_s,
        served_s,
        len(ids),
        at_kill,
    )
    assert takeover_s < TAKEOVER_BOUND_S
    bad = [(r.action_id, r.error, r.attempt) for r in results if not r.ok]
    assert not bad
    for r in results:
        assert statuses[r.action_id] == r.status  # recorded == delivered
        assert terminal_events.get(r.action_id) == 1, r.action_id  # exactly one terminal state
    runs = collections.Counter((await asyncio.to_thread(ran.read_text)).split())
    assert set(runs) == set(ids)
    assert max(runs.values()) == 1


async def test_a_leader_that_loses_its_lock_stops_serving_and_the_standby_leads(
    mesh: Mesh, uid: str
):
    """As when the leader's connection to Postgres breaks while the process lives on."""
    async with probe_bus(mesh) as bus:
        leader = await eventually(lambda: standby_waiting(mesh), what="a standby waiting")
        proc, old = mesh.procs[leader], (await mesh.status(bus)).epoch
        conn = await asyncpg.connect(mesh.postgres_dsn)
        try:
            holder, _ = await lock_sessions(conn)
            cut = time.monotonic()
            await conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = $1",
                holder,
            )
        finally:
            await conn.close()
        await eventually(lambda: led_by_a_new_epoch(mesh, bus, old), what="a new leader")
        takeover_s = time.monotonic() - cut
        await eventually(lambda: proc.returncode is not None, what="the deposed one to stop")
        stopped_s = time.monotonic() - cut
    said = (mesh.opts.state_dir / "logs" / f"{leader}.log").read_text()
    assert "was replaced by epoch" in said
    await serves(mesh, uid, "after-lock-lost")
    assert await eventually(lambda: standby_waiting(mesh), what="a standby again") != leader
    log.warning(
        "lock lost: new leader after %.2fs, old one stopped after %.2fs", takeover_s, stopped_s
    )
    assert takeover_s < TAKEOVER_BOUND_S
