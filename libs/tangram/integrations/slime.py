"""slime adapter: :func:`rm`, a custom reward function (``--custom-rm-path
tangram.integrations.slime.rm``) scoring each sample with a pooled reward service.

It is ``async rm(args, sample)``; given a list of samples (slime's group reward mode) it
scores them concurrently and answers a list. The service comes from ``TANGRAM_REWARD_*``
(:mod:`tangram.integrations.config`); :func:`make_rm` builds one with other settings. slime
also reaches the mesh with no code at all: ``--rm-type remote_rm --rm-url
http://HOST:PORT/rm`` posts to ``services.reward_front``.

slime is not on the package registry this project installs from, so this is written
against slime's documented interface (``slime/rollout/rm_hub``): a sample has ``prompt``,
``response``, ``label`` and ``metadata``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from tangram.integrations import clients, config, rewards

__all__ = ["make_rm", "query_of", "rm"]

RewardFn = Callable[[Any, Any], Awaitable[float | list[float]]]


def query_of(sample: Any) -> rewards.RewardQuery:
    """A slime ``Sample`` as a reward query (its metadata travels as ``extra``)."""
    metadata = getattr(sample, "metadata", None)
    return rewards.RewardQuery(
        prompt=getattr(sample, "prompt", "") or "",
        response=sample.response,
        label=getattr(sample, "label", None),
        extra=metadata if isinstance(metadata, dict) else {},
    )


def make_rm(cfg: config.RewardConfig | None = None) -> RewardFn:
    """A slime reward function scoring with ``cfg`` (default: the ``TANGRAM_REWARD_*``)."""
    settings = cfg or config.load()

    async def rm(args: Any, sample: Any) -> float | list[float]:
        client = await clients.shared_client()
        if isinstance(sample, list):
            found = await asyncio.gather(
                *(rewards.score(client, query_of(s), settings) for s in sample)
            )
            return [r.score for r in found]
        return (await rewards.score(client, query_of(sample), settings)).score

    return rm


async def rm(args: Any, sample: Any) -> float | list[float]:
    """slime's custom reward function, with the ``TANGRAM_REWARD_*`` settings."""
    return await make_rm()(args, sample)
