"""The reward vocabulary every adapter shares: what a reward service is sent, what it may
answer, and one call of it through the mesh.

A reward service is an ordinary model service (``tangram services register``) whose handle
takes :class:`RewardQuery` payloads (as dicts) and answers, for each, a number or a dict with
a numeric ``"score"`` and other numeric details (logged by frameworks that log them)."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from tangram.client import Client, SyncClient
from tangram.contract import ActionResult
from tangram.errors import TangramError
from tangram.integrations.config import RewardConfig

Prompt = str | list[dict[str, Any]]  # plain text, or chat messages


class RewardQuery(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One response to score; ``label`` is the ground truth, ``source`` its data set."""

    response: str
    prompt: Prompt = ""
    label: Any = None
    source: str = ""
    extra: dict[str, Any] = {}


class Reward(msgspec.Struct, frozen=True):
    score: float
    details: dict[str, float] = {}

    def as_verl(self) -> float | dict[str, float]:
        """verl's ``compute_score`` answer: the score, or a dict with it and the details."""
        return {"score": self.score, **self.details} if self.details else self.score


class BadReward(TangramError):
    """A reward service answered something that is not a reward (a bug in its handle)."""

    code = "bad_reward"


class RewardFailed(TangramError):
    """The reward action did not succeed; ``result`` says why (an infrastructure failure is
    retryable, a handler's exception is not)."""

    def __init__(self, result: ActionResult) -> None:
        kind = result.error.kind if result.error else result.status
        message = result.error.message if result.error else ""
        super().__init__(f"reward action {result.action_id} {kind}: {message or result.stderr}")
        self.result = result
        self.code = str(kind)
        self.retryable = result.infrastructure_failure


def reward_of(output: Any) -> Reward:
    """A service's output as a :class:`Reward` (a number, or ``{"score": x, ...}``)."""
    match output:
        case bool() | int() | float():
            return Reward(_finite(output, "the output"))
        case {"score": score, **rest}:
            details = {str(k): _finite(v, f"detail {k!r}") for k, v in rest.items()}
            return Reward(_finite(score, "score"), details)
    raise BadReward(f"a reward is a number or a dict with a 'score', not {output!r:.200}")


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool | int | float) and math.isfinite(value):
        return float(value)
    raise BadReward(f"{what} of a reward must be a finite number, not {value!r:.100}")


async def score(client: Client, query: RewardQuery, cfg: RewardConfig) -> Reward:
    """Score one response with ``cfg.service``: one ``infer`` action on the pooled GPUs."""
    payload = msgspec.to_builtins(query)
    return concluded(
        await client.infer(cfg.service, payload, job_id=cfg.job_id, timeout_s=cfg.timeout_s)
    )


def score_sync(client: SyncClient, query: RewardQuery, cfg: RewardConfig) -> Reward:
    """:func:`score` for code that is not async."""
    payload = msgspec.to_builtins(query)
    return concluded(client.infer(cfg.service, payload, job_id=cfg.job_id, timeout_s=cfg.timeout_s))


def concluded(result: ActionResult) -> Reward:
    """The reward a reward action gave, or :class:`RewardFailed` saying why there is none."""
    if not result.ok:
        raise RewardFailed(result)
    return reward_of(result.output)
