"""A factory that ends its gpu_manager (os._exit, abort, a crash in native code) must not have
the supervisor restart the agent into the same build for ever: a node whose agent died
MAX_BUILD_DEATHS times in a row while building a service reports it failed, the registration
is answered with that error, and a new registration of the service tries again."""

from __future__ import annotations

from services.scheduler.core.effects import Effect, PrepareOnNode, ServiceSettled
from services.scheduler.core.gpu_sched import MAX_BUILD_DEATHS
from services.scheduler.core.scheduler import SchedulerCore
from tangram.contract import NodeLeaving, PreparedService, ServiceSpec

from .test_scheduler_gpu import core_with, gpu_report, prepared

BAD = ServiceSpec("bad", "pkg.models:exits")


def asked(effects: list[Effect], node: str = "g0") -> list[str]:
    return [
        s.name
        for e in effects
        if isinstance(e, PrepareOnNode) and e.node_id == node
        for s in e.services
    ]


def settled(effects: list[Effect]) -> list[ServiceSettled]:
    return [e for e in effects if isinstance(e, ServiceSettled)]


def restarted(core: SchedulerCore, n: int, now: float, **kw: object) -> list[Effect]:
    """Incarnation ``n`` of g0 reports (the one before it died)."""
    return core.node_report(gpu_report("g0", inc=f"i{n}", **kw), now)  # type: ignore[arg-type]


def test_a_node_that_dies_building_a_service_twice_reports_it_failed_and_is_not_asked_again() -> (
    None
):
    core = core_with(gpu_report("g0", services=prepared()), prepare_timeout_s=60.0)
    assert asked(core.register_service(BAD, 0.0)) == ["bad"]
    now = 1.0
    for n in range(1, MAX_BUILD_DEATHS):  # it dies building, comes back, is asked again
        effects = restarted(core, n, now, services=prepared())
        assert asked(effects) == ["bad"]
        assert not settled(effects)  # the registration waits for the node's next incarnation
        now += 1.0
    effects = restarted(core, MAX_BUILD_DEATHS, now, services=prepared())
    assert asked(effects) == []  # not built there again
    (answer,) = settled(effects)
    assert "ended 2 times in a row while it built service 'bad'" in answer.error
    assert "os._exit" in answer.error
    (state,) = [s for s in core.service_states() if s.spec.name == "bad"]
    assert state.prepared_on == ()
    assert "g0" in state.error
    # its heartbeats never ask it again, and the other service serves on
    for t in (now + 10.0, now + 100.0):
        assert asked(restarted(core, MAX_BUILD_DEATHS, t, services=prepared())) == []
    assert [s.prepared_on for s in core.service_states() if s.spec.name == "judge"] == [("g0",)]


def test_registering_the_service_again_tries_the_build_again() -> None:
    core = core_with(gpu_report("g0", services=prepared()), prepare_timeout_s=60.0)
    core.register_service(BAD, 0.0)
    for n in range(1, MAX_BUILD_DEATHS + 1):
        restarted(core, n, float(n), services=prepared())
    assert asked(core.register_service(BAD, 10.0)) == ["bad"]  # a deliberate retry
    fixed = (*prepared(), PreparedService(name="bad", dop=1, footprint_mb=10))
    (answer,) = settled(restarted(core, MAX_BUILD_DEATHS, 11.0, services=fixed))
    assert answer.error == ""
    assert answer.state.prepared_on == ("g0",)


def test_deaths_between_clean_builds_are_not_in_a_row() -> None:
    core = core_with(gpu_report("g0", services=prepared()), prepare_timeout_s=60.0)
    core.register_service(BAD, 0.0)
    built = (*prepared(), PreparedService(name="bad", dop=1, footprint_mb=10))
    inc, now = 0, 1.0
    for _ in range(2 * MAX_BUILD_DEATHS):
        restarted(core, inc, now, services=built)  # this incarnation built it (then it dies)
        inc += 1  # the next one knows nothing of it: asked, and it dies building
        assert asked(restarted(core, inc, now + 0.5, services=prepared())) == ["bad"]
        inc += 1
        now += 1.0
    assert core.gpu.unbuildable == {}
    restarted(core, inc, now, services=built)
    (state,) = [s for s in core.service_states() if s.spec.name == "bad"]
    assert state.error == ""
    assert state.prepared_on == ("g0",)


def test_a_node_that_shuts_down_while_building_is_no_death() -> None:
    core = core_with(gpu_report("g0", services=prepared()), prepare_timeout_s=60.0)
    core.register_service(BAD, 0.0)
    for n in range(MAX_BUILD_DEATHS + 1):
        leave = NodeLeaving(node_id="g0", incarnation=f"i{n}", started=())
        core.node_leaving(leave, 2.0 * n + 1)
        assert asked(restarted(core, n + 1, 2.0 * n + 2, services=prepared())) == ["bad"]
    assert core.gpu.unbuildable == {}
