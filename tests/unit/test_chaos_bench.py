"""The chaos bench's bookkeeping (no mesh): the idle run's counts of health transitions, and
writing a run under a key of the existing results file without touching its other keys."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from bench.chaos import mesh_options, write
from bench.chaos_account import account
from bench.chaos_idle import idle_figures
from bench.chaos_rig import Sent, SupervisorLog
from tangram import ActionResult, ActionSpec, ExecAction


def event(node: str, change: str) -> dict[str, object]:
    return {"node": node, "change": change, "after_s": 1.0, "why": "test"}


def test_idle_figures_count_suspects_and_failures() -> None:
    args = argparse.Namespace(idle_every=60.0)
    events = [
        event("node0", "healthy->suspect"),
        event("node0", "suspect->healthy"),
        event("node1", "healthy->suspect"),
        event("node1", "suspect->fenced"),
        event("node1", "fenced->failed"),
        event("quota-vm", "healthy->suspect"),
    ]
    before = [{"node": "node0", "health": "healthy", "phase": "idle"}]
    cpu0 = {"cpu_manager.0": 1.0, "quota_manager": 1.0, "scheduler": 2.0}
    cpu1 = {"cpu_manager.0": 2.0, "quota_manager": 1.5, "scheduler": 8.0}
    out = idle_figures(
        args,
        mesh_options(Path(".")),
        600.0,
        before,
        [],
        events,
        ["ok"],
        SupervisorLog(),
        cpu0,
        cpu1,
    )
    assert out["suspect_transitions"] == 3
    assert out["declared_failed"] == 2  # fenced, then failed: both count
    assert out["agents"] == 2  # the agent processes
    assert out["agents_in_status"] == ["node0", "node1", "quota-vm"]
    assert out["mesh_cpu_s_per_min"] == {
        "cpu_manager.0": 0.1,
        "quota_manager": 0.05,
        "scheduler": 0.6,
    }


def test_a_run_written_under_a_key_keeps_the_other_keys(tmp_path: Path) -> None:
    out = tmp_path / "chaos.json"
    write(out, {"faults": [1], "summary": {"a": 1}})
    write(out, {"seconds": 600}, into="idle")
    write(out, {"seconds": 601}, into="idle")  # the same key again: replaced
    assert json.loads(out.read_text()) == {
        "faults": [1],
        "summary": {"a": 1},
        "idle": {"seconds": 601},
    }


async def test_an_action_whose_record_commits_late_is_counted_once_it_has(tmp_path: Path) -> None:
    """A result is pushed before its terminal record commits: the accounting waits for the
    record, and counts its terminal event as of then, not as of its first look."""

    class LateDb:
        """The record of ``x1`` commits once three queries have been asked."""

        asked = 0

        async def db(self, sql: str, ids: list[str]) -> list[dict[str, object]]:
            self.asked += 1
            done = self.asked >= 3
            if "action_events" in sql:
                return [{"action_id": "x1", "n": 1}] if done else []
            return [{"action_id": "x1", "status": "succeeded" if done else "running"}]

    spec = ActionSpec(
        action_id="x1", job_id="j", trajectory_id="t", action=ExecAction(command="true")
    )
    sent = Sent(spec, "exec", "warm-up", 0.0, ActionResult(action_id="x1", status="succeeded"))
    load = SimpleNamespace(tasks=set(), sent={"x1": sent}, unacked={})
    (tmp_path / "x1").write_text("1\n")
    acc = await account(LateDb(), load, tmp_path, SimpleNamespace(calls={}), [])
    assert acc["violations"] == {}, acc["violation_examples"]
