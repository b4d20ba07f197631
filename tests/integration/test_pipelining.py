"""Pipelining through a real mesh: a full node is granted its next actions on busy cores, the
agent starts each the moment its cores free, every action runs exactly once, and the commands
of one scheduling pass reach the node in one message."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from tangram import subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import Commands, Dispatch, NodeCommand, codec
from tangram.launcher import Mesh

from ..support import commands_in, running_mesh

CORES = "0-1"  # a small node: two actions at a time, so it is full at once


@pytest.fixture(scope="module")
async def small(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    root: Path = tmp_path_factory.mktemp("pipelining")
    async with running_mesh(root, env={"TANGRAM_CPU_CORES": CORES}) as m:
        yield m


async def test_a_full_node_runs_its_next_actions_without_a_round_trip(small: Mesh, tmp_path):
    seen: list[NodeCommand] = []

    async def on_msg(msg: Msg) -> None:
        try:
            seen.append(codec.decode(msg.data, NodeCommand))
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass

    ran = tmp_path / "ran"
    spy = await Bus.connect(small.nats_url, "pipelining-spy")
    try:
        await spy.nc.subscribe(subjects.node("node0").subject, cb=on_msg)
        await spy.nc.flush()
        async with Client.connect(small.nats_url) as client:
            results = await asyncio.gather(
                *(
                    client.exec(
                        f'echo "$TANGRAM_ACTION_ID" >> {ran}; sleep 0.05',
                        trajectory_id=f"t{k % 4}",
                        job_id="pipelining",
                        wait_s=60,
                    )
                    for k in range(40)
                )
            )
    finally:
        await spy.close()
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    lines = ran.read_text().split()
    assert sorted(lines) == sorted(r.action_id for r in results)  # each ran exactly once
    dispatches = [d for cmd in seen for d in commands_in(cmd) if isinstance(d, Dispatch)]
    assert len(dispatches) == 40
    pipelined = [d for d in dispatches if d.after]
    assert pipelined, "no action was granted on a busy core"
    assert all(set(d.cores) <= {0, 1} for d in dispatches)
    assert any(isinstance(cmd, Commands) for cmd in seen), "no pass sent its commands together"
