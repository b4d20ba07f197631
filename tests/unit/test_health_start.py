"""The detector's start phase on a virtual clock (``tangram.health``, ``Progress.spawning``):
launches under way that do not end for ``start_s`` make a member suspect whatever its actions'
timeouts (a wedged launcher under 600 s actions is failed in seconds, not twenty minutes);
launches that keep ending, a long restore or container creation (no launch), a pause of the
member, and an older agent that reports no launches never do."""

from __future__ import annotations

import pytest

from tangram.contract import Progress
from tangram.health import Changed, Detector, Failed, Health, HealthConfig, Probe
from tangram.health import Effect as HealthEffect

CFG = HealthConfig(silent_s=3.0, suspect_s=3.0, start_s=3.0, probe_timeout_s=2.0, lease_s=3.0)
TIMEOUT_S = 600.0  # the default action timeout: the no-progress bound is 1,200 s


def beat(d: Detector, now: float, spawned: int, spawning: int) -> list[HealthEffect]:
    """A report of a member running one action (started, not finished)."""
    progress = Progress(started=1, spawned=spawned, spawning=spawning, last_progress_at=now)
    return d.report("n0", "inc", "cpu", progress, now)


def busy(d: Detector) -> None:
    d.work("n0", True, expected_s=TIMEOUT_S, now=0.0)


def run(
    d: Detector, start: float, end: float, spawned: int, spawning: int, every: float = 1.0
) -> list[HealthEffect]:
    """Ticks every 0.25 s from ``start`` to ``end``, a report every ``every`` seconds."""
    effects: list[HealthEffect] = []
    for k in range(round((end - start) / 0.25) + 1):
        t = start + k * 0.25
        if abs(t / every - round(t / every)) < 1e-9:
            effects += beat(d, t, spawned, spawning)
        effects += d.tick(t)
    return effects


def states(effects: list[HealthEffect]) -> list[Health]:
    return [e.new for e in effects if isinstance(e, Changed)]


def test_a_wedged_launcher_is_suspect_after_the_start_bound_whatever_the_timeout() -> None:
    d = Detector(CFG)
    beat(d, 0.0, spawned=5, spawning=0)
    busy(d)
    assert run(d, 0.0, 1.0, spawned=5, spawning=0) == []
    effects = run(d, 2.0, 5.25, spawned=5, spawning=2)  # two launches from 2.0, never ending
    assert states(effects) == [Health.SUSPECT]
    (changed,) = [e for e in effects if isinstance(e, Changed)]
    assert changed.at == 5.25  # the window opened at the report of 2.0: 3 s later
    assert changed.why == "2 launches under way and none ended for 3.2s"
    (ping,) = [e for e in effects if isinstance(e, Probe)]
    (canary,) = d.answered("n0", "inc", ping.probe, 5.3)  # its bus loop answers
    assert isinstance(canary, Probe)
    assert canary.canary  # a stalled suspect: the canary, through the launcher
    effects = run(d, 5.5, 12.0, spawned=5, spawning=2)  # the canary never completes
    assert states(effects) == [Health.FENCED, Health.FAILED]
    failed = [e for e in effects if isinstance(e, Failed)]
    assert len(failed) == 1
    assert "its canary did not complete within 2s" in failed[0].why
    at = [e.at for e in effects if isinstance(e, Changed)]
    assert at == [7.5, 10.0]  # fenced at 7.3 (next tick), failed 3 s after the last report read


def test_launches_that_keep_ending_are_never_suspect() -> None:
    d = Detector(CFG)
    busy(d)
    effects: list[HealthEffect] = []
    for k in range(600):  # ten minutes, some launch under way at every report
        effects += beat(d, float(k), spawned=k * 40, spawning=3)
        effects += d.tick(k + 0.5)
    assert effects == []


def test_a_long_restore_or_container_creation_is_no_launch() -> None:
    """A model restored onto its GPUs or a container created for 60 s: no launch under way."""
    d = Detector(CFG)
    busy(d)
    assert run(d, 0.0, 60.0, spawned=0, spawning=0) == []
    assert run(d, 61.0, 61.0, spawned=1, spawning=0) == []  # it started


def test_a_slow_single_launch_within_the_bound_is_not_suspect() -> None:
    d = Detector(CFG)
    busy(d)
    beat(d, 0.0, spawned=0, spawning=0)
    assert run(d, 1.0, 3.75, spawned=0, spawning=1) == []  # under way 2.75 s
    assert run(d, 4.0, 8.0, spawned=1, spawning=0) == []


def test_a_pause_of_the_member_restarts_the_window() -> None:
    """Paused under the silence bound, then its first report still shows the launch it had
    under way (the launcher resumes a moment after the heartbeat): not suspect."""
    d = Detector(CFG)
    busy(d)
    assert run(d, 0.0, 1.0, spawned=4, spawning=1, every=1.0) == []
    assert [e for t in (1.25, 1.5, 2.0, 2.5, 3.0, 3.75) for e in d.tick(t)] == []  # paused
    assert run(d, 3.75, 3.75, spawned=4, spawning=1, every=3.75) == []
    assert [e for t in (4.0, 4.5, 5.0) for e in d.tick(t)] == []
    assert run(d, 5.0, 6.0, spawned=5, spawning=0) == []


def test_back_from_silence_a_member_gets_a_fresh_start_window() -> None:
    d = Detector(CFG)
    busy(d)
    beat(d, 0.0, spawned=4, spawning=1)
    assert states(d.tick(3.25)) == [Health.SUSPECT]  # silent
    assert states(beat(d, 4.0, spawned=4, spawning=1)) == [Health.HEALTHY]
    assert run(d, 4.25, 6.75, spawned=4, spawning=1, every=0.25) == []
    assert states(run(d, 7.0, 7.25, spawned=4, spawning=1, every=0.25)) == [Health.SUSPECT]


def test_an_answered_canary_restarts_the_window() -> None:
    d = Detector(CFG)
    busy(d)
    effects = run(d, 0.0, 3.25, spawned=0, spawning=1)
    (ping,) = [e for e in effects if isinstance(e, Probe)]
    (canary,) = d.answered("n0", "inc", ping.probe, 3.3)
    assert isinstance(canary, Probe)
    assert states(d.answered("n0", "inc", canary.probe, 3.4)) == [Health.HEALTHY]
    assert run(d, 4.0, 6.25, spawned=0, spawning=1) == []  # a fresh window from 3.4
    assert states(run(d, 6.5, 6.5, spawned=0, spawning=1)) == [Health.SUSPECT]


def test_an_agent_that_reports_no_launches_is_judged_as_before() -> None:
    d = Detector(CFG)
    busy(d)
    for k in range(60):
        d.report("n0", "inc", "cpu", Progress(started=1), float(k))
        assert d.tick(k + 0.5) == []
        d.report("n0", "inc", "cpu", None, k + 0.75)


def test_the_start_bound_is_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        HealthConfig(start_s=0.0)
