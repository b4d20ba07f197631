"""The wire shapes of the reward endpoints, pure: a request body as reward queries, rewards
as a response body. Decoding validates everything, so the shell only sees good queries.

- slime (``--rm-type remote_rm --rm-url URL``): ``POST {prompt, response, label}``, the
  answer is the reward itself (a JSON number).
- OpenRLHF (``--remote_rm_url URL``): ``POST /get_reward {query, prompts, labels}``, the
  answer is ``{rewards, scores, extra_logs}``, one entry per query. ``query`` is the prompt
  and response as one text; the response is what follows the prompt when it starts with it.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import msgspec

from tangram.integrations.rewards import Prompt, Reward, RewardQuery

T = TypeVar("T")
MAX_ITEMS = 4096  # queries in one OpenRLHF request


class BadRequest(ValueError):
    """The request body is not what the endpoint takes; the message says what is wrong."""


class SlimeRequest(msgspec.Struct, kw_only=True):
    response: str
    prompt: Prompt = ""
    label: Any = None
    metadata: dict[str, Any] = {}


class OpenRLHFRequest(msgspec.Struct, kw_only=True):
    query: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_ITEMS)]
    prompts: list[Prompt] | None = None
    labels: list[Any] | None = None


def _decode(body: bytes, typ: type[T]) -> T:
    if not body:
        raise BadRequest("the request has no body: send a JSON object")
    try:
        return msgspec.json.decode(body, type=typ)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"bad request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None


def slime_query(body: bytes) -> RewardQuery:
    req = _decode(body, SlimeRequest)
    return RewardQuery(
        prompt=req.prompt, response=req.response, label=req.label, extra=req.metadata
    )


def openrlhf_queries(body: bytes) -> list[RewardQuery]:
    req = _decode(body, OpenRLHFRequest)
    n = len(req.query)
    prompts = _aligned(req.prompts, n, "prompts", "")
    labels = _aligned(req.labels, n, "labels", None)
    return [
        RewardQuery(prompt=p, response=_response(q, p), label=lab, extra={"query": q})
        for q, p, lab in zip(req.query, prompts, labels, strict=True)
    ]


def _aligned(values: list[Any] | None, n: int, name: str, default: Any) -> list[Any]:
    if values is None:
        return [default] * n
    if len(values) != n:
        raise BadRequest(f"{name} has {len(values)} entries; query has {n}: one per query")
    return values


def _response(query: str, prompt: Prompt) -> str:
    if isinstance(prompt, str) and prompt and query.startswith(prompt):
        return query[len(prompt) :]
    return query


def openrlhf_body(rewards: list[Reward]) -> dict[str, Any]:
    """``{rewards, scores, extra_logs}``; a detail every reward has is logged per query."""
    scores = [r.score for r in rewards]
    common = set.intersection(*(set(r.details) for r in rewards)) if rewards else set()
    logs = {k: [r.details[k] for r in rewards] for k in sorted(common)}
    return {"rewards": scores, "scores": scores, "extra_logs": logs}
