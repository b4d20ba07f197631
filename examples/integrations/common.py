"""What every example needs first: the example reward service registered on the mesh that
`tangram up` runs (registering again is harmless)."""

from __future__ import annotations

from tangram import Client, ServiceSpec

REWARD = ServiceSpec("reward", "tangram.integrations.examples:reward_model", dops=(1,))


async def register_reward() -> None:
    async with Client.connect() as client:
        state = await client.register_service(REWARD)
        if state.error:
            raise SystemExit(f"the reward service did not start: {state.error}")
