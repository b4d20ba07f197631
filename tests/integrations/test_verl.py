"""verl adapters against verl's own ``BaseTool`` (verl 0.9.1, installed without its GPU
stack) on a running mesh: tool calls of one request share its environment, as verl's agent
loop makes them (create, execute, release per call); the SGLang rollout's one instance per
trajectory closes its environment on release; ``compute_score`` (sync and async) scores
through the pooled reward service."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip(
    "verl.tools.base_tool",
    reason="needs tests/integrations/frameworks.txt (make setup installs it)",
)

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from tangram.integrations import clients
from tangram.integrations.verl import TangramTool, compute_score, compute_score_async
from tangram.launcher import Mesh

pytestmark = pytest.mark.slow


async def _call(tool: TangramTool, request_id: str, command: object) -> tuple[ToolResponse, dict]:
    """One call as verl's ToolAgentLoop._call_tool makes it."""
    instance_id, _ = await tool.create(create_kwargs={})
    try:
        response, reward, metrics = await tool.execute(
            instance_id, {"command": command}, agent_data=SimpleNamespace(request_id=request_id)
        )
    finally:
        await tool.release(instance_id)
    assert reward == 0.0
    return response, metrics


async def test_calls_of_one_request_share_its_environment(reward_mesh: Mesh, uid: str):
    tool = TangramTool({"type": "native", "job_id": uid, "cpus": [1, 2]}, None)
    assert isinstance(tool, BaseTool)
    assert tool.get_openai_tool_schema().function.name == "bash"
    written, _ = await _call(tool, f"{uid}-a", "echo kept > notes.txt && echo wrote")
    assert written.text == "wrote\n[exit code 0]"
    (read, metrics), (other, _) = await asyncio.gather(
        _call(tool, f"{uid}-a", "cat notes.txt"), _call(tool, f"{uid}-b", "cat notes.txt")
    )
    assert read.text == "kept\n[exit code 0]"
    assert metrics["exit_code"] == 0.0
    assert metrics["infrastructure_failure"] == 0.0
    assert "[exit code 1]" in other.text  # another request, another environment
    bad, bad_metrics = await _call(tool, f"{uid}-a", 42)
    assert "needs a non-empty string 'command'" in bad.text
    assert bad_metrics == {"invalid_call": 1.0}
    await tool.close_trajectory(f"{uid}-a")


async def test_one_instance_per_trajectory_closes_it_on_release(
    reward_mesh: Mesh, uid: str, monkeypatch: pytest.MonkeyPatch
):
    tool = TangramTool({"job_id": uid}, None)
    instance_id, _ = await tool.create(f"{uid}-t")
    first, _, _ = await tool.execute(instance_id, {"command": "echo 1 > f"})
    again, _, _ = await tool.execute(instance_id, {"command": "cat f"})
    assert (first.text, again.text) == ("[exit code 0]", "1\n[exit code 0]")
    client = await clients.shared_client()
    closed: list[str] = []
    real = client.close_env

    async def close_env(trajectory_id: str) -> None:
        closed.append(trajectory_id)
        await real(trajectory_id)

    monkeypatch.setattr(client, "close_env", close_env)
    await tool.release(instance_id)
    assert closed == [f"{uid}-t"]


async def test_compute_score_calls_the_pooled_reward_service(reward_mesh: Mesh):
    right = await compute_score_async("gsm8k", "so the answer is 72", "72", {"split": "train"})
    wrong = await asyncio.to_thread(compute_score, "gsm8k", "so it is 70", "72", None)
    assert isinstance(right, dict)
    assert right["score"] > 0.8
    assert right["match"] == 1.0
    assert isinstance(wrong, dict)
    assert wrong["score"] < 0.2
    named = await compute_score_async("gsm8k", "72", "72", service="reward")
    assert isinstance(named, dict)
    assert named["score"] > 0.8
