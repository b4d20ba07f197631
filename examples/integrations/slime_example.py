"""slime: the custom reward function (``--custom-rm-path tangram.integrations.slime.rm``) and
the ``--rm-url`` endpoint of the reward front, called as slime calls them.

    tangram up &    # then:
    python examples/integrations/slime_example.py
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import aiohttp
from common import register_reward

from tangram.integrations.clients import reward_front_url
from tangram.integrations.slime import rm


async def main() -> None:
    await register_reward()
    args = SimpleNamespace(custom_rm_path="tangram.integrations.slime.rm")
    sample = SimpleNamespace(prompt="2+2?", response="It is 4.", label="4", metadata={})
    print("rm(args, sample):", await rm(args, sample))
    print("group:", await rm(args, [sample, SimpleNamespace(**{**vars(sample), "label": "5"})]))
    # --rm-type remote_rm --rm-url <url>/rm: slime's remote_rm posts exactly this
    payload = {"prompt": sample.prompt, "response": sample.response, "label": sample.label}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{reward_front_url()}/rm", json=payload) as resp:
            resp.raise_for_status()
            print(f"POST {reward_front_url()}/rm:", await resp.json())


if __name__ == "__main__":
    asyncio.run(main())
