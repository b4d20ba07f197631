"""Figure 8(b) from the simulator -> bench/results/fig8b.json and fig8b.png.

Left: average ACT per trajectory of the MOPD workload (``services/scheduler/sim/mopd_gpu.py``:
bursty calls to 10 teacher services of different sizes, each burst a task domain calling 3 of
them) over batch sizes on the paper's 40 GPUs (5 nodes x 8, §6.1), for Tangram (``elastic``:
the live scheduler core), a model-as-a-service pool without elastic reallocation (``maas``,
the ServerlessLLM baseline; pooled like Tangram, so also on 40 GPUs) and SGLang (``dedicated``:
one server per service with TP over 4 GPUs, the paper's baseline, 40 GPUs for 10 services).

Right: the fewest GPUs with which each pooled policy reaches the ACT the dedicated baseline
gets on its own 40 GPUs, at batch 1024 (§6.3: "the same ACT"). Bisection over every GPU count
from 1 to 40 (8-GPU nodes plus one node with the rest), assuming ACT does not rise with more
GPUs; the ACT at the count found and at one GPU fewer are recorded, so the boundary is
checked, not inferred. ``null``: not reached within 40.

Restore costs come from ``bench/results/gpu.json``'s measured restore bandwidth (else 9.38
GB/s, an earlier measurement on this machine); ``restore_share`` is restore time over
execution time with restores (Table 1's overhead / (execution + overhead)). The independent
runs go to two worker processes (this box has two cores).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from services.scheduler.sim.mopd_gpu import Config, dedicated_gpus, run

OUT = Path(__file__).parent / "results"
BATCHES = (256, 512, 1024)
POLICIES = ("elastic", "dedicated", "maas")
POOLED = ("elastic", "maas")
GPUS = 40  # §6.1: five nodes of eight GPUs
EQUAL_ACT_BATCH = 1024  # §6.3: Figure 8(b) right fixes the batch at 1024
DEFAULT_GB_PER_S = 9.38


def bandwidth() -> float:
    try:
        return float(json.loads((OUT / "gpu.json").read_text())["restore"]["gb_per_s"])
    except (OSError, KeyError, ValueError):
        return DEFAULT_GB_PER_S


def points_of(policy: str, base: Config) -> dict[int, tuple[float, float]]:
    """Batch -> (average ACT, restore share) of ``policy`` on ``base.gpus`` GPUs, but for the
    equal-ACT batch (``search`` runs it)."""
    out = {}
    for batch in BATCHES:
        if batch == EQUAL_ACT_BATCH:
            continue
        o = run(replace(base, batch=batch), policy)
        out[batch] = (o.mean_act(), o.restore_share())
        print(policy, batch, round(out[batch][0], 2), flush=True)
    return out


def search(policy: str, base: Config, target: float) -> dict[str, Any]:
    """The fewest GPUs (1..GPUS) on which ``policy`` reaches ``target`` at the equal-ACT batch."""
    cfg = replace(base, batch=EQUAL_ACT_BATCH)
    acts: dict[int, float] = {}
    full = run(replace(cfg, gpus=GPUS), policy)  # also Figure 8(b) left's point at this batch
    acts[GPUS] = full.mean_act()
    point = {"act_s": acts[GPUS], "restore_share": full.restore_share()}

    def act(gpus: int) -> float:
        if gpus not in acts:
            acts[gpus] = run(replace(cfg, gpus=gpus), policy).mean_act()
            print(policy, "on", gpus, "GPUs:", round(acts[gpus], 2), flush=True)
        return acts[gpus]

    if act(GPUS) > target:
        return {"gpus": None, "tried": _finite(acts), "point": point}
    lo, hi = 0, GPUS  # act(lo) misses (0 GPUs serve nothing), act(hi) reaches
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if act(mid) <= target else (mid, hi)
    return {
        "gpus": hi,
        "act_s": round(acts[hi], 2),
        "act_s_one_fewer": _round(acts.get(hi - 1, math.inf)),
        "tried": _finite(acts),
        "point": point,
    }


def _round(x: float) -> float | None:
    return round(x, 2) if math.isfinite(x) else None


def _finite(acts: dict[int, float]) -> dict[str, float | None]:
    return {str(g): _round(a) for g, a in sorted(acts.items())}


def main() -> None:
    base = Config(gpus=GPUS, restore_gb_per_s=bandwidth())
    dedicated = {b: run(replace(base, batch=b), "dedicated").mean_act() for b in BATCHES}
    target = dedicated[EQUAL_ACT_BATCH]
    jobs: list[tuple[Callable[..., Any], tuple[Any, ...]]] = [
        (search, ("elastic", base, target)),
        (points_of, ("elastic", base)),
        (search, ("maas", base, target)),
        (points_of, ("maas", base)),
    ]
    with ProcessPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(fn, *args) for fn, args in jobs]
        found_e, pts_e, found_m, pts_m = (f.result() for f in futures)
    for found, pts in ((found_e, pts_e), (found_m, pts_m)):
        point = found.pop("point")
        pts[EQUAL_ACT_BATCH] = (point["act_s"], point["restore_share"])
    measured = {"elastic": pts_e, "maas": pts_m}
    points = {
        str(b): {
            "elastic": round(pts_e[b][0], 2),
            "dedicated": round(dedicated[b], 2),
            "maas": round(pts_m[b][0], 2),
        }
        for b in BATCHES
    }
    share = {str(b): {p: round(measured[p][b][1], 3) for p in POOLED} for b in BATCHES}
    at = points[str(EQUAL_ACT_BATCH)]
    result = {
        "points": points,
        "gpus_for_equal_act": {
            "10": {
                "elastic": found_e["gpus"],
                "dedicated": dedicated_gpus(base),
                "maas": found_m["gpus"],
            }
        },
        "equal_act_search": {
            "batch": EQUAL_ACT_BATCH,
            "target_act_s": round(target, 2),
            "elastic": found_e,
            "maas": found_m,
        },
        "restore_share": share,
        "restore_gb_per_s": base.restore_gb_per_s,
        "act_ratio_dedicated_over_elastic_at_1024": round(at["dedicated"] / at["elastic"], 2),
        "act_ratio_maas_over_elastic_at_1024": round(at["maas"] / at["elastic"], 2),
    }
    (OUT / "fig8b.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["gpus_for_equal_act"]), flush=True)
    plot(points, result["gpus_for_equal_act"]["10"])


def plot(points: dict[str, dict[str, float]], gpus: dict[str, int | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [int(b) for b in points]
    for p in POLICIES:
        left.plot(xs, [points[str(b)][p] for b in xs], marker="o", label=p)
    left.set_xlabel("RL batch size")
    left.set_ylabel("average ACT per trajectory (s)")
    left.set_yscale("log")
    left.legend()
    names = [p for p in POLICIES if gpus.get(p) is not None]
    right.bar(names, [gpus[p] or 0 for p in names])
    right.set_ylabel(f"GPUs for dedicated's ACT\n(10 services, batch {EQUAL_ACT_BATCH})")
    fig.tight_layout()
    fig.savefig(OUT / "fig8b.png", dpi=120)


if __name__ == "__main__":
    main()
