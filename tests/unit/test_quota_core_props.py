"""Under any schedule of arrivals, answers (429s included), lease ends and time, the quota core
never holds more than the concurrency limit and never grants more than a window's limit in any
interval of the window's length (tokens counted as really used, when at most the reservation)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core.effects import Finish, StartOnNode
from services.scheduler.core.quota import QuotaCore
from tangram.contract import Completion, HttpResponse, LeaseEnd, Outcome, QuotaSpec
from tests.unit.test_quota_core import agent, http, lease

SPEC = QuotaSpec("q", concurrency=3, per_second=4, per_minute=30, tokens_per_minute=900)

op = st.one_of(
    st.tuples(st.just("http"), st.sampled_from("abc"), st.integers(0, 300)),
    st.tuples(st.just("lease"), st.sampled_from("abc"), st.integers(1, 2)),
    st.tuples(st.just("answer"), st.sampled_from([200, 200, 429, 503]), st.integers(0, 300)),
    st.tuples(st.just("release"), st.just(""), st.integers(0, 300)),
    st.tuples(st.just("wait"), st.just(""), st.integers(1, 3000)),
)


def _check(grants: list[list[float]]) -> None:
    """Every interval starting at a grant (the worst case) holds at most each limit."""
    for name, limit, span in (("per_second", 4, 1.0), ("per_minute", 30, 60.0)):
        for t, _, _ in grants:
            inside = sum(u for g, u, _ in grants if t <= g < t + span)
            assert inside <= limit, (name, t, inside)
    for t, _, _ in grants:
        tokens = sum(r for g, _, r in grants if t <= g < t + 60.0)
        assert tokens <= 900, ("tokens", t, tokens)


@settings(max_examples=60, deadline=None)
@given(st.lists(op, min_size=1, max_size=120))
def test_no_limit_is_ever_exceeded(ops: list[tuple[str, str, int]]) -> None:
    c = QuotaCore()
    c.set_quota(SPEC, 0.0)
    now, n = 0.0, 0
    c.node_report(agent(), now)
    grants: dict[str, list[float]] = {}  # grant key -> [at, units, tokens spent]
    calls: list[StartOnNode] = []
    leases: list[str] = []
    for kind, arg, k in ops:
        n += 1
        if kind == "http":
            c.enqueue(http(f"h{n}", job=arg, tokens=k, now=now), now)
        elif kind == "lease":
            c.enqueue(lease(f"l{n}", job=arg, units=k, tokens=k * 10, now=now), now)
        elif kind == "answer" and calls:
            s = calls.pop(0)
            spent = min(k, s.tokens)  # at most the reservation
            grants[f"{s.action.spec.action_id}/{s.action.attempt}"][2] = spent
            resp = HttpResponse(status=int(arg), headers={"Retry-After": "0.5"})
            c.complete(_done(s, resp, spent), now)
        elif kind == "release" and leases:
            lease_id = leases.pop(0)
            grants[lease_id][2] = 0
            c.lease_end(LeaseEnd(lease_id=lease_id, tokens_used=0), now)
        elif kind == "wait":
            now += k / 1000
            c.node_report(agent(running=tuple(s.action.spec.action_id for s in calls)), now)
            c.tick(now)
        for e in c.schedule(now):
            if isinstance(e, StartOnNode):
                calls.append(e)
                grants[f"{e.action.spec.action_id}/{e.action.attempt}"] = [now, 1, e.tokens]
            elif isinstance(e, Finish) and e.result.lease is not None:
                leases.append(e.result.lease.lease_id)
                g = e.result.lease
                grants[g.lease_id] = [now, g.units, g.tokens]
        assert c.quotas["q"].limiter.held <= 3
        assert c.quotas["q"].limiter.held == len(calls) + sum(
            x.grant.units for x in c.leases.values()
        )
    _check(list(grants.values()))


def _done(s: StartOnNode, resp: HttpResponse, spent: int) -> Completion:
    return Completion(
        node_id=s.node_id,
        incarnation=s.incarnation,
        action_id=s.action.spec.action_id,
        attempt=s.action.attempt,
        outcome=Outcome(http=resp, tokens_used=spent),
    )
