"""A service registration's timeouts: configured, and nested so the caller hears the innermost
typed error (a stuck factory, a silent GPU node) rather than a bare timeout of an outer hop."""

from __future__ import annotations

import pytest

from services.gateway import config as gateway_config
from services.gateway import services_api
from services.gateway.config import GatewayConfig
from services.gpu_manager import config as gpu_config
from services.gpu_manager.config import GpuManagerConfig
from services.scheduler.core.scheduler import CoreConfig
from tangram import client as client_module
from tangram.client import Client
from tangram.contract import Services, ServiceSpec, ServiceState
from tangram.errors import Unavailable

SPEC = ServiceSpec("judge", "pkg.models:judge")


def test_the_registration_timeouts_nest() -> None:
    agent = GpuManagerConfig().prepare_timeout_s  # one factory's build
    scheduler = CoreConfig().prepare_timeout_s  # every GPU node's report
    gateway = GatewayConfig().register_timeout_s  # the scheduler's answer
    assert agent < scheduler < gateway < client_module.REGISTER_WAIT_S


def test_the_timeouts_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANGRAM_GATEWAY_REGISTER_TIMEOUT_S", "300")
    monkeypatch.setenv("TANGRAM_GPU_PREPARE_TIMEOUT_S", "240")
    assert gateway_config.load()[1].register_timeout_s == 300
    assert gpu_config.load()[1].prepare_timeout_s == 240


class FakePool:
    async def execute(self, *args: object) -> None:
        pass


class FakeBus:
    """Answers every request (a registration with ``SPEC``'s state), failing the first
    ``failures`` tries as a lost reply would."""

    def __init__(self, failures: int = 0) -> None:
        self.failures = failures
        self.timeouts: list[float] = []
        self.creds = None  # a mesh without auth (as Bus.creds says)

    async def request(self, endpoint: object, msg: object, timeout: float) -> Services:
        self.timeouts.append(timeout)
        if len(self.timeouts) <= self.failures:
            raise Unavailable("no reply")
        return Services(services=(ServiceState(spec=SPEC),))


async def test_the_gateway_waits_its_configured_register_timeout() -> None:
    bus = FakeBus()
    await services_api.register(FakePool(), bus, SPEC, 42.0)  # type: ignore[arg-type]
    assert bus.timeouts == [42.0]


async def test_a_client_registration_outlasts_the_clients_request_timeout() -> None:
    bus = FakeBus(failures=3)  # three lost replies: ~0.35 s of backoff
    client = Client(bus, request_timeout=0.01)  # type: ignore[arg-type]
    state = await client.register_service(SPEC)
    assert state.spec == SPEC
    assert len(bus.timeouts) == 4
