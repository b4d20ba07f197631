"""SkyRL adapter against SkyRL-Gym's own ``BaseTextEnv`` (skyrl-gym 0.4.0) on a running
mesh: ``step`` (synchronous, as SkyRL calls it from its own threads) runs the model's
command in the episode's environment; the last step is scored by a test command's exit code
or by the pooled reward service; ``close`` removes the environment."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip(
    "skyrl_gym", reason="needs tests/integrations/frameworks.txt (make setup installs it)"
)

import skyrl_gym
from skyrl_gym.envs.base_text_env import BaseTextEnv

from tangram.integrations.skyrl import TangramTextEnv, command_in
from tangram.launcher import Mesh

pytestmark = pytest.mark.slow


def test_the_command_is_the_last_tagged_block():
    assert command_in("think <bash>ls</bash> then <bash> cat x </bash>", "bash") == "cat x"
    assert command_in("no command here", "bash") is None


def _episode(uid: str) -> list[dict]:
    env = TangramTextEnv(
        {"job_id": uid, "max_turns": 3, "test_command": "grep -q 42 answer.txt"},
        {"reward_spec": {"ground_truth": "42"}},
    )
    assert isinstance(env, BaseTextEnv)
    prompt = [{"role": "user", "content": "write the answer to answer.txt"}]
    assert env.init(prompt) == (prompt, {})
    try:
        steps = [
            env.step("<bash>echo 41 > answer.txt && echo done</bash>"),
            env.step("<bash>echo 42 > answer.txt</bash>"),
            env.step("The answer is in answer.txt."),
        ]
    finally:
        env.close()
    assert env.get_metrics() == {"tangram_calls": 3, "tangram_infrastructure_failures": 0.0}
    return steps


async def test_an_episode_runs_in_its_own_environment(reward_mesh: Mesh, uid: str):
    first, second, last = await asyncio.to_thread(_episode, uid)
    assert first["observations"] == [{"role": "user", "content": "done\n[exit code 0]"}]
    assert (first["reward"], first["done"], second["done"]) == (0.0, False, False)
    assert first["metadata"]["exit_code"] == 0.0
    assert (last["observations"], last["reward"], last["done"]) == ([], 1.0, True)


async def test_the_final_answer_is_scored_by_the_reward_service(reward_mesh: Mesh, uid: str):
    skyrl_gym.register(id=f"tangram-{uid}", entry_point="tangram.integrations.skyrl:TangramTextEnv")
    env = skyrl_gym.make(
        f"tangram-{uid}",
        env_config={"job_id": uid, "reward_service": "reward"},
        extras={"reward_spec": {"ground_truth": "72"}, "max_turns": 2},
    )
    out = await asyncio.to_thread(env.step, "The answer is 72.")
    await asyncio.to_thread(env.close)
    assert out["done"]
    assert out["reward"] > 0.8
