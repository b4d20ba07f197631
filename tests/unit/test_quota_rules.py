"""The contract's rules for http calls and leases under a quota, and that the gateway and the
scheduler's limiter apply the same ones: what the gateway accepts an empty quota grants at
once, what it refuses the limiter refuses too (fractional rates included)."""

from __future__ import annotations

import itertools

import pytest

from services.gateway.formulation import Limits, formulate
from services.scheduler.policies.quota_limiter import Grant, Limiter
from tangram.contract import (
    ActionSpec,
    HttpAction,
    LeaseAction,
    QuotaSpec,
    check_fits,
    check_headers,
)
from tangram.errors import InvalidRequest

HOST = "api.example.com"


def test_header_caps_and_reserved_names() -> None:
    check_headers({"Accept": "application/json", "X-Job": "j1", "Authorization": "Bearer x"})
    bad = [
        {f"x-{i}": "v" for i in range(65)},
        {"x-big": "v" * 17_000},
        {"bad name": "v"},
        {"x-inject": "a\r\nHost: evil"},
        {"Host": "evil.com"},
        {"Transfer-Encoding": "chunked"},
        {"Proxy-Authorization": "Basic eA=="},
        {"x-utf": "é"},
    ]
    for headers in bad:
        with pytest.raises(InvalidRequest):
            check_headers(headers)


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        ({"Host": "evil.com"}, "header 'Host' is set by tangram"),
        ({"x-inject": "a\r\nHost: evil"}, "bad header 'x-inject'"),
        ({"x-big": "v" * 8000, "x-big2": "v" * 8000, "x-big3": "v" * 1000}, "headers too large"),
    ],
)
def test_the_gateway_refuses_bad_headers_before_queueing(
    headers: dict[str, str], needle: str
) -> None:
    """Refused at formulation, so never durable and never granted a unit of the quota."""
    quotas = {"q": QuotaSpec("q", concurrency=1, hosts=(HOST,))}
    act = HttpAction(method="GET", url=f"https://{HOST}/", quota="q", headers=headers)
    spec = ActionSpec(action_id="a1", job_id="j", trajectory_id="", action=act)
    with pytest.raises(InvalidRequest) as err:
        formulate(spec, now=0.0, limits=Limits(), quotas=quotas)
    assert needle in err.value.message


def test_fractional_rate_caps_a_grant_below_it() -> None:
    spec = QuotaSpec("f", per_second=2.5)
    check_fits(spec, 2, 0)
    with pytest.raises(InvalidRequest, match=r"3 exceeds per_second=2\.5"):
        check_fits(spec, 3, 0)
    slow = QuotaSpec("s", per_second=0.5)  # one call every two seconds
    check_fits(slow, 1, 0)
    with pytest.raises(InvalidRequest, match=r"2 exceeds per_second=0\.5"):
        check_fits(slow, 2, 0)


def test_the_gateway_refuses_a_lease_over_a_fractional_rate() -> None:
    quotas = {"f": QuotaSpec("f", per_second=2.5)}
    lease = ActionSpec(
        action_id="a1", job_id="j", trajectory_id="", action=LeaseAction(quota="f", units=3)
    )
    with pytest.raises(InvalidRequest, match=r"3 exceeds per_second=2\.5"):
        formulate(lease, now=0.0, limits=Limits(), quotas=quotas)


SPECS = [
    QuotaSpec("a", per_second=2.5),
    QuotaSpec("a", per_second=0.4),
    QuotaSpec("a", per_second=3, per_minute=4),
    QuotaSpec("a", per_minute=2, per_day=5),
    QuotaSpec("a", concurrency=2, per_second=7.9),
    QuotaSpec("a", tokens_per_minute=100),
    QuotaSpec("a", concurrency=3, tokens_per_minute=50, per_second=1.5),
]


@pytest.mark.parametrize("quota", SPECS, ids=[str(s.limits()) for s in SPECS])
def test_gateway_and_limiter_agree(quota: QuotaSpec) -> None:
    """Every demand: the gateway accepts it exactly when a fresh limiter grants it at once."""
    for units, tokens in itertools.product(range(1, 10), (0, 40, 60, 120)):
        act = LeaseAction(quota="a", units=units, tokens=tokens)
        spec = ActionSpec(action_id="x", job_id="j", trajectory_id="", action=act)
        try:
            formulate(spec, now=0.0, limits=Limits(), quotas={"a": quota})
            accepted = True
        except InvalidRequest:
            accepted = False
        try:
            granted = isinstance(Limiter(quota).try_acquire(units, tokens, 0.0), Grant)
        except InvalidRequest:
            granted = False
        assert accepted == granted, (units, tokens)
