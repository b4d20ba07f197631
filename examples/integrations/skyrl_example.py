"""SkyRL: an episode of TangramTextEnv, registered with SkyRL-Gym as SkyRL would make it;
a scripted policy stands in for the model.

    tangram up &    # then:
    python examples/integrations/skyrl_example.py
"""

from __future__ import annotations

import asyncio

import skyrl_gym
from common import register_reward

skyrl_gym.register(id="tangram", entry_point="tangram.integrations.skyrl:TangramTextEnv")

ACTIONS = [
    "Let me write it. <bash>printf 'def add(a, b):\\n    return a + b\\n' > add.py</bash>",
    "Check it. <bash>python3 -c 'from add import add; print(add(2, 3))'</bash>",
    "add.py is done.",
]


def episode() -> None:
    env = skyrl_gym.make(
        "tangram",
        env_config={"job_id": "skyrl-example", "max_turns": 4},
        extras={"test_command": "python3 -c 'from add import add; assert add(2, 3) == 5'"},
    )
    env.init([{"role": "user", "content": "write add(a, b) in add.py"}])
    try:
        for action in ACTIONS:
            out = env.step(action)  # synchronous, as SkyRL calls it
            print(f"> {action}\n{out['observations']} reward={out['reward']} done={out['done']}")
            if out["done"]:
                break
    finally:
        env.close()
    print("metrics:", env.get_metrics())


if __name__ == "__main__":
    asyncio.run(register_reward())
    episode()
