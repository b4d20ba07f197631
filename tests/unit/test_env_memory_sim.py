"""The one-node memory simulator behind ``bench/state_env.py``: trajectories per node."""

from __future__ import annotations

import dataclasses

from services.scheduler.sim.env_memory import NodeModel, mean_act, trajectories_per_node
from services.scheduler.sim.traces import CodingConfig, ai_coding

TRACE = ai_coding(CodingConfig(batch=24), seed=1)
NODE = NodeModel(cores=32, memory_mb=8 * 1024, env_mb=1024, reward_dop=4, horizon_s=3600.0)


def test_without_tiering_the_node_holds_what_its_memory_holds() -> None:
    cap = trajectories_per_node(TRACE, NODE, (0.0, 0.05), max_slots=40)
    assert cap.per_tolerance[0.0]["without"] == NODE.memory_mb // NODE.env_mb
    assert cap.per_tolerance[0.05]["with"] >= cap.per_tolerance[0.05]["without"]
    assert cap.curves["with"][8] == cap.curves["without"][8]  # no pressure: no difference


def test_restores_cost_act_and_free_ones_cost_nothing() -> None:
    slow = mean_act(TRACE, 16, True, NODE)
    free = mean_act(TRACE, 16, True, dataclasses.replace(NODE, restore_s=0.0))
    roomy = mean_act(TRACE, 16, False, dataclasses.replace(NODE, memory_mb=10**6))
    assert slow > free
    assert abs(free - roomy) < 0.05 * roomy  # on disk is free when restoring is
