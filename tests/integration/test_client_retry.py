"""The client's retry budget against a real nats-server: a request whose reply was lost (as in
a broker restart) is made again instead of being awaited for the whole budget, and a client
that gives up says how long it tried."""

from __future__ import annotations

import time

import pytest

from tangram.bus import Bus
from tangram.client import ATTEMPT_FIRST_S, Client
from tangram.contract import Accepted, ActionSpec, ExecAction, GatewayRequest
from tangram.errors import Unavailable

from ..support import FakeGateway


class LossyGateway(FakeGateway):
    """Answers submits on the gateway subject, but drops the first ``drop`` requests."""

    def __init__(self, bus: Bus, drop: int) -> None:
        super().__init__(bus)
        self.drop = drop

    async def reply(self, req: GatewayRequest) -> Accepted | None:
        return Accepted(action_id="a") if len(self.seen) > self.drop else None


def spec() -> ActionSpec:
    return ActionSpec(
        action_id="a", job_id="j", trajectory_id="t", action=ExecAction(command="true")
    )


async def test_a_lost_reply_is_retried_within_the_budget(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "lossy-gateway")
    try:
        gateway = LossyGateway(bus, drop=1)
        await gateway.start()
        async with Client.connect(nats_url) as client:
            t0 = time.monotonic()
            ack = await client.submit(spec())
            took = time.monotonic() - t0
    finally:
        await bus.close()
    assert ack.action_id == "a"
    assert len(gateway.seen) == 2  # the same idempotent submit, made again
    assert ATTEMPT_FIRST_S <= took < ATTEMPT_FIRST_S + 2.0


async def test_giving_up_says_how_long_the_client_tried(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, "silent-gateway")
    try:
        gateway = LossyGateway(bus, drop=10**9)
        await gateway.start()
        async with Client.connect(nats_url, request_timeout=3.0) as client:
            with pytest.raises(Unavailable, match=r"gave up after 2 tries over 3\.\ds"):
                await client.submit(spec())
    finally:
        await bus.close()
