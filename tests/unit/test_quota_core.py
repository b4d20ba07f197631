"""The scheduler's quota core driven directly: grants, fairness, retries, leases, agents."""

from __future__ import annotations

import msgspec

from services.scheduler.core.effects import Effect, Finish, KillOnNode, StartOnNode
from services.scheduler.core.quota import QuotaCore
from services.scheduler.core.quota_books import QuotaConfig
from services.scheduler.policies.quota_fair import jain_index
from tangram.contract import (
    ActionResult,
    ActionSpec,
    Completion,
    Demand,
    ErrorKind,
    HttpAction,
    HttpResponse,
    Inventory,
    LeaseAction,
    LeaseEnd,
    LeaseGrant,
    NodeLeaving,
    NodeReport,
    Outcome,
    QuotaSpec,
    RunningAction,
    UnifiedAction,
)


def http(
    aid: str,
    quota: str = "q",
    job: str = "j",
    *,
    tokens: int = 0,
    retries: int = 2,
    now: float = 0.0,
    queue_timeout_s: float | None = None,
) -> UnifiedAction:
    act = HttpAction(
        method="GET",
        url="https://api.example.com/",
        quota=quota,
        tokens=tokens,
        max_retries=retries,
    )
    return _unified(aid, job, act, now, 1, queue_timeout_s)


def lease(
    aid: str,
    quota: str = "q",
    job: str = "j",
    *,
    units: int = 1,
    tokens: int = 0,
    ttl_s: float = 60.0,
    now: float = 0.0,
) -> UnifiedAction:
    act = LeaseAction(quota=quota, units=units, tokens=tokens, ttl_s=ttl_s)
    return _unified(aid, job, act, now, units, None)


def _unified(
    aid: str,
    job: str,
    act: HttpAction | LeaseAction,
    now: float,
    units: int,
    queue_timeout_s: float | None,
) -> UnifiedAction:
    spec = ActionSpec(
        action_id=aid, job_id=job, trajectory_id="", action=act, queue_timeout_s=queue_timeout_s
    )
    name = f"quota:{act.quota}"
    return UnifiedAction(
        spec=spec,
        demands=(Demand(resource=name, choices=(units,)),),
        key_resource=name,
        env_memory_mb=0,
        submitted_at=now,
    )


def agent(node: str = "qa0", inc: str = "i0", running: tuple[str, ...] = ()) -> NodeReport:
    runs = tuple(RunningAction(action_id=a, attempt=1, trajectory_id="", cores=()) for a in running)
    return NodeReport(
        node_id=node, incarnation=inc, inventory=Inventory(kind="quota"), running=runs, full=True
    )


def answer(
    start: StartOnNode,
    status: int = 200,
    *,
    headers: dict[str, str] | None = None,
    tokens_used: int | None = None,
    failure: ErrorKind | None = None,
    at: float | None = None,
) -> Completion:
    """The agent's report of ``start`` (``at``: sent then, answered 20 ms later)."""
    resp = None if failure else HttpResponse(status=status, headers=headers or {}, body=b"ok")
    outcome = Outcome(http=resp, tokens_used=tokens_used, failure=failure, detail="refused")
    if at is not None:
        outcome = msgspec.structs.replace(outcome, started_at=at, finished_at=at + 0.02)
    return Completion(
        node_id=start.node_id,
        incarnation=start.incarnation,
        action_id=start.action.spec.action_id,
        attempt=start.action.attempt,
        outcome=outcome,
    )


def core(spec: QuotaSpec, cfg: QuotaConfig | None = None, *, agents: int = 1) -> QuotaCore:
    c = QuotaCore(cfg)
    c.set_quota(spec, 0.0)
    for k in range(agents):
        c.node_report(agent(f"qa{k}"), 0.0)
    return c


def starts(effects: list[Effect]) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def results(effects: list[Effect]) -> list[ActionResult]:
    return [e.result for e in effects if isinstance(e, Finish)]


def test_http_is_dispatched_with_its_quota_and_reserved_tokens() -> None:
    c = core(QuotaSpec("q", concurrency=2, tokens_per_minute=1000))
    c.enqueue(http("a", tokens=300), 0.0)
    (s,) = starts(c.schedule(0.0))
    assert (s.node_id, s.quota, s.tokens, s.action.attempt) == ("qa0", c.quotas["q"].spec, 300, 1)
    (r,) = results(c.complete(answer(s, 404), 1.0))
    assert r.status == "succeeded"
    assert r.http is not None
    assert r.http.status == 404
    assert r.http.tries == 1
    assert r.allocation is not None
    assert r.allocation.quota == "q"
    assert c.quotas["q"].limiter.held == 0


def test_concurrency_waits_for_a_completion() -> None:
    c = core(QuotaSpec("q", concurrency=1))
    for aid in "ab":
        c.enqueue(http(aid), 0.0)
    (first,) = starts(c.schedule(0.0))
    assert starts(c.schedule(0.5)) == []
    c.complete(answer(first), 1.0)
    (second,) = starts(c.schedule(1.0))
    assert second.action.spec.action_id == "b"


def test_unknown_quota_and_impossible_units_fail_at_once() -> None:
    c = core(QuotaSpec("q", concurrency=2))
    c.enqueue(http("a", quota="nope"), 0.0)
    (r,) = results(c.schedule(0.0))
    assert r.error is not None
    assert r.error.kind is ErrorKind.INVALID_REQUEST
    assert "'nope'" in r.error.message
    assert "declared: q" in r.error.message
    c.enqueue(lease("b", units=3), 0.0)
    (r,) = results(c.schedule(0.0))
    assert r.error is not None
    assert "concurrency" in r.error.message


def test_no_agent_no_dispatch_but_leases_need_none() -> None:
    c = core(QuotaSpec("q", concurrency=5), agents=0)
    c.enqueue(http("a"), 0.0)
    c.enqueue(lease("b", job="k"), 0.0)
    effects = c.schedule(0.0)
    assert starts(effects) == []
    assert results(effects) == []
    c.node_report(agent(), 0.1)
    effects = c.schedule(0.1)
    assert len(starts(effects)) == 1
    assert results(effects)[0].lease is not None


def test_429_retries_spend_quota_then_rate_limited() -> None:
    c = core(QuotaSpec("q", per_second=100), QuotaConfig())
    c.enqueue(http("a", retries=1), 0.0)
    (s,) = starts(c.schedule(0.0))
    assert results(c.complete(answer(s, 429, headers={"Retry-After": "2"}), 0.1)) == []
    q = c.quotas["q"]
    assert q.limiter.adaptive.paused_until == 2.1
    assert q.limiter.adaptive.factor < 1
    assert starts(c.schedule(1.0)) == []  # paused
    (s2,) = starts(c.schedule(2.2))
    assert s2.action.attempt == 2
    assert q.calls == 2
    (r,) = results(c.complete(answer(s2, 429), 2.3))
    assert r.error is not None
    assert r.error.kind is ErrorKind.RATE_LIMITED
    assert r.http is not None
    assert r.http.tries == 2
    assert q.throttled == 2


def test_5xx_and_unreachable_fail_upstream_after_retries() -> None:
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(http("a", retries=1), 0.0)
    (s,) = starts(c.schedule(0.0))
    c.complete(answer(s, failure=ErrorKind.UPSTREAM_FAILED), 0.1)
    (s,) = starts(c.schedule(0.2))
    (r,) = results(c.complete(answer(s, 503), 0.3))
    assert r.error is not None
    assert r.error.kind is ErrorKind.UPSTREAM_FAILED
    assert "503" in r.error.message


def test_a_refusal_by_the_agent_ends_the_action_as_reported() -> None:
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(http("a"), 0.0)
    (s,) = starts(c.schedule(0.0))
    (r,) = results(c.complete(answer(s, failure=ErrorKind.INVALID_REQUEST), 0.1))
    assert r.error is not None
    assert r.error.kind is ErrorKind.INVALID_REQUEST


def test_token_reservation_trued_up_from_the_response() -> None:
    c = core(QuotaSpec("q", tokens_per_minute=1000))
    c.enqueue(http("a", tokens=900), 0.0)
    c.enqueue(http("b", tokens=500), 0.0)
    (s,) = starts(c.schedule(0.0))
    assert starts(c.schedule(0.1)) == []  # 900 + 500 > 1000
    c.complete(answer(s, tokens_used=100), 0.2)
    (s2,) = starts(c.schedule(0.2))  # trued up to 100: 600 fit
    assert s2.tokens == 500
    c.enqueue(http("c", tokens=500), 0.3)
    assert starts(c.schedule(0.3)) == []


def test_rate_limit_headers_pause_the_quota() -> None:
    c = core(QuotaSpec("q", per_second=100))
    c.enqueue(http("a"), 0.0)
    c.enqueue(http("b"), 0.0)
    s = starts(c.schedule(0.0))[0]
    hdrs = {"x-ratelimit-remaining": "0", "x-ratelimit-reset": "3"}
    c.complete(answer(s, 200, headers=hdrs), 0.5)
    state = c.states(0.6)[0]
    assert state.paused_until == 3.5


def test_fair_across_three_jobs_and_weights() -> None:
    for weights, want in (({}, (1, 1, 1)), ({"b": 2.0, "c": 3.0}, (1, 2, 3))):
        c = core(QuotaSpec("q", concurrency=1), QuotaConfig(weights=weights))
        for k in range(300):
            for job, n in zip("abc", (1, 2, 3), strict=True):  # unequal demand per job
                for m in range(n):
                    c.enqueue(http(f"{job}{k}-{m}", job=job), 0.0)
        served = {"a": 0, "b": 0, "c": 0}
        for step in range(300):
            (s,) = starts(c.schedule(float(step)))
            served[s.action.spec.job_id] += 1
            c.complete(answer(s), float(step))
        norm = [served[j] / w for j, w in zip("abc", want, strict=True)]
        assert jain_index(norm) >= 0.95, served


def test_lease_granted_held_and_released_with_feedback() -> None:
    c = core(QuotaSpec("q", concurrency=2))
    (r,) = results(c.enqueue(lease("L", units=2, ttl_s=10), 0.0) + c.schedule(0.0))
    assert r.status == "succeeded"
    assert r.lease is not None
    assert (r.lease.lease_id, r.lease.units, r.lease.expires_at) == ("L", 2, 10.0)
    c.enqueue(lease("M"), 1.0)
    assert results(c.schedule(1.0)) == []
    c.lease_end(LeaseEnd(lease_id="L", status=429, retry_after_s=1.0), 2.0)
    assert c.quotas["q"].throttled == 1
    assert c.quotas["q"].limiter.held == 0
    assert results(c.schedule(2.5)) == []  # paused by the client's 429 report
    assert len(results(c.schedule(3.1))) == 1


def test_lease_ttl_frees_units_and_a_late_release_is_harmless() -> None:
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(lease("L", ttl_s=5), 0.0)
    c.schedule(0.0)
    c.enqueue(lease("M", ttl_s=5), 1.0)
    assert results(c.schedule(1.0)) == []
    c.tick(5.0)
    (r,) = results(c.schedule(5.0))
    assert r.action_id == "M"
    c.lease_end(LeaseEnd(lease_id="L", tokens_used=3), 6.0)  # L expired already
    assert c.quotas["q"].limiter.held == 1  # M still holds its unit
    c.lease_end(LeaseEnd(lease_id="unknown"), 6.0)


def test_queue_timeout_and_cancel() -> None:
    c = core(QuotaSpec("q", concurrency=1))
    c.enqueue(http("a"), 0.0)
    c.enqueue(http("b", queue_timeout_s=1.0), 0.0)
    c.enqueue(http("c"), 0.0)
    (s,) = starts(c.schedule(0.0))
    (r,) = results(c.tick(2.0))
    assert r.action_id == "b"
    assert r.error is not None
    assert r.error.kind is ErrorKind.QUEUE_TIMEOUT
    (r,) = results(c.cancel("c", 2.0))
    assert r.status == "cancelled"
    (k,) = c.cancel("a", 2.0)
    assert isinstance(k, KillOnNode)
    assert k.node_id == s.node_id
    (r,) = results(c.complete(answer(s, failure=ErrorKind.CANCELLED), 2.1))
    assert r.status == "cancelled"
    assert c.quotas["q"].limiter.held == 0


def test_agent_death_fails_its_calls_without_retrying_them() -> None:
    c = core(QuotaSpec("q", concurrency=2, per_minute=10))
    c.enqueue(http("a"), 0.0)
    (s,) = starts(c.schedule(0.0))
    c.node_report(agent(running=("a",)), 0.5)
    (r,) = results(c.node_report(agent(inc="i1"), 1.0))
    assert r.error is not None
    assert r.error.kind is ErrorKind.NODE_DIED
    q = c.quotas["q"]
    assert q.limiter.held == 0
    assert q.limiter.windows[0].used == 1
    assert c.complete(answer(s), 1.1) == []  # the dead incarnation's late report


def test_unstarted_dispatch_is_redone_on_leaving() -> None:
    c = core(QuotaSpec("q", concurrency=2), agents=2)
    c.enqueue(http("a"), 0.0)
    (s,) = starts(c.schedule(0.0))
    gone = NodeLeaving(node_id=s.node_id, incarnation="i0", started=(), envs=())
    assert c.node_leaving(gone, 0.1) == []
    (s2,) = starts(c.schedule(0.2))
    assert s2.node_id != s.node_id
    assert s2.action.attempt == 2


def test_least_loaded_agent() -> None:
    c = core(QuotaSpec("q", concurrency=10), agents=2)
    for aid in "abcd":
        c.enqueue(http(aid), 0.0)
    nodes = [s.node_id for s in starts(c.schedule(0.0))]
    assert sorted(nodes) == ["qa0", "qa0", "qa1", "qa1"]


def test_rebuild_after_restart_holds_windows_and_live_leases() -> None:
    spec = QuotaSpec("q", concurrency=3, per_minute=4)
    c = QuotaCore()
    c.set_quota(spec, 100.0)
    for at in (50.0, 90.0, 95.0):
        c.record("q", 1, 0, at)
    c.restore_call(http("a"), "qa0", "i0", 100.0)
    c.restore_lease(LeaseGrant(lease_id="L", quota="q", units=1, expires_at=120.0), 100.0)
    c.restore_lease(LeaseGrant(lease_id="X", quota="q", units=1, expires_at=99.0), 100.0)
    assert c.quotas["q"].limiter.held == 2
    c.node_report(agent(running=("a",)), 100.0)
    c.enqueue(http("b"), 100.0)
    # 3 spent in the last minute, and the call and the lease still held count until released
    # (the rebuild does not know when they were sent: counted twice, never too little)
    assert starts(c.schedule(100.0)) == []
    c.lease_end(LeaseEnd(lease_id="L"), 101.0)
    assert starts(c.schedule(101.0)) == []  # the window, not concurrency, holds it
    assert starts(c.schedule(110.02)) == []  # the entry at 50 left; the call in flight holds
    a = c.calls["a"]
    ok = Outcome(http=HttpResponse(status=200), started_at=111.0, finished_at=111.0)
    c.complete(Completion("qa0", "i0", "a", a.action.attempt, ok), 111.0)
    assert starts(c.schedule(111.0)) == []  # it counts from its send (111) now
    assert len(starts(c.schedule(150.02))) == 1  # the entry at 90 left the window


def test_restored_call_whose_agent_never_returns_fails() -> None:
    c = QuotaCore(QuotaConfig(node_timeout_s=2.0))
    c.set_quota(QuotaSpec("q", concurrency=1), 0.0)
    c.restore_call(http("a"), "gone", "i0", 0.0)
    assert results(c.tick(1.0)) == []
    (r,) = results(c.tick(3.0))
    assert r.error is not None
    assert r.error.kind is ErrorKind.NODE_DIED
    assert c.quotas["q"].limiter.held == 0


def test_respec_keeps_what_was_granted() -> None:
    c = core(QuotaSpec("q", per_second=2))
    for aid in "abc":
        c.enqueue(http(aid), 0.0)
    assert len(starts(c.schedule(0.0))) == 1  # three queued for two a second: paced
    assert len(starts(c.schedule(0.5))) == 1
    c.set_quota(QuotaSpec("q", per_second=3, per_minute=3), 0.6)
    (s,) = starts(c.schedule(0.6))
    c.enqueue(http("d"), 0.7)
    assert starts(c.schedule(2.0)) == []  # per_minute=3 carried the first two grants
    assert s.quota is not None
    assert s.quota.per_minute == 3


def test_states_show_learned_rate_use_and_queue() -> None:
    c = core(QuotaSpec("q", concurrency=1, per_second=10))
    for aid in "ab":
        c.enqueue(http(aid), 0.0)
    (s,) = starts(c.schedule(0.0))
    (state,) = c.states(0.0)
    assert (state.in_use, state.queued, state.calls, state.learned_per_s) == (1, 1, 1, 10.0)
    c.complete(answer(s, 429), 0.1)
    (state,) = c.states(0.2)
    assert state.learned_per_s is not None
    assert state.learned_per_s < 10.0
    assert state.throttled == 1
    assert state.paused_until is not None
