"""OpenRLHF: ``--remote_rm_url http://HOST:8470/get_reward`` answered by the reward front;
this posts what OpenRLHF's SingleTurnAgentExecutor posts.

    tangram up &    # then:
    python examples/integrations/openrlhf_example.py
"""

from __future__ import annotations

import asyncio

import aiohttp
from common import register_reward

from tangram.integrations.clients import reward_front_url


async def main() -> None:
    await register_reward()
    url = f"{reward_front_url()}/get_reward"
    prompts = ["Q: what is 6*12? A:", "Q: what is 6*12? A:"]
    payload = {
        "query": [prompts[0] + " 72", prompts[1] + " 70"],  # prompt + response, decoded
        "prompts": prompts,
        "labels": ["72", "72"],
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=payload) as resp:
            resp.raise_for_status()
            print(f"POST {url}:", await resp.json())
        async with http.post(url, json={"prompts": prompts}) as resp:  # a bad request
            print("bad request:", resp.status, await resp.json())


if __name__ == "__main__":
    asyncio.run(main())
