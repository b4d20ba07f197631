"""Figure 8(b) from the simulator -> bench/results/fig8b.json and fig8b.png.

The workload (``services/scheduler/sim/mopd_workload.py``, whose docstring lists every
parameter against the paper) is calibrated first: the rollout length is set so that the SGLang
baseline's average ACT at batch 2048 is the paper's (18.1 x Table 1's Tangram ACT, 16.3 s);
the tokens per call were set once so that Tangram's mean execution at 2048 is Table 1's
(recorded under ``table1`` next to the paper's breakdown, with 3072 as the check).

Left: average ACT per trajectory over batch sizes on the paper's 40 GPUs (5 nodes x 8, §6.1)
for Tangram (``elastic``: the live scheduler core, FCFS as §4.2; ``elastic_hrrs``: the same
with plexrl's HRRS candidate order), SGLang (``dedicated``: one TP-4 server per teacher, §6.1)
and ServerlessLLM (``maas``: its released controller with its default deployment config).

Right: the fewest GPUs with which each pooled policy reaches the ACT dedicated gets on its own
40 GPUs, at batch 1024 (§6.3: "the same ACT"): bisection over GPU counts up to 80 (8-GPU nodes
plus one with the rest), assuming ACT does not rise with more GPUs; the ACT at the count found
and at one GPU fewer are recorded. ``null``: not reached within 80.

The pooled policies serve the step before the measured one first (``Config.warmup``: the paper
measures while training proceeds, and a restored service stays cached, §5.3); ServerlessLLM at
its keep-alive 0 keeps nothing between steps and SGLang's servers stay loaded, so neither
changes. ``cold_start_at_1024``: the pooled policies from empty GPUs instead. ``seeds_at_1024``:
the same point on other draws of the workload (one run is chaotic: a different draw, or the
same calls shifted in time, moves the ACT by tens of percent).

``sensitivity``: batch 1024 under each parameter the paper does not give, changed one at a time
(the rollout recalibrated each time). Restore costs come from ``bench/results/gpu.json``'s
measured restore bandwidth (else 11.86 GB/s), per host link, one link per GPU: a DoP-k restore
loads k slices at once, priced by the scheduler core's ``gpu.restore_cost`` (the gpu_manager's
sliced restore). Independent runs go to two worker processes.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from services.scheduler.sim.mopd_baselines import run_ideal
from services.scheduler.sim.mopd_gpu import (
    Config,
    Outcomes,
    calibrated,
    dedicated_gpus,
    run,
    workload,
)
from services.scheduler.sim.mopd_workload import (
    SGLANG_ACT_S,
    SGLANG_BATCH,
    TABLE1,
    UNIFORM_32B,
)

OUT = Path(__file__).parent / "results"
BATCHES = (128, 256, 512, 1024, 2048)
POLICIES = ("elastic", "elastic_hrrs", "dedicated", "maas")
POOLED = ("elastic", "elastic_hrrs", "maas")
GPUS = 40  # §6.1: five nodes of eight GPUs
MAX_GPUS = 80
EQUAL_ACT_BATCH = 1024  # §6.3: Figure 8(b) right fixes the batch at 1024
DEFAULT_GB_PER_S = 11.86
SEEDS = (1, 2, 3, 4)  # other draws at the equal-ACT batch, beside seed 0's point
ELASTIC = ("elastic", "elastic_hrrs")


def bandwidth() -> float:
    try:
        return float(json.loads((OUT / "gpu.json").read_text())["restore"]["gb_per_s"])
    except (OSError, KeyError, ValueError):
        return DEFAULT_GB_PER_S


def outcome(cfg: Config, name: str) -> Outcomes:
    if name == "elastic_hrrs":
        return run(cfg, "elastic", "hrrs")
    return run(cfg, name)


def measure(cfg: Config, name: str) -> dict[str, Any]:
    """ACT, restore share and Table 1's breakdown of ``name`` on ``cfg``."""
    o = outcome(cfg, name)
    print(name, cfg.batch, cfg.gpus, round(o.mean_act(), 2), flush=True)
    return {
        "act_s": _round(o.mean_act()),
        "restore_share": round(o.restore_share(), 3),
        "restores_per_call": round(o.restores / max(o.served, 1), 3),
        "restores_beside_a_copy_per_call": round(o.restores_beside_copy / max(o.served, 1), 3),
        "calls_per_dop": {str(d): n for d, n in sorted(o.dops.items())},
        **{k: round(v, 3) for k, v in o.breakdown().items()},
    }


def search(name: str, base: Config, target: float) -> dict[str, Any]:
    """The fewest GPUs (1..MAX_GPUS) on which ``name`` reaches ``target`` at the equal-ACT
    batch; also Figure 8(b) left's point there (on ``GPUS``)."""
    cfg = replace(base, batch=EQUAL_ACT_BATCH)
    acts: dict[int, float] = {}
    point = measure(replace(cfg, gpus=GPUS), name)
    acts[GPUS] = point["act_s"] if point["act_s"] is not None else math.inf

    def act(gpus: int) -> float:
        if gpus not in acts:
            acts[gpus] = outcome(replace(cfg, gpus=gpus), name).mean_act()
            print(name, "on", gpus, "GPUs:", round(acts[gpus], 2), flush=True)
        return acts[gpus]

    hi = GPUS if act(GPUS) <= target else MAX_GPUS
    if act(hi) > target:
        return {"gpus": None, "tried": _tried(acts), "point": point}
    lo = 0 if hi == GPUS else GPUS  # act(lo) misses (0 GPUs serve nothing)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if act(mid) <= target else (mid, hi)
    return {
        "gpus": hi,
        "act_s": _round(acts[hi]),
        "act_s_one_fewer": _round(acts.get(hi - 1, math.inf)),
        "tried": _tried(acts),
        "point": point,
    }


def _round(x: float) -> float | None:
    return round(x, 2) if math.isfinite(x) else None


def _tried(acts: dict[int, float]) -> dict[str, float | None]:
    return {str(g): _round(a) for g, a in sorted(acts.items())}


def ideal_pool(base: Config, target: float) -> dict[str, Any]:
    """An ideal pool at the equal-ACT batch (``run_ideal``: every teacher resident on every
    GPU, no restore, DoP 1): per order, the fewest GPUs reaching ``target`` and the ACT on the
    25% of dedicated's GPUs the target asks for."""
    cfg = replace(base, batch=EQUAL_ACT_BATCH)
    quarter = dedicated_gpus(base) // 4
    out: dict[str, Any] = {
        "what": "every teacher resident on every GPU, no restore, no memory limit, DoP 1"
    }
    for name, sjf in (("fcfs", False), ("shortest_first", True)):
        acts = {
            g: run_ideal(replace(cfg, gpus=g), workload(replace(cfg, gpus=g)), sjf).mean_act()
            for g in range(1, MAX_GPUS + 1)
        }
        fewest = min((g for g, a in acts.items() if a <= target), default=None)
        out[name] = {"gpus": fewest, f"act_s_on_{quarter}": _round(acts[quarter])}
    return out


def variants(base: Config) -> dict[str, tuple[str, Config]]:
    """One change at a time of what the paper does not give: name -> (what, config)."""
    maas = base.maas
    return {
        "uniform_32b": ("all ten teachers 32B", replace(base, sizes_b=UNIFORM_32B)),
        "parallel_0.95": ("Amdahl parallel fraction 0.95", replace(base, parallel=0.95)),
        "task_window_0.1": (
            "a task's calls within 10% of the rollout",
            replace(base, task_window=0.1),
        ),
        "task_window_1": ("every task over the whole rollout", replace(base, task_window=1.0)),
        "restore_x4": (
            "restore 4x our measured bandwidth (Hopper-class PCIe 5 host-to-device)",
            replace(base, restore_gb_per_s=4 * base.restore_gb_per_s),
        ),
        "two_gpus_per_link": (
            "two GPUs of a node per host link (a PCIe switch per pair): sliced restores half as"
            " parallel",
            replace(base, gpus_per_link=2),
        ),
        "seed_1": ("another draw of the workload", replace(base, seed=1)),
        "seed_2": ("another draw of the workload", replace(base, seed=2)),
        "maas_startup_10s": (
            "ServerlessLLM instance start 10 s besides the load",
            replace(base, maas=replace(maas, startup_s=10.0)),
        ),
        "maas_4_gpus": (
            "ServerlessLLM instances on 4 GPUs (the SGLang deployment's TP)",
            replace(base, maas=replace(maas, num_gpus=4)),
        ),
        "maas_tick_0.1s": (
            "ServerlessLLM control loops every 0.1 s instead of 1 s",
            replace(base, maas=replace(maas, tick_s=0.1)),
        ),
    }


def _sensitivity_jobs(base: Config) -> list[tuple[str, str, Config]]:
    jobs = []
    for key, (_, cfg) in variants(base).items():
        cfg = replace(calibrated(cfg), batch=EQUAL_ACT_BATCH)
        names = ("maas",) if key.startswith("maas") else ("elastic", "elastic_hrrs", "maas")
        jobs += [(key, n, cfg) for n in names]
    return jobs


def main() -> None:
    base = calibrated(Config(gpus=GPUS, restore_gb_per_s=bandwidth()))
    dedicated = {b: run(replace(base, batch=b), "dedicated").mean_act() for b in BATCHES}
    target = dedicated[EQUAL_ACT_BATCH]
    with ProcessPoolExecutor(max_workers=2) as pool:
        searches = {n: pool.submit(search, n, base, target) for n in POOLED}
        pts: dict[tuple[str, int], Future[dict[str, Any]]] = {
            (n, b): pool.submit(measure, replace(base, batch=b), n)
            for b in BATCHES
            if b != EQUAL_ACT_BATCH
            for n in POOLED
        }
        pts["elastic", 3072] = pool.submit(measure, replace(base, batch=3072), "elastic")
        at = replace(base, batch=EQUAL_ACT_BATCH)
        cold = {n: pool.submit(measure, replace(at, warmup=False), n) for n in ELASTIC}
        draws = {
            (n, s): pool.submit(measure, replace(at, seed=s), n) for n in ELASTIC for s in SEEDS
        }
        sens = {(key, n): pool.submit(measure, cfg, n) for key, n, cfg in _sensitivity_jobs(base)}
        found = {n: f.result() for n, f in searches.items()}
        measured = {k: f.result() for k, f in pts.items()}
        sens_out = {k: f.result() for k, f in sens.items()}
        extra = {
            "cold_start_at_1024": {n: f.result() for n, f in cold.items()},
            "seeds_at_1024": seeds({k: f.result() for k, f in draws.items()}, at),
        }
    for n in POOLED:
        measured[n, EQUAL_ACT_BATCH] = found[n].pop("point")
    result = assemble(base, dedicated, found, measured, sens_out)
    result["breakdown_at_128"] = {n: measured[n, 128] for n in POOLED}
    result.update(extra)
    result["seeds_at_1024"]["0"] = {
        **{n: measured[n, EQUAL_ACT_BATCH]["act_s"] for n in ELASTIC},
        "dedicated": round(dedicated[EQUAL_ACT_BATCH], 2),
    }
    result["seeds_at_1024"] = dict(sorted(result["seeds_at_1024"].items()))
    result["ideal_pool_at_1024"] = ideal_pool(base, target)
    result["seeds_at_1024"]["mean_ratio"] = mean_ratios(result["seeds_at_1024"])
    (OUT / "fig8b.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["gpus_for_equal_act"]), flush=True)
    plot(result["points"], result["gpus_for_equal_act"]["10"])


def assemble(
    base: Config,
    dedicated: dict[int, float],
    found: dict[str, dict[str, Any]],
    measured: dict[tuple[str, int], dict[str, Any]],
    sens: dict[tuple[str, str], dict[str, Any]],
) -> dict[str, Any]:
    points = {
        str(b): {
            **{n: measured[n, b]["act_s"] for n in POOLED},
            "dedicated": round(dedicated[b], 2),
        }
        for b in BATCHES
    }
    at = points[str(EQUAL_ACT_BATCH)]
    return {
        "points": points,
        "gpus_for_equal_act": {
            "10": {**{n: found[n]["gpus"] for n in POOLED}, "dedicated": dedicated_gpus(base)}
        },
        "equal_act_search": {
            "batch": EQUAL_ACT_BATCH,
            "target_act_s": round(dedicated[EQUAL_ACT_BATCH], 2),
            **found,
        },
        "restore_share": {
            str(b): {n: measured[n, b]["restore_share"] for n in POOLED} for b in BATCHES
        },
        "restore_gb_per_s": base.restore_gb_per_s,
        "act_ratio_dedicated_over_elastic_at_1024": _ratio(at["dedicated"], at["elastic"]),
        "act_ratio_dedicated_over_elastic_hrrs_at_1024": _ratio(
            at["dedicated"], at["elastic_hrrs"]
        ),
        "act_ratio_maas_over_elastic_at_1024": _ratio(at["maas"], at["elastic"]),
        "table1": {str(b): {"paper": TABLE1[b], "elastic": measured["elastic", b]} for b in TABLE1},
        "breakdown_at_1024": {n: measured[n, EQUAL_ACT_BATCH] for n in POOLED},
        "workload": {
            **{k: v for k, v in asdict(base).items() if k not in ("batch", "gpus")},
            "calibration": {
                "dedicated_act_s_at_2048": round(dedicated[SGLANG_BATCH], 2),
                "paper_dedicated_act_s_at_2048": round(SGLANG_ACT_S, 2),
            },
        },
        "sensitivity": sensitivity(base, sens),
    }


def sensitivity(base: Config, sens: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, (what, cfg) in variants(base).items():
        cal = replace(calibrated(cfg), batch=EQUAL_ACT_BATCH)
        row: dict[str, Any] = {
            "what": what,
            "rollout_s": cal.rollout_s,
            "dedicated": _round(run(cal, "dedicated").mean_act()),
        }
        for (k, n), m in sens.items():
            if k == key:
                row[n] = m["act_s"]
                row[f"{n}_restore_share"] = m["restore_share"]
        out[key] = row
    return out


def seeds(draws: dict[tuple[str, int], dict[str, Any]], at: Config) -> dict[str, Any]:
    """Per other draw of the workload at the equal-ACT batch: each elastic policy's ACT and
    dedicated's."""
    return {
        str(s): {
            **{n: draws[n, s]["act_s"] for n in ELASTIC},
            "dedicated": round(run(replace(at, seed=s), "dedicated").mean_act(), 2),
        }
        for s in SEEDS
    }


def mean_ratios(by_seed: dict[str, dict[str, float | None]]) -> dict[str, float | None]:
    """Dedicated's mean ACT over each elastic policy's, over the draws."""
    rows = list(by_seed.values())
    ded = sum(r["dedicated"] or math.inf for r in rows)
    return {n: _ratio(ded, sum(r[n] or math.inf for r in rows)) for n in ELASTIC}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def plot(points: dict[str, dict[str, float | None]], gpus: dict[str, int | None]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    xs = [int(b) for b in points]
    for p in POLICIES:
        ys = [points[str(b)][p] for b in xs]
        left.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=p)
    left.set_xscale("log", base=2)
    left.set_xticks(xs, [str(x) for x in xs])
    left.set_xlabel("RL batch size")
    left.set_ylabel("average ACT per trajectory (s)")
    left.set_yscale("log")
    left.legend()
    names = list(POLICIES)
    heights = [gpus.get(p) or MAX_GPUS for p in names]
    bars = right.bar(names, heights)
    for bar, p in zip(bars, names, strict=True):
        label = str(gpus[p]) if gpus.get(p) is not None else f"> {MAX_GPUS}"
        right.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center")
        if gpus.get(p) is None:
            bar.set_hatch("//")
            bar.set_alpha(0.4)
    right.set_ylabel(f"GPUs for dedicated's ACT\n(10 services, batch {EQUAL_ACT_BATCH})")
    fig.tight_layout()
    fig.savefig(OUT / "fig8b.png", dpi=120)


if __name__ == "__main__":
    main()
