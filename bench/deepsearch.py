"""The DeepSearch comparison (issue 12 item 5) -> bench/results/deepsearch.{json,png}.

Runs ``services/scheduler/sim/deepsearch.py``: seeded multi-turn trajectories from three jobs, each
turn thinking then calling one of three rate-limited APIs (a modelled provider that accepts at
most its true limit per sliding second and answers 429 otherwise), under three policies —
``tangram`` (one cluster-wide limiter per API declared at the true limit, fair queue across
jobs), ``per_process`` (8 workers, each limiting itself to the full rate, retrying a 429 with
exponential backoff) and ``retry`` (no limiter, retries on 429 with exponential backoff); a
trajectory fails when one call is still throttled after ``max_retries`` retries. Every policy
runs the same trajectories (plans and think times are drawn up front), over batch sizes.

Goodput counts only calls of trajectories that completed, divided by the policy's makespan but
never less than ``floor_s``, a lower bound on the time *any* policy needs to complete the whole
batch (the busiest provider at its true limit; the longest think-and-call chain): a policy gains
nothing by failing trajectories early, and one that completes everything is measured over its own
makespan. The flattering goodput over the bare makespan is kept beside it. ``retry_budget``
repeats the headline batch with more retries for the baselines, which fail less but take longer.

    python -m bench.deepsearch
"""

from __future__ import annotations

import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from services.scheduler.sim.deepsearch import POLICIES, Report, Workload, compare, floor_s

OUT = Path(__file__).parent / "results"
BATCHES = (60, 120, 240, 480)
HEADLINE = 240  # the simulator's default batch
RETRY_BUDGETS = (3, 6, 10)  # max_retries of the baselines at the headline batch

DEFINITIONS = {
    "batch": "concurrent trajectories, all started at t=0",
    "calls_429": "provider responses with status 429 (every attempt counts)",
    "avg_act_s": (
        "mean action completion time in seconds, from the call's submission (after the think"
        " time) to its successful response, including queueing, backoffs and retries; over"
        " calls that succeeded only, so a policy that fails its slow calls looks faster"
    ),
    "failed_trajectories": "trajectories abandoned because a call was still throttled after max_retries",
    "completed_trajectories": "trajectories whose every call succeeded",
    "useful_calls": "calls belonging to completed trajectories",
    "floor_s": (
        "lower bound on any policy's makespan for completing the whole batch: max of the busiest"
        " provider's calls at its true limit and the longest chain of think times and call latencies"
    ),
    "goodput": (
        "useful_calls / max(makespan_s, floor_s), calls per second: only completed work counts,"
        " and a policy that fails trajectories early is still measured over at least the time the"
        " whole batch needs"
    ),
    "goodput_own_makespan": (
        "useful_calls / makespan_s: flatters a policy that fails trajectories early (its run"
        " ends sooner, and the failed trajectories would still have to be run again)"
    ),
    "makespan_s": "time until every trajectory has completed or failed",
    "provider_bound": (
        "calls per second the providers can accept for this API mix in expectation:"
        " min over APIs of limit / share of calls (uniform choice of API per turn)"
    ),
}


def provider_bound(workload: Workload) -> float:
    """Expected ceiling on useful calls per second: the API the mix saturates first."""
    share = 1.0 / len(workload.rates)
    return min(limit / share for _, limit in workload.rates)


def policy_row(report: Report, floor: float) -> dict[str, Any]:
    horizon = max(report.makespan_s, floor)
    return {
        "calls_429": report.throttled,
        "avg_act_s": round(report.act_s, 3),
        "failed_trajectories": report.failed,
        "completed_trajectories": report.completed,
        "useful_calls": report.useful,
        "goodput": round(report.useful / horizon, 3) if horizon > 0 else 0.0,
        "goodput_own_makespan": round(report.goodput, 3),
        "makespan_s": round(report.makespan_s, 2),
    }


def run(workload: Workload) -> dict[str, Any]:
    """Every policy on ``workload``, with the floor its goodput is measured against."""
    floor = floor_s(workload)
    return {
        "floor_s": round(floor, 2),
        "policies": {r.policy: policy_row(r, floor) for r in compare(workload)},
    }


def workload_params(base: Workload) -> dict[str, Any]:
    params = asdict(base)
    params.pop("trajectories")  # the swept batch
    params["rates_per_s"] = dict(params.pop("rates"))
    params["turns"] = list(base.turns)
    return params


def sweep(base: Workload, batches: tuple[int, ...] = BATCHES) -> dict[str, Any]:
    """The whole result document: workload, definitions, and each batch's policies."""
    results = {str(b): run(replace(base, trajectories=b)) for b in batches}
    headline = HEADLINE if HEADLINE in batches else batches[-1]
    at_headline = replace(base, trajectories=headline)
    return {
        "note": (
            "discrete-event simulation against a modelled provider (sliding-window limit,"
            " exact Retry-After), not the live mesh; services/scheduler/sim/deepsearch.py"
        ),
        "seed": base.seed,
        "workload": workload_params(base),
        "policies": list(POLICIES),
        "batches": list(batches),
        "provider_bound": provider_bound(base),
        "definitions": DEFINITIONS,
        "headline_batch": headline,
        "headline": results[str(headline)]["policies"],
        "results": results,
        "retry_budget": {str(n): run(replace(at_headline, max_retries=n)) for n in RETRY_BUDGETS},
    }


PANELS = (
    ("calls_429", "429 responses"),
    ("avg_act_s", "avg ACT of successful calls (s)"),
    ("failed_trajectories", "failed trajectories"),
    ("goodput", "goodput (calls/s of completed trajectories)"),
)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = doc["batches"]
    fig, axes = plt.subplots(2, 2, figsize=(8, 5.6))
    for ax, (key, label) in zip(axes.flat, PANELS, strict=True):
        for policy in doc["policies"]:
            ys = [doc["results"][str(b)]["policies"][policy][key] for b in batches]
            ax.plot(batches, ys, marker="o", label=policy)
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("batch (concurrent trajectories)", fontsize=8)
    axes[1][1].axhline(doc["provider_bound"], color="grey", ls="--", lw=1, label="provider bound")
    axes[0][0].legend(fontsize=8)
    axes[1][1].legend(fontsize=7)
    rates = ", ".join(f"{api} {n}/s" for api, n in doc["workload"]["rates_per_s"].items())
    fig.suptitle(f"DeepSearch simulation: {rates}; seed {doc['seed']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    out: Path = OUT, base: Workload | None = None, batches: tuple[int, ...] = BATCHES
) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    doc = sweep(base or Workload(), batches)
    (out / "deepsearch.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out / "deepsearch.png")
    return doc


def table(doc: dict[str, Any]) -> str:
    """One line per batch and policy, for the terminal."""
    cols = ("calls_429", "avg_act_s", "failed_trajectories", "completed_trajectories", "goodput")
    lines = ["batch  policy       " + "  ".join(cols)]
    for batch, res in doc["results"].items():
        for policy, row in res["policies"].items():
            cells = "  ".join(f"{row[c]!s:>{len(c)}}" for c in cols)
            lines.append(f"{batch:>5}  {policy:<11}  {cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(main()))
