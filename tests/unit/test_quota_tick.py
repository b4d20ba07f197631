"""The quota core's tick costs what is due: queue timeouts, lease expiries and kill deadlines
come from an index by due time, never from a scan of every action or lease it holds; and each
still ends exactly when it did."""

from __future__ import annotations

from typing import Any

from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.quota_books import QuotaConfig
from tangram.contract import ErrorKind, LeaseEnd, QuotaSpec

from .test_quota_core import agent, answer, core, http, lease, results, starts


class Scanned(dict[str, Any]):
    """A dict that counts the scans of its entries (lookups are free)."""

    scans = 0

    def __iter__(self) -> Any:
        Scanned.scans += 1
        return super().__iter__()

    def items(self) -> Any:
        Scanned.scans += 1
        return super().items()

    def values(self) -> Any:
        Scanned.scans += 1
        return super().values()

    def keys(self) -> Any:
        Scanned.scans += 1
        return super().keys()


def test_a_tick_scans_nothing_it_holds() -> None:
    c = QuotaCore(QuotaConfig(node_timeout_s=1000.0))  # the agent outlives the test
    c.set_quota(QuotaSpec("q", concurrency=1), 0.0)
    c.set_quota(QuotaSpec("l", concurrency=10_000), 0.0)
    c.node_report(agent(), 0.0)
    for i in range(2_000):
        c.enqueue(http(f"h{i}", "q", queue_timeout_s=5.0 if i == 1 else 3600.0), 0.0)
        c.enqueue(lease(f"l{i}", "l", ttl_s=5.0 if i == 1 else 3600.0), 0.0)
    c.schedule(0.0)
    assert (len(c.waiting), len(c.leases), len(c.calls)) == (1_999, 2_000, 1)
    c.waiting, c.leases, c.calls = Scanned(c.waiting), Scanned(c.leases), Scanned(c.calls)
    Scanned.scans = 0
    assert results(c.tick(1.0)) == []
    assert Scanned.scans == 0
    ended = results(c.tick(6.0))  # h1 waited more than 5 s; l1's TTL ran out
    assert [(r.action_id, r.error and r.error.kind) for r in ended] == [
        ("h1", ErrorKind.QUEUE_TIMEOUT)
    ]
    assert "l1" not in c.leases
    assert Scanned.scans == 0


def test_a_retried_call_still_times_out_in_the_queue() -> None:
    c = core(QuotaSpec("q", concurrency=1), QuotaConfig(node_timeout_s=1000.0))
    c.enqueue(http("b", queue_timeout_s=10.0), 0.0)
    (s,) = starts(c.schedule(0.0))
    assert results(c.tick(10.5)) == []  # in flight when its deadline passed
    retry_later = {"Retry-After": "100"}
    assert results(c.complete(answer(s, 429, headers=retry_later), 11.0)) == []  # queued again
    (r,) = results(c.tick(11.5))
    assert r.error is not None
    assert r.error.kind is ErrorKind.QUEUE_TIMEOUT


def test_an_unconfirmed_kill_ends_at_its_deadline() -> None:
    c = core(QuotaSpec("q", concurrency=1), QuotaConfig(kill_grace_s=5.0, node_timeout_s=100.0))
    c.enqueue(http("a"), 0.0)
    (s,) = starts(c.schedule(0.0))
    c.cancel("a", 1.0)
    assert results(c.tick(5.9)) == []
    (r,) = results(c.tick(6.0))
    assert r.status == "cancelled"
    assert "a" in c.killed
    assert c.complete(answer(s, failure=ErrorKind.CANCELLED), 6.5) == []
    assert c.quotas["q"].limiter.held == 0


def test_stale_deadlines_are_dropped() -> None:
    """Leases released long before their TTL leave no growing index behind."""
    c = core(QuotaSpec("q", concurrency=10))
    for i in range(5_000):
        c.enqueue(lease(f"l{i}", ttl_s=3600.0), float(i))
        c.schedule(float(i))
        c.lease_end(LeaseEnd(lease_id=f"l{i}"), float(i))
        c.tick(float(i))
    assert len(c._expiries) <= 2 * len(c.leases) + 1024
