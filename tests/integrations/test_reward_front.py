"""The reward front over real HTTP against a running mesh: slime's ``--rm-url`` and
OpenRLHF's ``--remote_rm_url`` payloads scored by the example reward service on the
gpu_manager; bad requests answered 400/404 with what is wrong while it serves on. And
slime's custom reward function ``rm(args, sample)``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import aiohttp

from tangram.integrations import slime
from tangram.launcher import Mesh

from ..support import eventually


async def _post(url: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else None
    async with aiohttp.ClientSession() as http:
        kw: dict[str, Any] = {"data": data} if data is not None else {"json": body}
        async with http.post(url, **kw) as resp:
            return resp.status, await resp.json()


async def _front(mesh: Mesh) -> str:
    async def up() -> bool:
        try:
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{mesh.reward_front_url}/healthz") as resp:
                    return resp.status == 200
        except aiohttp.ClientError:
            return False

    await eventually(up, what="the reward front to answer", timeout_s=20)
    return mesh.reward_front_url


async def test_slime_and_openrlhf_payloads_are_scored(reward_mesh: Mesh):
    url = await _front(reward_mesh)
    right = {"prompt": "2+2?", "response": "The answer is 4", "label": "4"}
    wrong = {**right, "label": "5"}
    (s1, good), (s2, bad) = await asyncio.gather(
        _post(f"{url}/rm", right), _post(f"{url}/rm", wrong)
    )
    assert (s1, s2) == (200, 200)
    assert isinstance(good, float)
    assert good > 0.8
    assert bad < 0.2
    body = {"query": ["2+2? 4", "2+2? 5"], "prompts": ["2+2?", "2+2?"], "labels": ["4", "4"]}
    status, out = await _post(f"{url}/get_reward", body)
    assert status == 200, out
    assert out["rewards"] == out["scores"]
    assert out["rewards"][0] > 0.8 > 0.2 > out["rewards"][1]
    assert out["extra_logs"]["match"] == [1.0, 0.0]
    status, named = await _post(f"{url}/services/reward/get_reward", body)
    assert (status, named["rewards"]) == (200, out["rewards"])


async def test_bad_requests_are_refused_with_a_reason_and_the_front_serves_on(reward_mesh: Mesh):
    url = await _front(reward_mesh)
    cases = [
        (f"{url}/rm", b"{oops", 400, "not JSON"),
        (f"{url}/rm", {"prompt": "p"}, 400, "missing required field `response`"),
        (f"{url}/get_reward", {"query": ["a", "b"], "labels": [1]}, 400, "one per query"),
        (f"{url}/get_reward", {"query": "not a list"}, 400, "Expected `array`"),
        (f"{url}/services/nope/rm", {"response": "x"}, 404, "unknown service 'nope'"),
    ]
    for target, body, status, says in cases:
        got, out = await _post(target, body)
        assert got == status, (target, body, out)
        assert says in out["error"], out
    got, out = await _post(f"{url}/rm", {"response": "4", "label": "4"})
    assert got == 200
    assert out > 0.8


async def test_slime_custom_reward_function(reward_mesh: Mesh):
    args = SimpleNamespace(custom_rm_path="tangram.integrations.slime.rm")
    sample = SimpleNamespace(prompt="2+2?", response="it is 4", label="4", metadata={"k": 1})
    assert await slime.rm(args, sample) > 0.8
    group = [sample, SimpleNamespace(prompt="", response="it is 5", label="4", metadata=None)]
    scores = await slime.rm(args, group)
    assert isinstance(scores, list)
    assert scores[0] > 0.8 > 0.2 > scores[1]
