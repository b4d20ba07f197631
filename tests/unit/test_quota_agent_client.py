"""The user's side of quotas without a mesh: ``tangram quota`` arguments and table, and the
lease context manager's protocol (grant, report, release even on error, cancel if not granted)."""

from __future__ import annotations

import asyncio

import pytest

from tangram.cli import parser
from tangram.contract import (
    ActionError,
    ActionResult,
    ActionSpec,
    ErrorKind,
    LeaseAction,
    LeaseGrant,
    QuotaSpec,
    QuotaState,
    ReleaseLease,
)
from tangram.errors import InvalidRequest, RemoteError, Unavailable
from tangram.lease import Cleanups, Lease, SyncLease
from tangram.quota_cli import quota_table, spec_of


def test_quota_set_arguments_make_a_spec():
    args = parser().parse_args(
        [
            "quota",
            "set",
            "search",
            "--per-second",
            "5",
            "--concurrency",
            "2",
            "--host",
            "API.example.com",
            "--host",
            "127.0.0.1:9000",
            "--api-key-env",
            "SEARCH_KEY",
        ]
    )
    spec = spec_of(args)
    assert spec == QuotaSpec(
        "search",
        per_second=5.0,
        concurrency=2,
        hosts=("api.example.com", "127.0.0.1:9000"),
        api_key_env="SEARCH_KEY",
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["quota", "set", "search"],  # no limit
        ["quota", "set", "Bad Name", "--per-second", "1"],
        ["quota", "set", "s", "--per-second", "-1"],
        ["quota", "set", "s", "--per-second", "1", "--host", "evil.com/x"],
        ["quota", "set", "s", "--per-second", "1", "--api-key-env", "1X"],
    ],
)
def test_bad_quota_arguments_are_refused(argv: list[str]):
    with pytest.raises(InvalidRequest):
        spec_of(parser().parse_args(argv))


def test_quota_table_shows_the_learned_rate():
    states = [
        QuotaState(spec=QuotaSpec("b", per_second=10), learned_per_s=6.25, calls=9, throttled=2),
        QuotaState(spec=QuotaSpec("a", concurrency=4, hosts=("x.com",)), in_use=3, queued=7),
    ]
    lines = quota_table(states, now=100.0).splitlines()
    assert lines[0].split()[:3] == ["NAME", "LIMITS", "LEARNED/S"]
    assert lines[1].startswith("a ")
    assert "concurrency=4" in lines[1]
    assert "x.com" in lines[1]
    assert lines[2].startswith("b ")
    assert "6.25" in lines[2]
    assert "per_second=10" in lines[2]
    assert "no quotas" in quota_table([])


class FakeClient:
    """A LeaseClient that grants (or refuses) and records releases and cancels."""

    def __init__(self, result: ActionResult | Exception) -> None:
        self.outcome = result
        self.released: list[ReleaseLease] = []
        self.cancelled: list[str] = []
        self.cleanups = Cleanups()

    async def run(self, spec: ActionSpec, *, wait_s: float | None = None) -> ActionResult:
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome

    async def cancel(self, action_id: str) -> None:
        self.cancelled.append(action_id)

    async def release_lease(self, release: ReleaseLease) -> None:
        self.released.append(release)


SPEC = ActionSpec(action_id="l1", job_id="j", trajectory_id="", action=LeaseAction(quota="llm"))
GRANT = LeaseGrant(lease_id="L1", quota="llm", units=1, expires_at=1e10, tokens=100)
GRANTED = ActionResult(action_id="l1", status="succeeded", lease=GRANT)


async def test_lease_reports_on_release():
    client = FakeClient(GRANTED)
    async with Lease(client, SPEC, None) as lease:
        assert lease.lease_id == "L1"
        lease.report(tokens_used=80, status=429, retry_after_s=2.0)
    assert client.released == [
        ReleaseLease(lease_id="L1", tokens_used=80, status=429, retry_after_s=2.0)
    ]


async def test_an_exception_inside_still_releases():
    client = FakeClient(GRANTED)
    with pytest.raises(ZeroDivisionError):
        async with Lease(client, SPEC, None):
            1 / 0  # noqa: B018
    assert [r.lease_id for r in client.released] == ["L1"]


async def test_a_lease_not_granted_raises_and_holds_nothing():
    refused = ActionResult(
        action_id="l1",
        status="failed",
        error=ActionError(kind=ErrorKind.INVALID_REQUEST, message="unknown quota 'llm'"),
    )
    client = FakeClient(refused)
    with pytest.raises(InvalidRequest, match="unknown quota"):
        async with Lease(client, SPEC, None):
            pytest.fail("entered without a grant")
    timed_out = ActionResult(
        action_id="l1", status="failed", error=ActionError(kind=ErrorKind.QUEUE_TIMEOUT)
    )
    with pytest.raises(RemoteError):
        async with Lease(FakeClient(timed_out), SPEC, None):
            pass
    assert client.released == []


async def test_waiting_for_a_grant_cancelled_cancels_the_lease_action():
    client = FakeClient(GRANTED)
    gate = asyncio.Event()

    async def never(spec: ActionSpec, *, wait_s: float | None = None) -> ActionResult:
        await gate.wait()
        return GRANTED

    client.run = never  # type: ignore[method-assign]
    task = asyncio.create_task(Lease(client, SPEC, None).__aenter__())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert client.cancelled == ["l1"]


async def test_a_failed_release_does_not_hide_the_callers_error():
    client = FakeClient(GRANTED)

    async def down(release: ReleaseLease) -> None:
        raise Unavailable("gateway down")

    client.release_lease = down  # type: ignore[method-assign]
    with pytest.raises(KeyError):
        async with Lease(client, SPEC, None):
            raise KeyError("mine")


def test_sync_lease_runs_the_same_protocol():
    client = FakeClient(GRANTED)
    loop = asyncio.new_event_loop()
    try:
        with SyncLease(Lease(client, SPEC, None), loop.run_until_complete) as lease:
            lease.report(tokens_used=5)
    finally:
        loop.close()
    assert client.released == [ReleaseLease(lease_id="L1", tokens_used=5)]


async def test_a_task_cancelled_inside_and_again_on_its_way_out_still_releases():
    """The release is shielded: the caller's second cancel (a TaskGroup tearing down, a
    timeout firing during the exit) stops its wait, not the release."""
    client = FakeClient(GRANTED)
    slow, entered = asyncio.Event(), asyncio.Event()

    async def slow_release(release: ReleaseLease) -> None:
        entered.set()
        await slow.wait()  # the gateway is slow to answer (or being retried)
        client.released.append(release)

    client.release_lease = slow_release  # type: ignore[method-assign]

    async def hold() -> None:
        async with Lease(client, SPEC, None) as lease:
            lease.report(tokens_used=7)
            await asyncio.Event().wait()

    task = asyncio.create_task(hold())
    await asyncio.sleep(0)
    task.cancel()  # inside the block
    await entered.wait()
    task.cancel()  # again, while it releases
    with pytest.raises(asyncio.CancelledError):
        await task
    slow.set()
    await client.cleanups.wait(5.0)
    assert client.released == [ReleaseLease(lease_id="L1", tokens_used=7)]
