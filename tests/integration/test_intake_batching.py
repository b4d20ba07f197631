"""The client's submits leave in batches (one in flight per client): each item of a batch is
answered alone, a refused item is retried (busy) or raised (invalid) for its caller only, and
through a real mesh every action of a burst is accepted and run exactly once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tangram import subjects
from tangram.bus import Bus
from tangram.client import Client
from tangram.contract import (
    Accepted,
    ActionSpec,
    ErrorReply,
    ExecAction,
    GatewayRequest,
    Submit,
    SubmitMany,
    Submitted,
)
from tangram.errors import Busy, InvalidRequest
from tangram.launcher import Mesh

from ..support import FakeGateway, burst, running_mesh, spying


def spec(aid: str, command: str = "true") -> ActionSpec:
    return ActionSpec(
        action_id=aid, job_id="j", trajectory_id=aid, action=ExecAction(command=command)
    )


class ItemGateway(FakeGateway):
    """Answers a batch item by item: ``bad`` refused for good, ``late`` busy once."""

    async def reply(self, req: GatewayRequest) -> Submitted | Accepted | ErrorReply:
        items = req.items if isinstance(req, SubmitMany) else (req,)
        answers = [self.answer(one) for one in items if isinstance(one, Submit)]
        return Submitted(items=tuple(answers)) if isinstance(req, SubmitMany) else answers[0]

    def answer(self, req: Submit) -> Accepted | ErrorReply:
        aid = req.spec.action_id
        if aid == "bad":
            return InvalidRequest("bad is refused").to_reply()
        if aid == "late" and sum(1 for r in self.seen if _has(r, "late")) == 1:
            return Busy("busy for the test", retry_after_s=0.2).to_reply()
        return Accepted(action_id=aid)


def _has(req: GatewayRequest, aid: str) -> bool:
    items = req.items if isinstance(req, SubmitMany) else (req,)
    return any(isinstance(i, Submit) and i.spec.action_id == aid for i in items)


async def test_each_item_of_a_batch_is_answered_alone(raw_bus: Bus, nats_url: str):
    gateway = ItemGateway(raw_bus)
    await gateway.start()
    async with Client.connect(nats_url) as client:
        good, bad, late = await asyncio.gather(
            client.submit(spec("good")),
            client.submit(spec("bad")),
            client.submit(spec("late")),
            return_exceptions=True,
        )
    assert isinstance(good, Accepted)
    assert good.action_id == "good"
    assert isinstance(bad, InvalidRequest)  # refused for good: raised to its caller only
    assert "bad is refused" in bad.message
    assert isinstance(late, Accepted)  # busy once, then retried alone
    first = gateway.seen[0]
    assert isinstance(first, SubmitMany)  # the three left together
    assert [i.spec.action_id for i in first.items] == ["good", "bad", "late"]
    assert isinstance(gateway.seen[-1], Submit)


@pytest.fixture(scope="module")
async def mesh_(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Mesh]:
    root: Path = tmp_path_factory.mktemp("intake")
    async with running_mesh(root) as m:
        yield m


async def test_a_burst_from_one_client_leaves_in_batches_and_runs_once(mesh_: Mesh, tmp_path):
    async with spying(mesh_.nats_url, subjects.GATEWAY.subject, GatewayRequest) as seen:
        results = await burst(mesh_.nats_url, tmp_path / "ran", 60, 8)
    batches = [r for r in seen if isinstance(r, SubmitMany)]
    assert batches, "no submits left together"
    submitted = [i.spec.action_id for r in batches for i in r.items]
    submitted += [r.spec.action_id for r in seen if isinstance(r, Submit)]
    assert sorted(submitted) == sorted(r.action_id for r in results)  # each sent once


async def test_large_results_of_one_pass_are_pushed_in_messages_that_fit(mesh_: Mesh):
    # Six results of ~200 KB each end together: one list would exceed NATS' 1 MiB payload,
    # and a refused push would leave the client to poll (30 s); they arrive at once instead.
    async with Client.connect(mesh_.nats_url) as client:
        results = await asyncio.gather(
            *(
                client.exec(
                    "head -c 200000 /dev/zero | tr '\\0' x",
                    trajectory_id=f"big{k}",
                    job_id="big",
                    output_cap_bytes=256 * 1024,
                    wait_s=20,
                )
                for k in range(6)
            )
        )
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    assert all(r.stdout == "x" * 200_000 for r in results)
