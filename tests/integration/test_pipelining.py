"""Pipelining through a real mesh: a full node is granted its next actions on busy cores, the
agent starts each the moment its cores free, every action runs exactly once, and the commands
of one scheduling pass reach the node in one message."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import subjects
from tangram.contract import Commands, Dispatch, NodeCommand
from tangram.launcher import Mesh

from ..support import burst, commands_in, running_mesh, spying

CORES = "0-1"  # a small node: two actions at a time, so it is full at once


@pytest.fixture(scope="module")
async def small(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    root: Path = tmp_path_factory.mktemp("pipelining")
    async with running_mesh(root, env={"TANGRAM_CPU_CORES": CORES}) as m:
        yield m


async def test_a_full_node_runs_its_next_actions_without_a_round_trip(small: Mesh, tmp_path):
    node = subjects.node("node0").subject
    async with spying(small.nats_url, node, NodeCommand) as seen:
        await burst(small.nats_url, tmp_path / "ran", 40, 4, then="; sleep 0.05")
    dispatches = [d for cmd in seen for d in commands_in(cmd) if isinstance(d, Dispatch)]
    assert len(dispatches) == 40
    pipelined = [d for d in dispatches if d.after]
    assert pipelined, "no action was granted on a busy core"
    assert all(set(d.cores) <= {0, 1} for d in dispatches)
    assert any(isinstance(cmd, Commands) for cmd in seen), "no pass sent its commands together"
