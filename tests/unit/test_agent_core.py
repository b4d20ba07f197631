"""The node agent's pure core on a virtual clock: fencing, duplicates, overlap, the outbox,
progress, environment TTL, and a goodbye after which nothing is sent."""

from __future__ import annotations

import pytest

from tangram.agent.core import (
    AgentConfig,
    AgentCore,
    Announce,
    Deliver,
    Drop,
    Effect,
    Publish,
    Run,
    Stop,
)
from tangram.agent.fit import MAX_DETAIL_CHARS
from tangram.contract import (
    Ack,
    ActionSpec,
    Completion,
    Dispatch,
    DropEnv,
    EnvExpired,
    ErrorKind,
    ExecAction,
    Inventory,
    Kill,
    NodeReport,
    NumaCores,
    Outcome,
    Reconcile,
    UnifiedAction,
)
from tangram.errors import InvalidRequest

INVENTORY = Inventory(
    numa=(NumaCores(numa_node=0, cores=(0, 1, 2, 3)),), memory_mb=1024, backend="t", isolates=False
)


def dispatch(
    aid: str, cores: tuple[int, ...] = (0,), epoch: int = 1, incarnation: str = "inc", tid: str = ""
) -> Dispatch:
    spec = ActionSpec(
        action_id=aid, job_id="j", trajectory_id=tid or f"t-{aid}", action=ExecAction(command="x")
    )
    action = UnifiedAction(
        spec=spec, demands=(), key_resource="cpu", env_memory_mb=64, submitted_at=0.0, attempt=1
    )
    return Dispatch(action=action, cores=cores, epoch=epoch, incarnation=incarnation)


def ok(at: float = 1.0) -> Outcome:
    return Outcome(exit_code=0, stdout="hi", started_at=at, finished_at=at)


@pytest.fixture
def core() -> AgentCore:
    c = AgentCore(AgentConfig(node_id="n0", incarnation="inc", env_ttl_s=10.0, resend_s=1.0))
    c.register(INVENTORY, (), 0.0)
    return c


def report(effects: list[Effect]) -> NodeReport:
    (e,) = [e for e in effects if isinstance(e, Publish) and isinstance(e.msg, NodeReport)]
    assert isinstance(e.msg, NodeReport)
    return e.msg


def delivered(effects: list[Effect]) -> list[Completion]:
    return [e.completion for e in effects if isinstance(e, Deliver)]


def test_registration_is_a_full_report_and_nothing_is_said_before_it():
    c = AgentCore(AgentConfig(node_id="n0", incarnation="inc"))
    assert c.heartbeat((), 0.0) == []
    r = report(c.register(INVENTORY, ("t1",), 0.5))
    assert (r.node_id, r.incarnation, r.inventory, r.envs, r.seq, r.full) == (
        "n0",
        "inc",
        INVENTORY,
        ("t1",),
        1,
        True,
    )
    assert report(c.heartbeat((), 1.0)).seq == 2


def test_an_older_epoch_is_refused_and_a_newer_one_adopted_from_an_answer(core: AgentCore):
    assert core.command(Reconcile(epoch=3), (), 1.0)
    assert core.epoch == 0  # a command's epoch is never adopted: only a report's answer
    core.answered(Ack(epoch=3, lease_s=3.0), 1.0, 1.0, 1.0)
    assert core.epoch == 3
    with pytest.raises(InvalidRequest, match="stale scheduler epoch 2 < 3"):
        core.command(dispatch("a", epoch=2), (), 1.0)
    with pytest.raises(InvalidRequest, match="stale"):
        core.command(Kill(action_id="a", epoch=1), (), 1.0)
    assert "a" not in core.active
    assert core.command(dispatch("a", epoch=4), (), 1.0) == [Run(dispatch("a", epoch=4))]
    assert core.epoch == 3
    core.answered(Ack(epoch=2, lease_s=3.0), 1.0, 1.0, 1.0)  # a deposed scheduler's answer
    assert core.epoch == 3


def test_a_dispatch_for_another_incarnation_is_refused(core: AgentCore):
    with pytest.raises(InvalidRequest, match="meant for incarnation old"):
        core.command(dispatch("a", incarnation="old"), (), 1.0)
    assert core.active == {}
    assert core.command(dispatch("b", incarnation=""), (), 1.0)  # unaddressed: any incarnation


def test_a_duplicate_dispatch_is_not_started_twice(core: AgentCore):
    assert len(core.command(dispatch("a"), (), 1.0)) == 1
    assert core.command(dispatch("a"), (), 1.1) == []  # running
    core.finished("a", ok(), 2.0)
    assert core.command(dispatch("a"), (), 2.1) == []  # in the outbox
    assert core.duplicates == 2
    assert core.progress.started == 1


def test_a_dispatch_on_busy_cores_is_refused_until_they_are_free(core: AgentCore):
    core.command(dispatch("a", cores=(0, 1)), (), 1.0)
    with pytest.raises(InvalidRequest, match=r"overlaps busy cores \[1\]"):
        core.command(dispatch("b", cores=(1, 2)), (), 1.1)
    assert (core.refused_overlaps, set(core.active)) == (1, {"a"})
    core.finished("a", ok(), 2.0)
    assert core.command(dispatch("b", cores=(1, 2)), (), 2.1)
    assert core.busy == {1, 2}


def test_a_completion_is_delivered_until_acked(core: AgentCore):
    core.command(dispatch("a"), (), 1.0)
    (c,) = delivered(core.finished("a", ok(), 2.0))
    assert (c.node_id, c.incarnation, c.action_id, c.attempt, c.outcome) == (
        "n0",
        "inc",
        "a",
        1,
        ok(),
    )
    assert core.resend(10.0) == []  # still in flight: no pile-up of sends
    core.undelivered("a")
    assert core.resend(2.5) == []  # not due yet
    assert delivered(core.resend(3.0)) == [c]
    assert core.resend(4.5) == []  # in flight again
    assert delivered(core.command(Reconcile(epoch=2), (), 4.6)) == [c]  # at once on reconcile
    r = report(core.heartbeat((), 4.7))
    assert [(x.action_id, x.cores) for x in r.running] == [("a", ())]
    core.delivered("a")
    core.undelivered("a")  # a late failure of another send changes nothing
    assert core.resend(100.0) == []
    assert report(core.heartbeat((), 100.0)).running == ()


def test_heartbeats_carry_progress(core: AgentCore):
    assert report(core.heartbeat((), 0.5)).progress == core.progress
    core.command(dispatch("a"), (), 1.0)
    core.command(dispatch("b", cores=(1,)), (), 2.0)
    core.finished("a", ok(), 3.0)
    p = report(core.heartbeat((), 9.0)).progress
    assert p is not None
    assert (p.started, p.finished, p.last_progress_at) == (2, 1, 3.0)
    r = report(core.heartbeat((), 9.0))
    assert {(x.action_id, x.cores) for x in r.running} == {("a", ()), ("b", (1,))}


def test_a_kill_reports_its_reason(core: AgentCore):
    core.command(dispatch("a"), (), 1.0)
    assert core.command(Kill(action_id="a", epoch=1), (), 1.1) == [Stop("a")]
    assert core.command(Kill(action_id="zz", epoch=1), (), 1.1) == []
    killed = Outcome(failure=ErrorKind.CANCELLED, exit_code=-9, started_at=1.0, finished_at=1.2)
    (c,) = delivered(core.finished("a", killed, 1.2))
    assert c.outcome.failure is ErrorKind.CANCELLED
    core.command(dispatch("b"), (), 2.0)
    core.command(Kill(action_id="b", epoch=1, reason=ErrorKind.INTERNAL), (), 2.1)
    (c,) = delivered(core.finished("b", Outcome(exit_code=137), 2.2))  # exited as it died
    assert (c.outcome.failure, c.outcome.detail) == (ErrorKind.INTERNAL, "killed on request")


def test_a_kill_before_the_run_began_means_it_never_runs(core: AgentCore):
    core.command(dispatch("a"), (), 1.0)
    assert core.not_started("a", 1.0) is None
    core.command(DropEnv(trajectory_id="t-a", epoch=1), (), 1.1)
    early = core.not_started("a", 1.2)
    assert early is not None
    assert (early.failure, early.exit_code) == (ErrorKind.CANCELLED, None)


def test_drop_env_cancels_what_runs_in_it(core: AgentCore):
    core.command(dispatch("a", tid="t"), (), 1.0)
    assert core.command(DropEnv(trajectory_id="t", epoch=1), (), 1.1) == [Drop("t")]
    (c,) = delivered(core.finished("a", Outcome(exit_code=-9), 1.2))
    assert c.outcome.failure is ErrorKind.CANCELLED


def test_idle_environments_expire_unless_busy(core: AgentCore):
    core.command(dispatch("a", tid="busy"), (), 1.0)
    envs = {"busy": 0.0, "idle": 0.0, "fresh": 15.0}
    effects = core.expire(envs, 20.0)
    expired = EnvExpired(node_id="n0", incarnation="inc", trajectory_id="idle")
    assert effects == [Drop("idle"), Publish(expired)]  # dropped before it is announced


def test_goodbye_is_the_last_word(core: AgentCore):
    core.command(dispatch("a"), (), 1.0)
    core.command(dispatch("b", cores=(1,)), (), 1.0)
    core.finished("b", ok(), 1.5)
    core.undelivered("b")  # not acked: the flush sends it again
    (draining,) = core.drain()
    assert isinstance(draining, Announce)
    assert (draining.msg.draining, draining.msg.started) == (True, None)
    assert core.drain() == []
    late = report(core.heartbeat((), 1.6))  # a draining agent still reports
    assert core.kill_all(ErrorKind.NODE_DIED) == [Stop("a")]
    assert delivered(core.flush(1.7)) == [core.unacked["b"].completion]
    assert core.flush(1.8) == []  # in flight: the shell waits for it
    (bye,) = core.goodbye(("t-a",))
    assert isinstance(bye, Announce)
    assert (bye.msg.draining, bye.msg.started, bye.msg.envs) == (False, ("a", "b"), ("t-a",))
    assert core.may_send(bye.msg)
    assert not core.may_send(late)  # a heartbeat made before the goodbye stays unsent
    after = [
        core.heartbeat((), 2.0),
        core.resend(9.0),
        core.expire({"t-a": 0.0}, 1e9),
        core.finished("a", ok(), 2.0),
        core.flush(2.0),
        core.goodbye(()),
        core.drain(),
    ]
    assert after == [[]] * len(after)
    with pytest.raises(InvalidRequest, match="has left"):
        core.command(Reconcile(epoch=9), (), 2.0)


def pipelined(aid: str, after: tuple[str, ...], cores: tuple[int, ...] = (0,)) -> Dispatch:
    return Dispatch(
        action=dispatch(aid, cores).action, cores=cores, epoch=1, incarnation="inc", after=after
    )


def runs(effects: list[Effect]) -> list[str]:
    return [e.dispatch.action.spec.action_id for e in effects if isinstance(e, Run)]


def test_a_pipelined_dispatch_waits_for_its_cores_and_starts_without_a_round_trip(
    core: AgentCore,
):
    assert runs(core.command(dispatch("a", (0, 1)), (), 0.0)) == ["a"]
    assert core.command(pipelined("b", ("a",)), (), 0.1) == []  # waits behind a
    assert core.command(pipelined("c", ("a",), (1,)), (), 0.1) == []
    reported = report(core.heartbeat((), 0.2)).running
    assert [(r.action_id, r.waiting) for r in reported] == [("a", False), ("b", True), ("c", True)]
    assert core.progress.started == 1
    ended = core.finished("a", ok(), 0.3)
    assert runs(ended) == ["b", "c"]  # both start the moment a ends, in arrival order
    assert [c.action_id for c in delivered(ended)] == ["a"]
    assert core.busy == {0, 1}
    assert core.progress.started == 3


def test_a_pipelined_dispatch_never_jumps_an_earlier_one_on_a_core(core: AgentCore):
    core.command(dispatch("a", (0,)), (), 0.0)
    core.command(dispatch("x", (1,)), (), 0.0)
    core.command(pipelined("b", ("a", "x"), (0, 1)), (), 0.0)
    core.command(pipelined("c", ("a",), (0,)), (), 0.0)
    assert runs(core.finished("a", ok(), 0.1)) == []  # b still waits for core 1; c behind b
    assert runs(core.finished("x", ok(), 0.2)) == ["b"]
    assert runs(core.finished("b", ok(), 0.3)) == ["c"]


def test_a_pipelined_dispatch_must_name_what_holds_its_cores(core: AgentCore):
    core.command(dispatch("a", (0,)), (), 0.0)
    core.command(dispatch("x", (1,)), (), 0.0)
    with pytest.raises(InvalidRequest, match="overlaps busy cores"):
        core.command(pipelined("b", ("a",), (0, 1)), (), 0.0)  # core 1 is x's
    with pytest.raises(InvalidRequest, match="overlaps busy cores"):
        core.command(dispatch("c", (0,)), (), 0.0)  # no ``after``: refused as before
    assert core.refused_overlaps == 2


def test_a_pipelined_dispatch_whose_cores_are_already_free_starts_at_once(core: AgentCore):
    core.command(dispatch("a", (0,)), (), 0.0)
    core.finished("a", ok(), 0.1)  # a ended before b arrived
    assert runs(core.command(pipelined("b", ("a",)), (), 0.2)) == ["b"]


def test_a_waiting_dispatch_killed_or_dropped_ends_at_once_never_run(core: AgentCore):
    core.command(dispatch("a", (0, 1)), (), 0.0)
    core.command(pipelined("b", ("a",), (0,)), (), 0.0)
    core.command(
        pipelined(
            "c",
            ("a",),
            (1,),
        ),
        (),
        0.0,
    )
    killed = core.command(Kill(action_id="b", epoch=1, reason=ErrorKind.CANCELLED), (), 0.1)
    (done,) = delivered(killed)
    assert (done.action_id, done.outcome.failure) == ("b", ErrorKind.CANCELLED)
    assert not [e for e in killed if isinstance(e, Stop)]  # nothing runs to stop
    dropped = core.command(DropEnv(trajectory_id="t-c", epoch=1), (), 0.2)
    assert [c.action_id for c in delivered(dropped)] == ["c"]
    assert runs(core.finished("a", ok(), 0.3)) == []
    assert core.busy == set()


def test_at_shutdown_a_waiting_dispatch_is_forgotten_so_it_is_queued_again(core: AgentCore):
    core.command(dispatch("a", (0,)), (), 0.0)
    core.command(pipelined("b", ("a",)), (), 0.0)
    assert core.kill_all(ErrorKind.NODE_DIED) == [Stop("a")]
    core.finished("a", ok(), 0.1)
    (bye,) = [e for e in core.goodbye(()) if isinstance(e, Announce)]
    assert bye.msg.started == ("a",)  # b never started: the scheduler queues it again


def test_a_refused_completion_gives_way_to_a_plain_failure_then_is_dropped(core: AgentCore):
    # Refused as invalid (e.g. an output nested past what the bus carries), it was resent as it
    # was for ever: the action never ended and the log flooded (review R2).
    core.command(dispatch("a"), (), 1.0)
    (c,) = delivered(core.finished("a", ok(), 2.0))
    core.refused("a", "malformed message: nested deeper than 32 levels " + "x" * 100_000)
    (again,) = delivered(core.resend(10.0))
    assert (again.action_id, again.attempt) == ("a", c.attempt)
    assert again.outcome.failure is ErrorKind.INTERNAL
    assert again.outcome.detail.startswith("the scheduler refused this action's completion: ")
    assert "nested deeper than 32 levels" in again.outcome.detail
    assert len(again.outcome.detail) <= MAX_DETAIL_CHARS  # fitted as any completion is
    assert again.outcome.finished_at == c.outcome.finished_at
    core.refused("a", "refused again")
    assert core.resend(100.0) == []
    assert "a" not in core.unacked
