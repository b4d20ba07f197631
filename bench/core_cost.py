"""The scheduler core's CPU per action in steady state as the queue grows (issue 13).

One cycle per action, as the live shell drives the core: a node's completion of the oldest
running action, a new action queued, one scheduling pass (it starts one action on the freed
core). The queue holds N actions throughout and every core stays busy. Two workloads: 64
trajectories reused, as ``bench.throughput`` submits (their environments stay, so the queue
waits in the nodes' pools), and one fresh trajectory per action whose environment is closed
when it ends (the queue waits for a placement). CPU time of this process, so other load on the
machine does not count; the median of ``ROUNDS`` rounds.
"""

from __future__ import annotations

import statistics
import time
from collections import deque

from services.gateway.formulation import Limits, formulate
from services.scheduler.core.effects import Effect, StartOnNode
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.policies.elastic import ElasticPolicy
from tangram.contract import (
    ActionSpec,
    Completion,
    ExecAction,
    Inventory,
    NodeReport,
    NumaCores,
    Outcome,
    UnifiedAction,
)

QUEUES = (100, 1_000, 10_000, 100_000)
NODES, CORES, TRAJECTORIES = 2, 4, 64
WARM = 3 * TRAJECTORIES  # cycles before measuring: every trajectory placed, caches filled
MIN_CYCLES, MAX_CYCLES, BUDGET_S, ROUNDS = 10, 3_000, 0.5, 3


def _report(node: str) -> NodeReport:
    numa = (NumaCores(numa_node=0, cores=tuple(range(CORES))),)
    inv = Inventory(  # as the process backend reports itself: idle environments hold nothing
        numa=numa,
        memory_mb=64_000,
        backend="process",
        isolates=False,
        idle_envs_hold_memory=False,
    )
    return NodeReport(node_id=node, incarnation="i0", inventory=inv, running=(), full=True)


def _action(i: int, tid: str, now: float) -> UnifiedAction:
    spec = ActionSpec(
        action_id=f"a{i}",
        job_id="bench",
        trajectory_id=tid,
        cpus=1,
        memory_mb=16,
        action=ExecAction(command="true"),
    )
    return formulate(spec, now=now, limits=Limits())


def _done(start: StartOnNode, now: float) -> Completion:
    return Completion(
        node_id=start.node_id,
        incarnation=start.incarnation,
        action_id=start.action.spec.action_id,
        attempt=start.action.attempt,
        outcome=Outcome(exit_code=0, started_at=now, finished_at=now),
    )


def _starts(effects: list[Effect]) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


class Steady:
    """A core with ``queued`` actions waiting behind busy cores, driven one action at a time."""

    def __init__(self, queued: int, fresh: bool) -> None:
        self.core = SchedulerCore(ElasticPolicy())
        self.fresh, self.now, self.n = fresh, 0.0, 0
        for k in range(NODES):
            self.core.node_report(_report(f"n{k}"), 0.0)
        for _ in range(NODES * CORES + queued):
            self._submit()
        self.running: deque[StartOnNode] = deque(_starts(self.core.schedule(self.now)))
        assert len(self.running) == NODES * CORES
        assert len(self.core.queue) == queued

    def _submit(self) -> None:
        tid = f"t{self.n}" if self.fresh else f"t{self.n % TRAJECTORIES}"
        self.core.enqueue(_action(self.n, tid, self.now), self.now)
        self.n += 1

    def cycle(self) -> None:
        self.now += 0.001
        start = self.running.popleft()
        self.core.complete(_done(start, self.now), self.now)
        if self.fresh:
            self.core.close_env(start.action.spec.trajectory_id, self.now)
        self._submit()
        self.running.extend(_starts(self.core.schedule(self.now)))


def per_action_us(queued: int, fresh: bool) -> float:
    """CPU µs per enqueue + schedule + complete cycle with ``queued`` actions waiting."""
    bench = Steady(queued, fresh)
    for _ in range(20 if fresh else WARM):
        bench.cycle()
    rounds = []
    for _ in range(ROUNDS):
        t0, cycles = time.process_time(), 0
        while cycles < MIN_CYCLES or (time.process_time() - t0 < BUDGET_S and cycles < MAX_CYCLES):
            bench.cycle()
            cycles += 1
        rounds.append((time.process_time() - t0) / cycles * 1e6)
    assert len(bench.core.queue) == queued
    assert len(bench.running) == NODES * CORES
    return round(statistics.median(rounds), 1)


def measure() -> dict[str, object]:
    """The keys this adds to ``decision_latency.json``."""
    reused = {str(q): per_action_us(q, fresh=False) for q in QUEUES}
    print("per_action_us_by_queue", reused)
    fresh = {str(q): per_action_us(q, fresh=True) for q in QUEUES}
    print("per_action_us_by_queue_fresh_trajectories", fresh)
    return {
        "core_cost_setup": (
            f"SchedulerCore + ElasticPolicy, {NODES} nodes x {CORES} cores, 1-core no-op actions; "
            "per action: complete the oldest running, enqueue one, one schedule pass (starts "
            "one); CPU time, median of rounds. per_action_us_by_queue: "
            f"{TRAJECTORIES} trajectories reused; _fresh_trajectories: one per action, its "
            "environment closed when it ends"
        ),
        "per_action_us_by_queue": reused,
        "per_action_us_by_queue_fresh_trajectories": fresh,
    }


if __name__ == "__main__":
    measure()
