"""What ``bench.chaos`` makes of a run: every acknowledged action accounted for (one terminal
state, recorded as delivered, run at most once), outcomes by the fault window each ended in,
and the summary against the targets."""

from __future__ import annotations

import asyncio
import bisect
import collections
import math
import time
from pathlib import Path
from typing import Any

from bench.chaos_rig import CountingServer, Load, Watch

TARGETS = {"detection_p99_s": 5.0, "serving_again_max_s": 10.0}


def ended_in(faults: list[dict[str, Any]], t: float | None) -> str:
    """The fault in whose window (from its injection to the next one's) ``t`` falls."""
    if t is None:
        return "never"
    starts = [f["injected_at"] for f in faults]
    i = bisect.bisect_right(starts, t)
    return faults[i - 1]["fault"] if i else "warm-up"


async def account(
    w: Watch, load: Load, marks: Path, server: CountingServer, faults: list[dict[str, Any]]
) -> dict[str, Any]:
    """Every acknowledged action: one terminal state, delivered == recorded, runs counted;
    outcomes by the fault window the action ended in."""
    if load.tasks:
        await asyncio.wait(list(load.tasks), timeout=300)
    ids = list(load.sent)
    recorded = await w.db("SELECT action_id, status FROM actions WHERE action_id = ANY($1)", ids)
    status = {r["action_id"]: r["status"] for r in recorded or []}
    status |= await _caught_up(w, load, status)
    # read once the records caught up: a record committed late brings its event with it
    events = await w.db(
        "SELECT action_id, count(*) AS n FROM action_events WHERE action_id = ANY($1)"
        " AND status IN ('succeeded', 'failed', 'cancelled') GROUP BY action_id",
        ids,
    )
    terminal = {r["action_id"]: r["n"] for r in events or []}
    bad: dict[str, list[str]] = collections.defaultdict(list)
    kinds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    ran_lost = 0
    for aid, s in load.sent.items():
        runs = _runs(marks / aid) if s.kind == "exec" else server.calls[aid]
        r = s.result
        kinds[ended_in(faults, s.done_at)][
            r.error.kind if r is not None and r.error else (r.status if r else "none")
        ] += 1
        if r is None:
            bad["no_result"].append(f"{aid}:{s.waiting_failed}")
            continue
        if terminal.get(aid) != 1:
            bad["terminal_events_not_1"].append(f"{aid}:{terminal.get(aid)}")
        if status.get(aid) != r.status:
            bad["recorded_not_delivered"].append(f"{aid}:{status.get(aid)}/{r.status}")
        if runs > 1:
            bad["ran_more_than_once"].append(f"{aid}:{runs}")
        if r.ok and runs == 0:
            bad["succeeded_without_running"].append(aid)
        ran_lost += int(s.lost and runs == 1)
    return {
        "acknowledged": len(ids),
        "not_acknowledged": dict(load.unacked),
        "outcomes_by_window_ended_in": {p: dict(c) for p, c in kinds.items()},
        "lost_but_ran_once": ran_lost,  # node_died / environment_lost after it had started
        "violations": {k: len(v) for k, v in bad.items()},
        "violation_examples": {k: v[:10] for k, v in bad.items()},
    }


async def _caught_up(w: Watch, load: Load, status: dict[str, str]) -> dict[str, str]:
    """The records of the actions whose result arrived before their terminal record committed
    (a result is pushed as its record is queued, not once it is durable: the agent's ack waits
    for the commit, so a scheduler lost meanwhile has the agent resend it), re-read until they
    match or 10 s have passed."""
    behind: dict[str, str] = {}
    deadline = time.time() + 10
    while time.time() < deadline:
        behind = {
            aid: status.get(aid, "")
            for aid, s in load.sent.items()
            if s.result is not None and status.get(aid) != s.result.status
        }
        if not behind:
            break
        await asyncio.sleep(0.2)
        rows = await w.db(
            "SELECT action_id, status FROM actions WHERE action_id = ANY($1)", list(behind)
        )
        status = status | {r["action_id"]: r["status"] for r in rows or []}
    return status


def _runs(path: Path) -> int:
    try:
        return len(path.read_text().split())
    except FileNotFoundError:
        return 0


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]


def summary(faults: list[dict[str, Any]], acc: dict[str, Any]) -> dict[str, Any]:
    detect = [f["detected_s"] for f in faults if f["detected_s"] is not None]
    serve = [f["serving_again_s"] for f in faults if f["serving_again_s"] is not None]
    missing = [
        f["fault"] for f in faults if f["detected_s"] is None or f["serving_again_s"] is None
    ]
    out = {
        "detection_p99_s": p99(detect),
        "detection_max_s": max(detect, default=None),
        "serving_again_max_s": max(serve, default=None),
        "faults_without_a_figure": missing,
        "by_fault": {
            name: {
                "detected_s": [f["detected_s"] for f in faults if f["fault"] == name],
                "serving_again_s": [f["serving_again_s"] for f in faults if f["fault"] == name],
            }
            for name in dict.fromkeys(f["fault"] for f in faults)
        },
        "violations": sum(acc["violations"].values()),
        "targets": TARGETS,
    }
    out["targets_met"] = (
        not missing
        and out["violations"] == 0
        and (out["detection_p99_s"] or 0) <= TARGETS["detection_p99_s"]
        and (out["serving_again_max_s"] or 0) <= TARGETS["serving_again_max_s"]
    )
    return out
