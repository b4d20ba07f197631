"""The gateway's submit path for http and lease actions: each is formulated once, against the
cached quota specs; a refusal reloads them (at most once a second) and tries once more, so a
quota another gateway declared is found."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from services.gateway import quota_formulation, store
from services.gateway.config import GatewayConfig
from services.gateway.service import Gateway
from tangram.contract import (
    Accepted,
    ActionSpec,
    HttpAction,
    QuotaSpec,
    Submit,
    encode,
)
from tangram.errors import InvalidRequest

HOST = "api.example.com"


class FakePool:
    """The ``quotas`` table as Postgres holds it; counts the reloads."""

    def __init__(self, specs: Sequence[QuotaSpec]) -> None:
        self.specs = list(specs)
        self.fetches = 0

    async def fetch(self, query: str, *args: object) -> list[dict[str, bytes]]:
        assert "FROM quotas" in query
        self.fetches += 1
        return [{"spec": encode(s)} for s in self.specs]


class FakeIntake:
    async def submit(self, item: store.Owned) -> store.Intake:
        return store.Intake(action_id=item.action.spec.action_id, duplicate=False)


class FakeBus:
    async def publish(self, endpoint: object, msg: object) -> None:
        pass


async def gateway(pool: FakePool, clock: Callable[[], float]) -> Gateway:
    gw = Gateway(GatewayConfig(admission=False), FakeBus(), pool)  # type: ignore[arg-type]
    gw.intake = FakeIntake()  # type: ignore[assignment]
    gw.quotas.clock = clock
    await gw.quotas.load()
    return gw


def submit(quota: str, aid: str = "a1") -> Submit:
    act = HttpAction(method="GET", url=f"https://{HOST}/", quota=quota)
    return Submit(spec=ActionSpec(action_id=aid, job_id="j", trajectory_id="", action=act))


@pytest.fixture
def formulations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The quota name of every formulation of an http or lease action."""
    seen: list[str] = []
    real = quota_formulation.declared

    def counted(quotas: Any, name: str) -> QuotaSpec:
        seen.append(name)
        return real(quotas, name)

    monkeypatch.setattr(quota_formulation, "declared", counted)
    return seen


async def test_an_http_submit_is_formulated_once(formulations: list[str]) -> None:
    now = [0.0]
    pool = FakePool([QuotaSpec("q", concurrency=2, hosts=(HOST,))])
    gw = await gateway(pool, lambda: now[0])
    now[0] = 60.0  # the cache is old enough to be reloaded
    for i in range(3):
        assert isinstance(await gw.submit(submit("q", f"a{i}")), Accepted)
    assert formulations == ["q"] * 3
    assert pool.fetches == 1  # accepted from the cache: no reload


async def test_a_refusal_reloads_once_then_formulates_again(formulations: list[str]) -> None:
    now = [0.0]
    pool = FakePool([])
    gw = await gateway(pool, lambda: now[0])
    pool.specs.append(QuotaSpec("late", concurrency=1, hosts=(HOST,)))  # another gateway's
    with pytest.raises(InvalidRequest, match="unknown quota 'late'"):
        await gw.submit(submit("late"))  # the cache is fresh: no reload yet
    now[0] = 1.5
    assert isinstance(await gw.submit(submit("late", "a2")), Accepted)
    assert pool.fetches == 2
    assert formulations == ["late", "late", "late"]
