"""verl: tool calls as actions in each request's environment, and a reward from the pooled
reward service, made the way verl's agent loop and reward loop make them.

    tangram up &    # then:
    python examples/integrations/verl_example.py
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from common import register_reward

from tangram.integrations.verl import TangramTool, compute_score_async


async def tool_call(tool: TangramTool, request_id: str, command: str) -> str:
    """What verl's ToolAgentLoop does for one tool call."""
    instance_id, _ = await tool.create(create_kwargs={})
    try:
        agent_data = SimpleNamespace(request_id=request_id)
        response, _, metrics = await tool.execute(
            instance_id, {"command": command}, agent_data=agent_data
        )
    finally:
        await tool.release(instance_id)
    print(f"[{request_id}] $ {command}\n{response.text}\n  {metrics}")
    return str(response.text)


async def main() -> None:
    await register_reward()
    tool = TangramTool({"type": "native", "job_id": "verl-example", "cpus": [1, 2]}, None)
    await tool_call(tool, "req-1", "echo 'def f(): return 72' > sol.py")
    await tool_call(tool, "req-1", "python3 -c 'from sol import f; print(f())'")
    await tool_call(tool, "req-2", "ls sol.py")  # another request, another environment
    for request_id in ("req-1", "req-2"):
        await tool.close_trajectory(request_id)
    score = await compute_score_async("gsm8k", "so the answer is 72", "72", {"split": "test"})
    print("compute_score:", score)


if __name__ == "__main__":
    asyncio.run(main())
