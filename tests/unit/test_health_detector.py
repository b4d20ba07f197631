"""The health detector's pure core on a virtual clock (robustrl §4): idle is never suspect,
a slow action on a live agent is not a failure, no progress -> suspect -> probe -> fenced ->
failed, and a broker outage of the detector's own fails nobody."""

from __future__ import annotations

import pytest

from tangram.contract import Progress
from tangram.health import Changed, Detector, Failed, Health, HealthConfig, Probe
from tangram.health import Effect as HealthEffect

CFG = HealthConfig(silent_s=3.0, suspect_s=3.0, probe_timeout_s=2.0, lease_s=3.0)


def beat(d: Detector, now: float, started: int = 0, finished: int = 0) -> list[HealthEffect]:
    progress = Progress(started=started, finished=finished, last_progress_at=now)
    return d.report("n0", "inc", "cpu", progress, now)


def run(d: Detector, start: float, end: float, every: float = 0.25) -> list[HealthEffect]:
    """Tick from ``start`` to ``end``, the member reporting every second (counters still)."""
    effects: list[HealthEffect] = []
    t = start
    while t <= end:
        if abs(t - round(t)) < 1e-9:
            effects += beat(d, t)
        effects += d.tick(t)
        t += every
    return effects


def states(effects: list[HealthEffect]) -> list[Health]:
    return [e.new for e in effects if isinstance(e, Changed)]


def test_an_idle_agent_is_healthy_however_quiet() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    assert run(d, 0.0, 600.0) == []  # ten minutes with no progress and no work
    assert d.members["n0"].health is Health.HEALTHY


def test_a_slow_action_on_a_live_agent_is_probed_but_never_failed() -> None:
    d = Detector(CFG)
    beat(d, 0.0, started=1)
    d.work("n0", True, expected_s=10.0, now=0.0)  # bound: max(3, 2 * 10) = 20 s
    assert run(d, 0.0, 19.0) == []
    effects = run(d, 19.25, 21.0)
    assert states(effects) == [Health.SUSPECT]
    (probe,) = [e for e in effects if isinstance(e, Probe)]
    assert not probe.canary  # the ping first
    (canary,) = d.answered("n0", "inc", probe.probe, 21.0)  # the ping: now its canary
    assert isinstance(canary, Probe)
    assert canary.canary
    assert states(d.answered("n0", "inc", canary.probe, 21.1)) == [Health.HEALTHY]
    probes = failed = 0
    for k in range(1, 400):  # still running: probed every bound, and it answers each time
        t = 21.0 + k * 0.25
        effects = run(d, t, t)
        while effects:
            e = effects.pop(0)
            probes += isinstance(e, Probe)
            failed += isinstance(e, Failed)
            if isinstance(e, Probe):  # its ping, then its canary, both answered
                effects += d.answered("n0", "inc", e.probe, t + 0.01)
    assert (probes, failed) == (8, 0)
    assert d.members["n0"].health is Health.HEALTHY


def test_no_progress_with_work_makes_a_suspect_then_unanswered_fenced_then_failed() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    d.work("n0", True, expected_s=0.5, now=0.0)  # the floor: 3 s
    effects = run(d, 0.0, 3.25)
    assert states(effects) == [Health.SUSPECT]
    assert [type(e) for e in effects if not isinstance(e, Changed)] == [Probe]
    effects = run(d, 3.5, 5.25)  # reports keep coming, but the probe is not answered
    assert states(effects) == [Health.FENCED]
    assert d.fenced("n0", "inc")
    # fenced, its reports are refused (the shell) so the last one read is at 5.0: it fails
    # once its start lease (3 s from there) has surely run out
    effects = [e for t in (6.0, 7.0, 7.75, 8.0, 8.25) for e in d.tick(t)]
    assert states(effects) == [Health.FAILED]
    assert [e for e in effects if isinstance(e, Failed)] == [
        Failed("n0", "inc", effects[0].why)  # type: ignore[union-attr]
    ]
    assert "n0" not in d.members


def test_a_silent_agent_fails_in_silent_plus_probe_timeout() -> None:
    d = Detector(CFG)
    beat(d, 0.0)  # idle: silence alone makes it suspect
    effects = [e for k in range(1, 25) for e in d.tick(k * 0.25)]
    assert states(effects) == [Health.SUSPECT, Health.FENCED, Health.FAILED]
    failed_at = [e.at for e in effects if isinstance(e, Changed) and e.new is Health.FAILED]
    assert failed_at == [5.25]  # 3 s silent, then 2 s without an answer (lease ran out at 3)


def test_a_suspect_that_reports_again_is_healthy() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    assert states(d.tick(3.25)) == [Health.SUSPECT]
    assert states(beat(d, 4.0)) == [Health.HEALTHY]  # a pause shorter than the bound
    assert run(d, 4.0, 30.0) == []


def test_a_broker_outage_of_the_detectors_own_fails_nobody() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    d.work("n0", True, expected_s=1.0, now=0.0)
    d.disconnected()
    assert [e for k in range(1, 80) for e in d.tick(k * 0.25)] == []  # 20 s without a word
    assert d.reconnected(20.0) == []
    # a fresh window: the agents reconnect and report within it
    assert [e for t in (20.5, 21.0, 22.0) for e in d.tick(t)] == []
    assert states(beat(d, 22.5, started=1)) == []
    assert d.members["n0"].health is Health.HEALTHY


def test_a_suspect_when_the_detector_loses_the_broker_is_not_failed() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    assert states(d.tick(3.25)) == [Health.SUSPECT]
    d.disconnected()
    assert d.tick(10.0) == []
    assert states(d.reconnected(11.0)) == [Health.HEALTHY]


def test_a_new_incarnation_replaces_the_old_one_and_a_late_answer_changes_nothing() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    effects = d.tick(3.25)
    (probe,) = [e for e in effects if isinstance(e, Probe)]
    d.report("n0", "inc2", "cpu", None, 4.0)
    assert d.answered("n0", "inc", probe.probe, 4.1) == []
    assert d.members["n0"].incarnation == "inc2"
    assert d.members["n0"].health is Health.HEALTHY


def stalled(d: Detector) -> Probe:
    """A busy member without progress past the floor: suspect, its ping sent at 3.25."""
    beat(d, 0.0)
    d.work("n0", True, expected_s=0.5, now=0.0)
    (ping,) = [e for e in run(d, 0.0, 3.25) if isinstance(e, Probe)]
    return ping


def test_a_wedged_executor_answers_its_ping_but_not_its_canary_and_is_failed() -> None:
    d = Detector(CFG)
    ping = stalled(d)
    (canary,) = d.answered("n0", "inc", ping.probe, 3.5)  # its bus loop is alive
    assert isinstance(canary, Probe)
    assert canary.canary
    assert canary.probe != ping.probe
    assert d.members["n0"].health is Health.SUSPECT
    assert d.answered("n0", "inc", ping.probe, 3.6) == []  # the ping's again: not the canary
    effects = run(d, 3.75, 5.25)  # reports keep coming (its heartbeats), the canary never ends
    assert states(effects) == []  # the canary's own timeout: 2 s from 3.5
    effects = run(d, 5.5, 5.5)
    assert states(effects) == [Health.FENCED]
    assert "its canary did not complete within 2s" in d.members["n0"].why
    assert d.answered("n0", "inc", canary.probe, 5.6) == []  # too late: fenced
    effects = [e for t in (6.0, 7.0, 8.0, 8.25) for e in d.tick(t)]  # last report read: 5.0
    assert states(effects) == [Health.FAILED]
    assert [type(e) for e in effects if not isinstance(e, Changed)] == [Failed]


def test_a_stalled_member_whose_canary_completes_is_healthy() -> None:
    d = Detector(CFG)
    ping = stalled(d)
    (canary,) = d.answered("n0", "inc", ping.probe, 3.5)
    assert isinstance(canary, Probe)
    (changed,) = d.answered("n0", "inc", canary.probe, 4.0)
    assert isinstance(changed, Changed)
    assert changed.new is Health.HEALTHY
    assert changed.why == "answered its ping and canary"
    assert run(d, 4.0, 7.0) == []  # a fresh no-progress window from the answer


def test_a_silent_suspect_and_a_detector_without_canary_need_the_ping_alone() -> None:
    d = Detector(CFG)
    beat(d, 0.0)
    (ping,) = [e for e in d.tick(3.25) if isinstance(e, Probe)]  # silent, not stalled
    assert states(d.answered("n0", "inc", ping.probe, 3.5)) == [Health.HEALTHY]
    d = Detector(HealthConfig(canary=False))
    ping = stalled(d)
    assert states(d.answered("n0", "inc", ping.probe, 3.5)) == [Health.HEALTHY]


def test_an_answer_of_another_incarnation_never_counts() -> None:
    d = Detector(CFG)
    ping = stalled(d)
    assert d.answered("n0", "inc2", ping.probe, 3.5) == []  # the node's next incarnation
    (canary,) = d.answered("n0", "inc", ping.probe, 3.5)
    assert isinstance(canary, Probe)
    assert d.answered("n0", "inc2", canary.probe, 3.6) == []
    assert d.members["n0"].health is Health.SUSPECT


def test_the_history_bounds_are_positive() -> None:
    for bad in ({"events_keep_s": 0.0}, {"events_keep_rows": 0}, {"prune_s": -1.0}):
        with pytest.raises(ValueError, match="positive"):
            HealthConfig(**bad)  # type: ignore[arg-type]
