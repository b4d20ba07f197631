"""bench.deepsearch: the result document has the promised shape, Tangram's quotas hold every
provider's limit and lose no trajectory, and goodput never rewards failing early."""

from __future__ import annotations

import json
from pathlib import Path

from bench.deepsearch import DEFINITIONS, main, sweep
from services.scheduler.sim.deepsearch import POLICIES, Workload

ROW = {
    "calls_429",
    "avg_act_s",
    "failed_trajectories",
    "completed_trajectories",
    "useful_calls",
    "goodput",
    "goodput_own_makespan",
    "makespan_s",
}


def test_sweep_shape_and_truths() -> None:
    doc = json.loads(json.dumps(sweep(Workload(seed=5), batches=(20, 60))))
    assert ROW <= set(DEFINITIONS) == set(doc["definitions"])
    assert doc["seed"] == 5
    assert doc["workload"]["rates_per_s"] == {"search": 10, "fetch": 20, "llm": 5}
    assert doc["headline_batch"] == 60
    assert doc["headline"] == doc["results"]["60"]["policies"]
    for batch, res in doc["results"].items():
        rows = res["policies"]
        assert set(rows) == set(POLICIES)
        for row in rows.values():
            assert set(row) == ROW
            assert row["completed_trajectories"] + row["failed_trajectories"] == int(batch)
            horizon = max(row["makespan_s"], res["floor_s"])
            assert abs(row["goodput"] - row["useful_calls"] / horizon) < 0.01
            assert row["goodput"] <= row["goodput_own_makespan"]
        tangram = rows["tangram"]
        assert tangram["calls_429"] == 0
        assert tangram["failed_trajectories"] == 0
        assert tangram["completed_trajectories"] == int(batch)
        assert tangram["makespan_s"] >= res["floor_s"], "the floor is a lower bound"
    baselines = [doc["results"]["60"]["policies"][p] for p in ("per_process", "retry")]
    assert all(b["calls_429"] > 0 for b in baselines)
    assert all(b["goodput"] < doc["headline"]["tangram"]["goodput"] for b in baselines)
    assert set(doc["retry_budget"]) == {"3", "6", "10"}


def test_main_writes_json_and_png(tmp_path: Path) -> None:
    doc = main(tmp_path, Workload(seed=1), batches=(10, 20))
    assert json.loads((tmp_path / "deepsearch.json").read_text()) == doc
    assert (tmp_path / "deepsearch.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
