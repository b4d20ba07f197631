"""Pipelining's plan: FCFS, fixed-size actions only, cores that free first, one grant a core."""

from __future__ import annotations

import math

import msgspec
import pytest

from services.scheduler.core.books import EnvPlacement
from services.scheduler.core.effects import Effect, EnvChanged, Finish, StartOnNode
from services.scheduler.core.pipeline import Holder, fixed_cores, plan
from services.scheduler.core.scheduler import CoreConfig, SchedulerCore
from services.scheduler.policies.base import Policy
from services.scheduler.policies.elastic import ElasticPolicy
from services.scheduler.policies.spec import make_policy
from tangram.contract import (
    ActionSpec,
    Completion,
    Demand,
    ErrorKind,
    ExecAction,
    Outcome,
    RunningAction,
    UnifiedAction,
)
from tangram.errors import InvalidRequest

from . import core_kit as kit


def action(aid: str, *choices: int) -> UnifiedAction:
    spec = ActionSpec(action_id=aid, job_id="j", trajectory_id="t", action=ExecAction(command="x"))
    demands = (Demand(resource="cpu", choices=choices),) if choices else ()
    return UnifiedAction(
        spec=spec, demands=demands, key_resource="cpu", env_memory_mb=64, submitted_at=0.0
    )


def test_only_an_action_with_one_core_count_is_pipelined():
    assert fixed_cores(action("a", 2)) == 2
    assert fixed_cores(action("b", 1, 2, 4)) is None
    assert fixed_cores(action("c")) is None


def test_grants_take_the_cores_that_free_first_and_name_their_holders():
    holders = [Holder(0, "x", 5.0), Holder(1, "y", 1.0), Holder(2, "z", 3.0)]
    grants = plan([action("a", 1), action("b", 2)], holders)
    assert [(g.action.spec.action_id, g.cores, g.after) for g in grants] == [
        ("a", (1,), ("y",)),
        ("b", (0, 2), ("z", "x")),
    ]


def test_the_first_action_that_cannot_be_pipelined_stops_the_pool():
    holders = [Holder(0, "x", 0.0), Holder(1, "y", 0.0)]
    assert plan([action("a", 3), action("b", 1)], holders) == []  # b never jumps a
    assert plan([action("a", 1, 2), action("b", 1)], holders) == []
    assert len(plan([action("a", 1), action("b", 1), action("c", 1)], holders)) == 2


# ----------------------------------------------------------------------------- in the core


def starts(effects: list[Effect]) -> list[StartOnNode]:
    return [e for e in effects if isinstance(e, StartOnNode)]


def pipelining_core(cores: int = 2, depth: int = 1) -> SchedulerCore:
    core = SchedulerCore(ElasticPolicy(), CoreConfig(pipeline=True, pipeline_depth=depth))
    core.node_report(kit.report(cores=cores), 0.0)
    return core


def test_a_full_node_gets_its_next_actions_on_busy_cores_one_per_core():
    core = pipelining_core()
    for i in range(5):
        core.enqueue(kit.action(f"a{i}", "t"), 0.0)
    first = starts(core.schedule(0.0))
    assert [(s.action.spec.action_id, s.cores, s.after) for s in first] == [
        ("a0", (0,), ()),
        ("a1", (1,), ()),
        ("a2", (0,), ("a0",)),  # the node is full: next on a busy core, behind its holder
        ("a3", (1,), ("a1",)),
    ]
    assert starts(core.schedule(0.2)) == []  # one waiting grant per core
    assert core.nodes["n0"].free == set()


def test_a_core_granted_next_passes_to_its_action_never_to_the_free_pool():
    core = pipelining_core()
    for i in range(4):
        core.enqueue(kit.action(f"a{i}", "t"), 0.0)
    runs = {s.action.spec.action_id: s for s in starts(core.schedule(0.0))}
    assert set(runs) == {"a0", "a1", "a2", "a3"}
    core.complete(kit.done(runs["a0"]), 1.0)
    node = core.nodes["n0"]
    assert node.free == set()  # core 0 went to a2, waiting behind a0
    assert node.next == {1: ["a3"]}
    core.enqueue(kit.action("a4", "t"), 1.0)
    (a4,) = starts(core.schedule(1.1))
    assert (a4.cores, a4.after) == ((0,), ("a2",))  # now a2 holds core 0
    for aid in ("a1", "a3", "a2", "a4"):
        core.complete(kit.done(runs.get(aid) or a4), 2.0)
    assert node.free == {0, 1}
    assert node.next == {}


def test_a_waiting_action_that_ends_leaves_its_core_to_the_holder():
    core = pipelining_core(cores=1)
    for i in range(2):
        core.enqueue(kit.action(f"a{i}", "t"), 0.0)
    a0, a1 = starts(core.schedule(0.0))
    assert a1.after == ("a0",)
    core.cancel("a1", 0.2)
    core.complete(kit.done(a1), 0.3)  # the node ended it before it ran
    node = core.nodes["n0"]
    assert (node.free, node.next) == (set(), {})  # a0 still holds core 0
    core.complete(kit.done(a0), 0.4)
    assert node.free == {0}


def test_an_elastic_action_is_never_pipelined():
    core = pipelining_core()
    core.enqueue(kit.action("a0", "t", cpus=2), 0.0)
    core.enqueue(kit.action("a1", "t", cpus=[1, 2]), 0.0)
    assert [s.action.spec.action_id for s in starts(core.schedule(0.0))] == ["a0"]
    assert starts(core.schedule(0.1)) == []  # a1 waits for the policy to size it


def test_deeper_pipelines_chain_grants_behind_the_last_one_on_each_core():
    core = pipelining_core(cores=1, depth=3)
    for i in range(5):
        core.enqueue(kit.action(f"a{i}", "t"), 0.0)
    runs = starts(core.schedule(0.0))
    assert [(s.action.spec.action_id, s.after) for s in runs] == [
        ("a0", ()),
        ("a1", ("a0",)),
        ("a2", ("a1",)),
        ("a3", ("a2",)),
    ]  # a4 waits: three grants wait on core 0 already
    node = core.nodes["n0"]
    assert node.next == {0: ["a1", "a2", "a3"]}
    core.cancel("a2", 0.1)
    core.complete(kit.done(runs[2]), 0.1)  # ended before it ran: out of the chain
    core.complete(kit.done(runs[0]), 0.2)  # a1 has the core now
    assert (node.free, node.next) == (set(), {0: ["a3"]})
    (a4,) = starts(core.schedule(0.3))
    assert a4.after == ("a3",)


def test_a_restarted_scheduler_rebuilds_who_is_next_on_each_core_from_the_report():
    """Its books come from Postgres (both runs 'running' on core 0); the node's first report
    says which one waits: when the holder ends, the core passes to it, not to the free pool."""
    core = SchedulerCore(ElasticPolicy(), CoreConfig(pipeline=True, pipeline_depth=1))
    holder, waiter = kit.action("h", "t"), kit.action("w", "t")
    holder, waiter = (msgspec.structs.replace(a, attempt=1) for a in (holder, waiter))
    core.restore_env(EnvPlacement("t", "j", "n0", "i0", 100))
    for a in (holder, waiter):
        core.restore_running(a, "n0", "i0", (0,), 0.0)
    running = (
        RunningAction(action_id="h", attempt=1, trajectory_id="t", cores=(0,)),
        RunningAction(action_id="w", attempt=1, trajectory_id="t", cores=(0,), waiting=True),
    )
    core.node_report(kit.report(cores=1, running=running), 0.0)
    node = core.nodes["n0"]
    assert node.next == {0: ["w"]}
    core.complete(kit.done(StartOnNode("n0", holder, (0,), "i0")), 1.0)
    assert (node.free, node.next) == (set(), {})  # w runs on core 0 now
    core.enqueue(kit.action("x", "t"), 1.0)
    (x,) = starts(core.schedule(1.1))
    assert (x.cores, x.after) == ((0,), ("w",))  # behind w, never beside it


# ----------------------------------------------------------------- depth from run times


def ran_for(run: StartOnNode, seconds: float, failure: ErrorKind | None = None) -> Completion:
    """The node's report that ``run`` ran for ``seconds`` (or ended with ``failure``)."""
    outcome = Outcome(exit_code=0, started_at=10.0, finished_at=10.0 + seconds)
    if failure is not None:
        outcome = Outcome(failure=failure, started_at=10.0, finished_at=10.0 + seconds)
    return msgspec.structs.replace(kit.done(run), outcome=outcome)


def short_pipelining_core() -> SchedulerCore:
    cfg = CoreConfig(pipeline=True, pipeline_depth=1, pipeline_depth_short=3, pipeline_short_s=0.01)
    core = SchedulerCore(ElasticPolicy(), cfg)
    core.node_report(kit.report(cores=1), 0.0)
    return core


def waiting_on_core_0(core: SchedulerCore) -> list[str]:
    return core.nodes["n0"].next.get(0, [])


def test_a_node_whose_actions_run_short_is_pipelined_deeper():
    core = short_pipelining_core()
    core.enqueue(kit.action("a0", "t"), 0.0)
    (a0,) = starts(core.schedule(0.0))
    assert core.nodes["n0"].run_s == math.inf  # nothing ended yet: the plain depth
    core.complete(ran_for(a0, 0.002), 0.1)
    for i in range(1, 8):
        core.enqueue(kit.action(f"a{i}", "t"), 0.1)
    runs = starts(core.schedule(0.2))
    assert [s.action.spec.action_id for s in runs] == ["a1", "a2", "a3", "a4"]
    assert waiting_on_core_0(core) == ["a2", "a3", "a4"]  # three wait, not one


def test_one_long_action_brings_the_node_back_to_the_plain_depth():
    core = short_pipelining_core()
    for i in range(2):
        core.enqueue(kit.action(f"s{i}", "t"), 0.0)
    s0, s1 = starts(core.schedule(0.0))
    core.complete(ran_for(s0, 0.002), 0.1)  # short: s1 holds the core now
    core.complete(ran_for(s1, 5.0), 0.2)  # long: the mean is far over 10 ms
    assert core.nodes["n0"].run_s > 0.01
    for i in range(4):
        core.enqueue(kit.action(f"a{i}", "t"), 0.2)
    runs = starts(core.schedule(0.3))
    assert [s.action.spec.action_id for s in runs] == ["a0", "a1"]  # one waits, as before
    for run in runs:  # a dozen short runs bring the mean down again
        core.complete(ran_for(run, 0.001), 0.4)
    assert core.nodes["n0"].run_s > 0.01
    shorts = 0
    while core.nodes["n0"].run_s > 0.01:
        core.enqueue(kit.action(f"b{shorts}", "t"), 0.5)
        for run in starts(core.schedule(0.5)):
            core.complete(ran_for(run, 0.001), 0.5)
            shorts += 1
    assert 10 <= shorts <= 30
    for i in range(4):
        core.enqueue(kit.action(f"c{i}", "t"), 0.6)
    starts(core.schedule(0.7))
    assert len(waiting_on_core_0(core)) == 3  # deep again


def test_a_failure_or_a_kill_is_no_run_time():
    core = short_pipelining_core()
    for i in range(3):
        core.enqueue(kit.action(f"a{i}", "t"), 0.0)
    a0, a1 = starts(core.schedule(0.0))
    core.complete(ran_for(a0, 0.0, failure=ErrorKind.INTERNAL), 0.1)
    core.cancel("a1", 0.1)
    core.complete(ran_for(a1, 0.0, failure=ErrorKind.CANCELLED), 0.2)
    assert core.nodes["n0"].run_s == math.inf


def test_a_bad_pipelining_setting_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch):
    from services.scheduler import config

    monkeypatch.setenv("TANGRAM_SCHEDULER_PIPELINE_SHORT_S", "-1")
    with pytest.raises(InvalidRequest, match="pipeline_short_s"):
        config.load()
    monkeypatch.setenv("TANGRAM_SCHEDULER_PIPELINE_SHORT_S", "0.02")
    monkeypatch.setenv("TANGRAM_SCHEDULER_PIPELINE_DEPTH_SHORT", "0")
    with pytest.raises(InvalidRequest, match="pipeline_depth_short"):
        config.load()
    monkeypatch.setenv("TANGRAM_SCHEDULER_PIPELINE_DEPTH_SHORT", "4")
    core = config.load()[1].core
    assert (core.pipeline_depth_short, core.pipeline_short_s) == (4, 0.02)


# ------------------------------------------------------------- new trajectories behind


def envs_opened(effects: list[Effect]) -> list[tuple[str, str]]:
    return [(e.trajectory_id, e.node_id) for e in effects if isinstance(e, EnvChanged)]


def busy_nodes(
    nodes: int = 1, policy: Policy | None = None, pipelining: bool = True, run_s: float = 0.002
) -> SchedulerCore:
    """Nodes ``n0``... of one core each whose actions ran ``run_s`` lately, running an action
    of trajectory ``t<n>`` there; one waiting grant per core at most."""
    cfg = CoreConfig(pipeline=pipelining, pipeline_depth=1, pipeline_depth_short=1)
    core = SchedulerCore(policy or ElasticPolicy(), cfg)
    for n in range(nodes):
        core.node_report(kit.report(node=f"n{n}", cores=1), 0.0)
        core.nodes[f"n{n}"].run_s = run_s
        core.enqueue(kit.action(f"run{n}", f"t{n}"), 0.0)
        assert len(starts(core.schedule(0.0))) == 1
    return core


def ends(core: SchedulerCore, aid: str, now: float) -> None:
    sent = core.running[aid].sent
    assert sent is not None
    core.complete(ran_for(sent, 0.002), now)  # short, as the node's actions ran


def test_a_new_trajectory_waits_behind_a_busy_core_not_for_the_pass_after_it_frees():
    """Its environment opens with the grant: a burst of new trajectories no longer pays a round
    trip per core (completion, pass, started record, dispatch) that known ones do not."""
    core = busy_nodes()
    core.enqueue(kit.action("u0", "u"), 0.1)
    core.enqueue(kit.action("u1", "u"), 0.1)
    effects = core.schedule(0.1)
    assert [(s.action.spec.action_id, s.cores, s.after) for s in starts(effects)] == [
        ("u0", (0,), ("run0",))
    ]  # one waiting grant per core: u1 waits in u's pool now
    assert envs_opened(effects) == [("u", "n0")]
    assert core.envs["u"].node_id == "n0"
    assert core.nodes["n0"].reserved_mb == 200  # t0's environment and u's
    ends(core, "run0", 0.2)
    assert core.nodes["n0"].free == set()  # the core went to u0
    (u1,) = starts(core.schedule(0.3))
    assert (u1.action.spec.action_id, u1.after) == ("u1", ("u0",))


def test_a_node_with_a_free_core_is_preferred_and_then_the_one_with_fewest_waiting():
    core = busy_nodes(nodes=3)
    ends(core, "run2", 0.1)  # n2 has a free core
    core.enqueue(kit.action("a", "ta"), 0.1)
    (a,) = starts(core.schedule(0.1))
    assert (a.node_id, a.after) == ("n2", ())
    core.enqueue(kit.action("run0-next", "t0"), 0.2)  # a grant waits on n0 now
    assert [s.node_id for s in starts(core.schedule(0.2))] == ["n0"]
    core.enqueue(kit.action("b", "tb"), 0.3)
    (b,) = starts(core.schedule(0.3))
    assert (b.node_id, b.after) == ("n1", ("run1",))
    core.enqueue(kit.action("c", "tc"), 0.4)
    (c,) = starts(core.schedule(0.4))
    assert (c.node_id, c.after) == ("n2", ("a",))
    core.enqueue(kit.action("d", "td"), 0.5)  # every core has its waiting grant
    assert starts(core.schedule(0.5)) == []
    assert core.waits["d"] == "waiting for 1 free core(s)"
    assert "td" not in core.envs


@pytest.mark.parametrize(
    "why",
    [
        "no pipelining",
        "a choice of cores",
        "its own queue timeout",
        "long actions on the node",
        "a per-pool policy",
        "no memory for it",
    ],
)
def test_a_new_trajectory_is_placed_behind_only_where_pipelining_would_take_it(why: str):
    policy = make_policy("trajectory-static:1") if why == "a per-pool policy" else None
    run_s = 0.5 if why == "long actions on the node" else 0.002
    core = busy_nodes(policy=policy, pipelining=why != "no pipelining", run_s=run_s)
    cpus: int | list[int] = [1, 2] if why == "a choice of cores" else 1
    mem = 950 if why == "no memory for it" else 100  # of 1000 MiB, 100 booked by t0
    act = kit.action("u0", "u", cpus=cpus, mem=mem)
    if why == "its own queue timeout":
        act = kit.action("u0", "u", queue_timeout_s=60.0)
    core.enqueue(act, 0.1)
    assert starts(core.schedule(0.1)) == []
    assert "u" not in core.envs
    assert core.waits["u0"].startswith("waiting for")
    ends(core, "run0", 0.2)
    if why not in ("a per-pool policy", "no memory for it"):  # on the free core, as before
        assert [s.action.spec.action_id for s in starts(core.schedule(0.3))] == ["u0"]


def test_an_action_with_its_own_queue_timeout_is_never_pipelined_and_times_out_queued():
    """A grant waiting on a node is out of the queue, where the timeout is kept: behind a
    long action it would outlive it. The default bound (no timeout of its own) is no such
    promise: the action after it is pipelined as before."""
    core = busy_nodes()
    core.enqueue(kit.action("k0", "t0", queue_timeout_s=0.3), 0.1)
    core.enqueue(kit.action("k1", "t0"), 0.1)
    assert starts(core.schedule(0.1)) == []  # FCFS: k1 does not jump k0
    ended = core.tick(0.5)
    assert [
        (f.result.action_id, f.result.error.kind)
        for f in ended
        if isinstance(f, Finish) and f.result.error
    ] == [("k0", ErrorKind.QUEUE_TIMEOUT)]
    (k1,) = starts(core.schedule(0.6))
    assert (k1.action.spec.action_id, k1.after) == ("k1", ("run0",))
