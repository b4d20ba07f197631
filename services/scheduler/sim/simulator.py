"""Discrete-event simulator: replays a workload trace against the scheduler with a virtual clock.

Trajectories alternate LLM-generation gaps and actions; every action goes to the engine of its
pool (CPU nodes through ``SchedulerCore``, or the trajectory-static baseline; GPU chunks; API
quotas). After all events of one instant the engines decide, and started actions complete after
their true duration on the units they got. Deterministic for a trace: ties are broken by an
event sequence number, and generators are seeded.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.scheduler.policies.durations import DurationLearner
from services.scheduler.policies.spec import Kind, make_policy, parse_policy
from services.scheduler.sim.engines import CoreEngine, Engine, PodEngine, SharedEngine, SimAction
from services.scheduler.sim.kube import KubeConfig, KubeEngine
from services.scheduler.sim.traces import (
    CodingConfig,
    MopdConfig,
    SearchConfig,
    Trace,
    ai_coding,
    deepsearch,
    load,
    mopd,
)

SUBMIT, COMPLETE, WAKE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: int = 5
    cores_per_node: int = 256
    gpus_per_node: int = 8
    gpu_nodes: int = 5
    quota: int = 32  # concurrent calls per API site


@dataclass(frozen=True, slots=True)
class Record:
    """What happened to one action."""

    action_id: str
    trajectory_id: str
    profile: str
    submitted_at: float
    started_at: float
    finished_at: float
    units: int

    @property
    def act_s(self) -> float:
        return self.finished_at - self.submitted_at


@dataclass
class SimResult:
    policy: str
    records: list[Record] = field(default_factory=list)
    decisions: list[tuple[float, str, int]] = field(default_factory=list)  # (t, action, units)

    def mean_act_per_trajectory(self) -> float:
        """The paper's §6.3 metric: total ACT per trajectory, averaged over trajectories."""
        per: dict[str, float] = {}
        for r in self.records:
            per[r.trajectory_id] = per.get(r.trajectory_id, 0.0) + r.act_s
        return sum(per.values()) / max(1, len(per))

    def mean_act(self, profile: str | None = None) -> float:
        acts = [r.act_s for r in self.records if profile is None or r.profile == profile]
        return sum(acts) / max(1, len(acts))

    def makespan(self) -> float:
        return max((r.finished_at for r in self.records), default=0.0)

    def summary(self) -> dict[str, float | str | int]:
        return {
            "policy": self.policy,
            "actions": len(self.records),
            "mean_act_per_trajectory_s": round(self.mean_act_per_trajectory(), 3),
            "mean_act_s": round(self.mean_act(), 3),
            "makespan_s": round(self.makespan(), 3),
        }


class Simulator:
    """Drives engines with a virtual clock over one trace."""

    def __init__(
        self, trace: Trace, policy: str, cluster: Cluster | None = None, *, pods: bool = True
    ) -> None:
        self.trace = {t.trajectory_id: t for t in trace}
        self.policy = policy
        self.cluster = cluster or Cluster()
        self.pods = pods  # trajectory-static as the figures' pod baseline, else through the core
        self._learner = DurationLearner()
        self._engines: dict[str, Engine | KubeEngine] = {}
        self._events: list[tuple[float, int, int, str]] = []
        self._seq = 0
        self._actions: dict[str, tuple[SimAction, str]] = {}
        self._started: dict[str, tuple[float, int]] = {}
        self._pools_touched: set[str] = set()
        self._wakes: set[tuple[str, float]] = set()
        # action -> its current finish time (fluid engines move it)
        self._due: dict[str, float] = {}

    def run(self) -> SimResult:
        result = SimResult(self.policy)
        for t in self.trace.values():
            if t.steps:
                self._push(t.start_s + t.steps[0].gap_s, SUBMIT, f"{t.trajectory_id}#0")
        while self._events:
            now = self._events[0][0]
            while self._events and self._events[0][0] == now:
                _, _, kind, key = heapq.heappop(self._events)
                if kind == SUBMIT:
                    self._submit(key, now)
                elif kind == WAKE:
                    self._pools_touched.add(key)
                elif self._due.get(key) == now:  # else a stale finish time: the share changed
                    self._complete(key, now, result)
            self._decide(now, result)
        return result

    def _push(self, t: float, kind: int, key: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, key))

    def _engine(self, pool: str) -> Engine | KubeEngine:
        if pool not in self._engines:
            self._engines[pool] = self._make_engine(pool)
        return self._engines[pool]

    def _make_engine(self, pool: str) -> Engine | KubeEngine:
        c = self.cluster
        if pool == "cpu" and self.policy.startswith("kubernetes"):
            return KubeEngine(KubeConfig.parse(self.policy), c.nodes, c.cores_per_node)
        kube = self.policy.startswith("kubernetes")
        spec = parse_policy("min" if kube else self.policy)
        static = spec.kind is Kind.TRAJECTORY_STATIC
        if pool == "cpu" and static and self.pods:
            return PodEngine(spec.arg, c.nodes, c.cores_per_node)
        if pool == "cpu":
            return CoreEngine(make_policy(spec, self._learner), c.nodes, c.cores_per_node)
        # the baselines' GPU and quota pools run min
        policy = make_policy(parse_policy("min") if static else spec, self._learner)
        if pool == "gpu":
            return SharedEngine(policy, c.gpus_per_node * c.gpu_nodes, c.gpus_per_node)
        return SharedEngine(policy, c.quota)

    def _submit(self, key: str, now: float) -> None:
        tid, _, idx = key.rpartition("#")
        step = self.trace[tid].steps[int(idx)]
        action = SimAction(key, tid, step, now)
        self._actions[key] = (action, step.pool)
        self._engine(step.pool).submit(action, now)
        self._pools_touched.add(step.pool)

    def _complete(self, key: str, now: float, result: SimResult) -> None:
        action, pool = self._actions.pop(key)
        started_at, units = self._started.pop(key)
        del self._due[key]
        self._engine(pool).complete(key, now)
        self._pools_touched.add(pool)
        result.records.append(
            Record(
                key,
                action.trajectory_id,
                action.step.profile,
                action.submitted_at,
                started_at,
                now,
                units,
            )
        )
        traj = self.trace[action.trajectory_id]
        nxt = int(key.rpartition("#")[2]) + 1
        if nxt < len(traj.steps):
            self._push(now + traj.steps[nxt].gap_s, SUBMIT, f"{traj.trajectory_id}#{nxt}")
        else:
            for engine in self._engines.values():
                engine.close(traj.trajectory_id, now)

    def _decide(self, now: float, result: SimResult) -> None:
        for pool in sorted(self._pools_touched):
            engine = self._engine(pool)
            for key, units in engine.schedule(now):
                action, _ = self._actions[key]
                self._started[key] = (now, units)
                result.decisions.append((now, key, units))
                if not isinstance(engine, KubeEngine):
                    self._finish_at(key, now + action.step.duration(units))
            if isinstance(engine, KubeEngine):
                for key, t in engine.due(now).items():
                    self._finish_at(key, t)
                wake = engine.wake_at()
                if wake is not None and wake > now and (pool, wake) not in self._wakes:
                    self._wakes.add((pool, wake))
                    self._push(wake, WAKE, pool)
        self._pools_touched.clear()

    def _finish_at(self, key: str, t: float) -> None:
        self._due[key] = t
        self._push(t, COMPLETE, key)


def simulate(
    trace: Trace, policy: str, cluster: Cluster | None = None, *, pods: bool = True
) -> SimResult:
    """Run ``trace`` under ``policy`` (``make_policy`` names) and return what happened;
    ``pods=False`` runs trajectory-static through the core, as the live scheduler does."""
    return Simulator(trace, policy, cluster, pods=pods).run()


def build_trace(workload: str, batch: int, seed: int) -> Trace:
    match workload:
        case "coding":
            return ai_coding(CodingConfig(batch=batch), seed)
        case "mopd":
            return mopd(MopdConfig(batch=batch), seed)
        case "deepsearch":
            return deepsearch(SearchConfig(batch=batch), seed)
    raise ValueError(f"unknown workload {workload!r}; known: coding, mopd, deepsearch")


def check_policy(spec: str) -> None:
    """Raise ValueError naming the problem unless ``spec`` is a policy the simulator runs."""
    if spec.startswith("kubernetes"):
        KubeConfig.parse(spec)
        return
    try:
        parse_policy(spec)
    except ValueError as exc:
        raise ValueError(f"{exc} (or, in the simulator, kubernetes[:REQUEST:LIMIT])") from exc


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``tangram simulate``: run a generated or recorded trace under one or more policies."""
    ap = argparse.ArgumentParser(prog="tangram simulate", description=main.__doc__)
    ap.add_argument("--workload", default="coding", help="coding | mopd | deepsearch")
    ap.add_argument("--trace", type=Path, help="a JSONL trace instead of a generated one")
    ap.add_argument("--batch", type=_positive, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policy", action="append", help="repeatable; default elastic; kubernetes[:REQ:LIMIT]"
    )
    ap.add_argument("--nodes", type=_positive, default=5)
    ap.add_argument("--cores", type=_positive, default=256, help="cores per node")
    ap.add_argument("--json", action="store_true", help="one JSON object per policy")
    args = ap.parse_args(argv)
    policies = args.policy or ["elastic"]
    try:
        for policy in policies:
            check_policy(policy)
        trace = (
            load(args.trace) if args.trace else build_trace(args.workload, args.batch, args.seed)
        )
    except (ValueError, OSError) as exc:
        ap.error(str(exc))
    cluster = Cluster(nodes=args.nodes, cores_per_node=args.cores)
    for policy in policies:
        summary = simulate(trace, policy, cluster).summary()
        if args.json:
            print(json.dumps(summary))
        else:
            print("  ".join(f"{k}={v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
