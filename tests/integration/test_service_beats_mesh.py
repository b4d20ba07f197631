"""Service heartbeats on a locked-down mesh: `tangram status` lists the gateway and both
schedulers (leader and standby) with their phase and a fresh heartbeat, a killed gateway shows
silent within the bound, the standby that takes over is heard leading, and read-only questions
are asked on the status subject only."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from tangram import auth, cli_ops, subjects
from tangram.bus import Bus
from tangram.contract import Ack, ResourcesQuery
from tangram.contract.beats import ServiceRow
from tangram.errors import InvalidRequest, TangramError
from tangram.health import HealthConfig

from ..support import eventually, running_mesh

pytestmark = pytest.mark.slow

BEAT_S = 0.3


def roles(rows: list[ServiceRow]) -> dict[str, ServiceRow]:
    """The rows by role and phase: gateway, scheduler/leading, scheduler/standby."""
    return {r.service if r.service == "gateway" else f"{r.service}/{r.phase}": r for r in rows}


async def test_status_hears_the_gateway_and_both_schedulers_through_a_kill_of_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"TANGRAM_HEARTBEAT_S": str(BEAT_S)}
    opts = {"quota_manager": False, "schedulers": 2, "secure": True, "env": env}
    keys = tmp_path / "mesh" / auth.AUTH_DIR
    async with running_mesh(tmp_path / "mesh", **opts) as mesh:
        url = mesh.nats_url
        monkeypatch.setenv(auth.CREDS_VAR, str(keys / "ops.json"))  # `tangram status`'s

        async def all_three() -> dict[str, ServiceRow] | None:
            st = await cli_ops.scheduler_status(url)
            got = roles(st.service_rows)
            want = {"gateway", "scheduler/leading", "scheduler/standby"}
            fresh = all(r.health == "healthy" and (r.heard_s or 0) <= 1.0 for r in got.values())
            return got if want <= set(got) and fresh else None

        got = await eventually(all_three, what="the gateway and both schedulers heard")
        assert got["scheduler/leading"].epoch >= 1
        assert got["scheduler/standby"].instance != got["scheduler/leading"].instance
        assert set(got["gateway"].counters) == {"requests", "accepted"}
        assert set(got["scheduler/leading"].counters) == {"passes", "dispatches", "completions"}

        args = argparse.Namespace(nats=url, state_dir=str(tmp_path / "mesh"))
        assert await cli_ops.cmd_status(args) == 0
        out = capsys.readouterr().out
        assert f"leading, epoch {got['scheduler/leading'].epoch}" in out
        assert "standby" in out
        assert "serving" in out

        # read-only questions: the status subject answers them, the action subject refuses
        ops = await Bus.connect(url, "test-ops")
        try:
            assert await ops.request(subjects.SCHED_STATUS, ResourcesQuery()) is not None
        finally:
            await ops.close()
        gw = await Bus.connect(url, "test-gateway", creds=keys / "gateway.json")
        try:
            with pytest.raises(InvalidRequest, match="malformed"):
                await gw.request(subjects.SCHED_ACTIONS.subject, ResourcesQuery(), Ack)
        finally:
            await gw.close()

        mesh.procs["gateway"].kill()
        killed = time.monotonic()

        async def gateway_silent() -> bool:
            st = await cli_ops.scheduler_status(url)
            return roles(st.service_rows)["gateway"].health == "silent"

        await eventually(gateway_silent, what="the killed gateway silent", timeout_s=10)
        bound = HealthConfig().silent_s + BEAT_S + 0.5  # its last beat, then the silence
        assert time.monotonic() - killed <= bound
        await mesh.procs["gateway"].wait()

        # the leader killed: the standby leads, and is heard as the same instance, now leading
        mesh.procs["scheduler"].kill()
        standby = got["scheduler/standby"]

        async def taken_over() -> bool:
            try:
                st = await cli_ops.scheduler_status(url)
            except TangramError:  # no one leads yet
                return False
            lead = roles(st.service_rows).get("scheduler/leading")
            return lead is not None and lead.instance == standby.instance and lead.epoch == st.epoch

        await eventually(taken_over, what="the standby heard leading", timeout_s=10)
