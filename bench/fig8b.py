"""Figure 8(b) from the simulator -> bench/results/fig8b.json and fig8b.png.

Left: average ACT per trajectory of the MOPD workload (``services/scheduler/sim/mopd_gpu.py``:
bursty calls to 10 teacher services of different sizes, each burst a task domain calling 3 of
them) over batch sizes on 40 GPUs (5 nodes x 8), for Tangram (``elastic``: the live scheduler
core), a model-as-a-service pool without elastic reallocation (``maas``, the ServerlessLLM
baseline) and dedicated GPUs per service (``dedicated``, the SGLang baseline; GPUs split in
proportion to each service's load, which favours it over an even split). Right: the GPUs
Tangram needs to match the dedicated baseline's ACT on 40 GPUs at batch 1024 (searched in
whole nodes). Restore costs come from ``bench/results/gpu.json``'s measured restore bandwidth
(else 9.38 GB/s, this machine's measured figure); ``restore_share`` is restore time over
execution time (restore included) of the pooled policies.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from services.scheduler.sim.mopd_gpu import Config, run

OUT = Path(__file__).parent / "results"
BATCHES = (256, 512, 1024)
POLICIES = ("elastic", "dedicated", "maas")
GPUS = 40
DEFAULT_GB_PER_S = 9.38


def bandwidth() -> float:
    try:
        return float(json.loads((OUT / "gpu.json").read_text())["restore"]["gb_per_s"])
    except (OSError, KeyError, ValueError):
        return DEFAULT_GB_PER_S


def main() -> None:
    base = Config(gpus=GPUS, restore_gb_per_s=bandwidth())
    points: dict[str, dict[str, float]] = {}
    share: dict[str, dict[str, float]] = {}
    for batch in BATCHES:
        cfg = replace(base, batch=batch)
        outs = {p: run(cfg, p) for p in POLICIES}
        points[str(batch)] = {p: round(o.mean_act(), 2) for p, o in outs.items()}
        share[str(batch)] = {
            p: round(o.restore_s / o.exec_s, 3) for p, o in outs.items() if p != "dedicated"
        }
        print(batch, points[str(batch)], share[str(batch)], flush=True)
    target = points["1024"]["dedicated"]
    need = GPUS
    for gpus in range(GPUS - 8, 0, -8):
        act = run(replace(base, batch=1024, gpus=gpus), "elastic").mean_act()
        print("elastic on", gpus, "GPUs:", round(act, 2), flush=True)
        if act > target:
            break
        need = gpus
    result = {
        "points": points,
        "gpus_for_equal_act": {"10": {"elastic": need, "dedicated": GPUS}},
        "restore_share": share,
        "restore_gb_per_s": base.restore_gb_per_s,
        "act_ratio_dedicated_over_elastic_at_1024": round(target / points["1024"]["elastic"], 2),
    }
    (OUT / "fig8b.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(points, need)


def plot(points: dict[str, dict[str, float]], need: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [int(b) for b in points]
    for p in POLICIES:
        left.plot(xs, [points[str(b)][p] for b in xs], marker="o", label=p)
    left.set_xlabel("RL batch size")
    left.set_ylabel("average ACT per trajectory (s)")
    left.legend()
    right.bar(["elastic", "dedicated"], [need, GPUS])
    right.set_ylabel("GPUs for equal ACT (10 services, batch 1024)")
    fig.tight_layout()
    fig.savefig(OUT / "fig8b.png", dpi=120)


if __name__ == "__main__":
    main()
