"""Figures 9 and 8(a) of the paper from the simulator -> bench/results/fig9.*, fig8a.*.

Fig. 9: average ACT of elastic against fixed DoP 4 and 16 over batch sizes on 1,280 cores in
5 nodes. Fig. 8(a): elastic against the trajectory-static baselines over batch sizes, and at
batch 1,280 over core counts: ``kubernetes`` is the paper's own (§6.1: a pod per trajectory
requesting 0.5 core with a 4-core limit, cores shared by the kernel; ``sim/kube.py``), and
``trajectory-static:1`` a pod that holds one dedicated core for the trajectory's life. The
metric is the paper's §6.3 one: total ACT per trajectory, averaged over trajectories.
Workload: ``traces.ai_coding`` with its defaults (3-8 tool turns per trajectory instead of
tens, to keep a run within minutes on 2 cores), calibrated so that environments are busy 47% of
their life as the paper measured (``busy_fraction``). ``fig9.json`` also carries the reward and
tool actions' own mean ACT, ``fixed-dop:8`` (the best fixed DoP here, though not the paper's),
``floor`` (what no policy beats on the trace), and ``variants_at_1280``: the same policies at
batch 1,280 on a heavier trace (environments busy 88%) and on one with 20-40 turns."""

from __future__ import annotations

import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from services.scheduler.sim.simulator import Cluster, simulate
from services.scheduler.sim.traces import CodingConfig, Trace, ai_coding, busy_fraction

OUT = Path(__file__).parent / "results"
FIG9_BATCHES = (128, 256, 512, 1024, 1280, 1536)
FIG9_POLICIES = ("elastic", "fixed-dop:4", "fixed-dop:16", "fixed-dop:8")
FIG8_BATCHES = (128, 256, 512, 1024, 1280, 1536)
FIG8_NODES = (3, 4, 5)  # x 256 cores: 768, 1024, 1280
STATIC = ("kubernetes", "trajectory-static:1")
SEED = 0
# Other traces the policies are compared on at batch 1,280.
VARIANTS = {
    "default": CodingConfig(),
    "heavy (busy 88%)": CodingConfig(gap_median_s=8.0, tool_median_s=8.0),
    "20-40 turns": CodingConfig(turns=(20, 40), gap_median_s=15.0),
}
VARIANT_POLICIES = (*FIG9_POLICIES, "trajectory-static:1")


# batch, policy, nodes, variant, ACT per trajectory, mean ACT of the reward and tool actions
Point = tuple[int, str, int, str, float, float, float]


def coding(batch: int, variant: str = "default") -> Trace:
    return ai_coding(replace(VARIANTS[variant], batch=batch), SEED)


def point(args: tuple[int, str, int, str]) -> Point:
    batch, policy, nodes, variant = args
    result = simulate(coding(batch, variant), policy, Cluster(nodes=nodes))
    per_trajectory = round(result.mean_act_per_trajectory(), 2)
    reward, tool = (round(result.mean_act(p), 2) for p in ("reward", "tool"))
    return batch, policy, nodes, variant, per_trajectory, reward, tool


def floor(batch: int) -> dict[str, float]:
    """What no policy beats on the trace: every action starts at once on its largest allowed
    allocation (the reward on 32 cores, tools on one), so ACT is pure execution."""
    trace = coding(batch)
    reward = float(np.mean([t.steps[-1].duration(t.steps[-1].choices[-1]) for t in trace]))
    tool = float(np.mean([sum(s.duration(s.choices[-1]) for s in t.steps[:-1]) for t in trace]))
    return {
        "reward_act": round(reward, 1),
        "tool_exec_per_trajectory": round(tool, 1),
        "act_per_trajectory": round(reward + tool, 1),
    }


def run(jobs: list[tuple[int, str, int, str]]) -> list[Point]:
    with ProcessPoolExecutor(max_workers=2) as pool:
        return list(pool.map(point, sorted(jobs, key=lambda j: -j[0])))


def plot(name: str, series: dict[str, dict[str, float]], xlabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.2))
    policies = sorted({p for pts in series.values() for p in pts})
    for p in policies:
        xs = [x for x in series if p in series[x]]
        ax.plot([int(x) for x in xs], [series[x][p] for x in xs], marker="o", label=p)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("avg ACT per trajectory (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / f"{name}.png", dpi=120)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    jobs = [(b, p, 5, "default") for b in FIG9_BATCHES for p in FIG9_POLICIES]
    jobs += [(b, p, 5, "default") for b in FIG8_BATCHES for p in STATIC]
    jobs += [(1280, p, n, "default") for n in FIG8_NODES[:-1] for p in ("elastic", *STATIC)]
    jobs += [(1280, p, 5, v) for v in VARIANTS if v != "default" for p in VARIANT_POLICIES]
    res = run(jobs)
    fig9: dict[str, dict[str, float]] = {}
    fig8_batch: dict[str, dict[str, float]] = {}
    fig8_cores: dict[str, dict[str, float]] = {}
    reward: dict[str, dict[str, float]] = {}  # mean ACT of the (elastic) reward actions alone
    tool: dict[str, dict[str, float]] = {}  # and of the one-core tool actions
    variant_act: dict[str, dict[str, float]] = {}
    for batch, policy, nodes, variant, act, reward_act, tool_act in res:
        if variant != "default":
            variant_act.setdefault(variant, {})[policy] = act
            continue
        if nodes == 5:
            if policy in FIG9_POLICIES:
                fig9.setdefault(str(batch), {})[policy] = act
                reward.setdefault(str(batch), {})[policy] = reward_act
                tool.setdefault(str(batch), {})[policy] = tool_act
            if policy in ("elastic", *STATIC):
                fig8_batch.setdefault(str(batch), {})[policy] = act
        if batch == 1280 and policy in ("elastic", *STATIC):
            fig8_cores.setdefault(str(nodes * 256), {})[policy] = act
    note = (
        "simulated AI-coding trace (services/scheduler/sim/traces.py ai_coding defaults, seed 0);"
        " metric: mean total ACT per trajectory in seconds"
    )
    (OUT / "fig9.json").write_text(
        json.dumps(
            {
                "cores": 1280,
                "nodes": 5,
                "note": note,
                "points": {k: fig9[k] for k in sorted(fig9, key=int)},
                "reward_act": {k: reward[k] for k in sorted(reward, key=int)},
                "tool_act": {k: tool[k] for k in sorted(tool, key=int)},
                "busy_fraction": round(busy_fraction(coding(1280)), 3),
                "floor": {str(b): floor(b) for b in FIG9_BATCHES},
                "variants_at_1280": {
                    v: {"busy_fraction": round(busy_fraction(coding(1280, v)), 3), "act": acts}
                    for v, acts in variant_act.items()
                },
            },
            indent=1,
        )
    )
    (OUT / "fig8a.json").write_text(
        json.dumps(
            {
                "cores": 1280,
                "nodes": 5,
                "note": note,
                "baselines": list(STATIC),
                "points": {k: fig8_batch[k] for k in sorted(fig8_batch, key=int)},
                "batch_1280_by_cores": {k: fig8_cores[k] for k in sorted(fig8_cores, key=int)},
            },
            indent=1,
        )
    )
    plot("fig9", fig9, "RL batch size")
    plot("fig8a", fig8_batch, "RL batch size")
    json.dump({"fig9": fig9, "fig8a": fig8_batch, "fig8a_cores": fig8_cores}, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
