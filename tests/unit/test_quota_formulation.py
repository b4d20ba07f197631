"""The gateway's formulation of http and lease actions: demands, and every refusal naming its
problem."""

from __future__ import annotations

import pytest

from services.gateway.formulation import Limits, formulate
from tangram.contract import ActionSpec, HttpAction, LeaseAction, QuotaSpec
from tangram.errors import InvalidRequest

QUOTAS = {
    "search": QuotaSpec(
        "search", per_second=5, hosts=("api.example.com", "127.0.0.1:8080", "[::1]:9000")
    ),
    "llm": QuotaSpec("llm", concurrency=4, tokens_per_minute=1000, hosts=("llm.example.com",)),
}


def _formulate(act: HttpAction | LeaseAction, tid: str = "") -> object:
    spec = ActionSpec(action_id="a1", job_id="j", trajectory_id=tid, action=act)
    return formulate(spec, now=1.0, limits=Limits(), quotas=QUOTAS)


def _http(url: str, quota: str = "search", tokens: int = 0) -> HttpAction:
    return HttpAction(method="GET", url=url, quota=quota, tokens=tokens)


def test_http_costs_one_unit_of_its_quota() -> None:
    action = _formulate(_http("https://api.example.com/q?x=1"))
    assert action.demands[0].resource == "quota:search"  # type: ignore[attr-defined]
    assert action.demands[0].choices == (1,)  # type: ignore[attr-defined]
    assert action.key_resource == "quota:search"  # type: ignore[attr-defined]
    _formulate(_http("http://127.0.0.1:8080/x"), tid="t1")  # a listed port; a trajectory is fine
    _formulate(_http("http://[::1]:9000/x"))


def test_lease_costs_its_units() -> None:
    action = _formulate(LeaseAction(quota="llm", units=3, tokens=500))
    assert action.demands[0].choices == (3,)  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("act", "needle"),
    [
        (_http("https://other.example.com/"), "other.example.com:443 is not in quota 'search'"),
        (_http("https://x.api.example.com/"), "x.api.example.com"),
        (_http("http://127.0.0.1/"), "127.0.0.1:80"),
        (_http("https://api.example.com:8443/"), "api.example.com:8443"),
        (_http("file:///etc/passwd"), "scheme 'file'"),
        (_http("ftp://api.example.com/"), "scheme 'ftp'"),
        (_http("api.example.com/x"), "scheme '(none)'"),
        (_http("https://user:pw@api.example.com/"), "credentials"),
        (_http("https://api.example.com:99999/"), "not a valid URL"),
        (_http("https://[::1/"), "not a valid URL"),
        (_http("https://api.example.com/", quota="nope"), "unknown quota 'nope'"),
        (LeaseAction(quota="nope"), "declared: llm, search"),
        (LeaseAction(quota="llm", units=5), "5 exceeds concurrency=4"),
        (LeaseAction(quota="llm", tokens=2000), "2000 exceeds tokens_per_minute=1000"),
        (_http("https://llm.example.com/", quota="llm", tokens=1001), "tokens_per_minute"),
    ],
)
def test_refusals_name_the_problem(act: HttpAction | LeaseAction, needle: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        _formulate(act)
    assert needle in err.value.message


def test_no_quotas_declared() -> None:
    spec = ActionSpec(action_id="a1", job_id="j", trajectory_id="", action=LeaseAction(quota="q"))
    with pytest.raises(InvalidRequest) as err:
        formulate(spec, now=1.0, limits=Limits())
    assert "declared: none" in err.value.message
