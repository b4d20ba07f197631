"""Node failures in the simulator: role-only recovery against restarting everything.

A run is a sequence of synchronous RL iterations, each one batch of trajectories (the next starts
when the last trajectory of the previous one ends), driven through the scheduler's own core
(``fault_pools``). Failures strike by progress, as robustrl §7 injects them: one at a uniformly
random point within each tenth of the run's actions (``plan``), on a random node that is up.

How a failure plays out depends on the ``Recovery``:

- **role-only** (Tangram, robustrl §5): the node stops at once; the scheduler learns of it only
  after the detection delay, granting it work meanwhile. Then ``SchedulerCore.node_failed``
  decides, as live: what may have started ends ``node_died``, a grant made after the node's start
  lease ran out goes back to the queue; the environments it held are lost. The node is back,
  empty, after its restart time. Every other node keeps working throughout.
- **restart-all** (the ByteRobust baseline): at detection the whole job stops and restarts: after
  the job's restart time a new scheduler, nodes with empty GPUs, every environment lost; what any
  node was running is lost and redone, and so is any LLM generation under way (the rollout
  engines restart too). ``rollback`` also loses what the iteration completed (a checkpoint per
  RL step, as robustrl describes ByteRobust); without it completed actions are kept.

The client's side is the same in both: an action that ended ``node_died`` or
``environment_lost`` is submitted again at once, after its trajectory re-runs its earlier
commands in a fresh environment (the model's outputs are kept, so no generation is redone).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from services.scheduler.core.effects import Effect, Finish, StartOnNode
from services.scheduler.sim.fault_pools import Pools
from services.scheduler.sim.mopd_workload import Config, workload
from services.scheduler.sim.traces import CPU, GPU, CodingConfig, Step, Trace, Trajectory, ai_coding
from tangram.contract import ErrorKind

# Measured on the live mesh (README "When things fail"): failed 4.9-5.1 s after a SIGSTOP.
DETECT_S = 5.0
# robustrl §7.3: a rollout machine is replaced in 119 s (scheduling 30 s, container 30 s,
# inference engine 49 s, weight sync 10 s); the repo has no machine-replacement figure.
NODE_RESTART_S = 119.0
# robustrl §7.3 (Figure 14): an RL task restart takes over 300 s.
JOB_RESTART_S = 300.0
LEASE_S = 3.0  # the agents' start lease (tangram.health.HealthConfig.lease_s)

SUBMIT, COMPLETE, DETECT, UP = range(4)
RETRIED = (ErrorKind.NODE_DIED, ErrorKind.ENVIRONMENT_LOST)


@dataclass(frozen=True, slots=True)
class Recovery:
    """What a node failure costs and how far it reaches."""

    name: str
    restart_all: bool = False
    detect_s: float = DETECT_S
    node_restart_s: float = NODE_RESTART_S  # role-only: the failed node is back after this
    job_restart_s: float = JOB_RESTART_S  # restart-all: the whole job is back after this
    lease_s: float = LEASE_S
    rollback: bool = False  # restart-all: the iteration's completed work is lost too


ROLE_ONLY = Recovery("role_only")
RESTART_ALL = Recovery("restart_all", restart_all=True)
RESTART_ALL_ROLLBACK = Recovery("restart_all_rollback", restart_all=True, rollback=True)


@dataclass(frozen=True, slots=True)
class Failure:
    after: int  # useful actions completed when it strikes
    node: int  # index of the node that fails (the next one up, if that one is down)


def plan(total: int, failures: int, nodes: int, seed: int) -> tuple[Failure, ...]:
    """One failure at a uniformly random point within each ``1/failures`` of the run's
    ``total`` actions, on a uniformly random node (robustrl §7: one per 10% of the steps)."""
    rng = np.random.default_rng(seed)
    width = total / max(failures, 1)
    return tuple(
        Failure(int(k * width + rng.uniform(0.0, width)), int(rng.integers(nodes)))
        for k in range(failures)
    )


@dataclass(slots=True)
class Attempt:
    """One submission of one step: where it ran and how it ended."""

    key: str
    trajectory_id: str
    step: int
    replay: bool  # re-run to rebuild a lost environment: not useful work in itself
    submitted_at: float
    node_id: str = ""
    started_at: float | None = None
    ended_at: float | None = None
    units: int = 0
    end: str = ""  # "ok", "node_died", "environment_lost", "restart" (the job restarted)
    requeued: int = 0  # granted to a dead node and queued again by the core


@dataclass(slots=True)
class _Traj:
    t: Trajectory
    done: int = 0  # steps completed
    replay: list[int] = field(default_factory=list)  # steps to re-run before the next one
    key: str | None = None  # the attempt in flight (queued or running)
    resume_at: float = 0.0  # after a job restart: its step waits for the generation redone

    @property
    def finished(self) -> bool:
        return self.done == len(self.t.steps)


@dataclass
class FaultResult:
    recovery: str
    makespan_s: float = 0.0
    actions: int = 0  # steps completed, each counted once
    failures: int = 0
    restarts: int = 0  # whole-job restarts
    wasted_unit_s: float = 0.0  # execution thrown away by failures (units x seconds)
    down_node_s: float = 0.0  # node-seconds a node was failed, detecting or restarting
    restore_s: float = 0.0  # GPU state restored from the host tier
    nodes: int = 0
    attempts: list[Attempt] = field(default_factory=list)

    def ended(self, how: str) -> int:
        """Attempts that ended ``how`` (``node_died``, ``environment_lost``, ``restart``)."""
        return sum(a.end == how for a in self.attempts)

    def requeued(self) -> int:
        return sum(a.requeued for a in self.attempts)

    def replays(self) -> int:
        return sum(a.replay for a in self.attempts)

    def summary(self, fault_free_s: float) -> dict[str, float | int | str]:
        """ETTR: the fault-free run's makespan over this one's (the useful share of the wall
        time); ``ettr_paper`` counts redone work as effective, as robustrl §7.2 does, and only
        the node-time lost to detection and restarts as not."""
        span = max(self.makespan_s, 1e-9)
        return {
            "ettr": round(fault_free_s / span, 4),
            "ettr_paper": round(1.0 - self.down_node_s / (self.nodes * span), 4),
            "goodput_actions_per_s": round(self.actions / span, 4),
            "makespan_s": round(self.makespan_s, 1),
            "failures": self.failures,
            "job_restarts": self.restarts,
            "attempts_node_died": self.ended("node_died"),
            # a zero-cost signal: the trajectory learns its environment is gone and rebuilds it
            "attempts_environment_lost": self.ended("environment_lost"),
            "attempts_lost_in_restart": self.ended("restart"),
            "attempts_requeued": self.requeued(),
            "replayed_actions": self.replays(),
            "wasted_unit_s": round(self.wasted_unit_s, 1),
            "down_node_s": round(self.down_node_s, 1),
            "gpu_restore_s": round(self.restore_s, 1),
        }


class FaultRun:
    """One run of ``iterations`` under ``recovery`` with ``failures`` injected."""

    def __init__(
        self,
        iterations: Sequence[Trace],
        make_pools: Callable[[], Pools],
        recovery: Recovery = ROLE_ONLY,
        failures: Sequence[Failure] = (),
    ) -> None:
        self.iterations = [[t for t in trace if t.steps] for trace in iterations]
        self.make_pools = make_pools
        self.pools = make_pools()
        self.nodes = self.pools.node_ids()
        self.recovery = recovery
        self.failures = list(failures)
        self.result = FaultResult(recovery.name, nodes=len(self.nodes))
        self._events: list[tuple[float, int, int, int, str]] = []  # t, seq, epoch, kind, arg
        self._seq = 0
        self._epoch = 0  # a job restart makes every pending event stale
        self._attempts: dict[str, Attempt] = {}
        self._inflight: dict[str, StartOnNode] = {}
        self._on_dead: dict[str, str] = {}  # attempt granted to a dead node -> that node
        self._keys = 0
        self._dead: dict[str, tuple[str, float]] = {}  # node -> (incarnation, failed at)
        self._trajs: dict[str, _Traj] = {}
        self._iteration = 0
        self._left = 0
        self._struck = 0
        self._revivals = 0
        self._restore_before = 0.0  # restores of the pools a job restart replaced

    def run(self) -> FaultResult:
        self._begin(0, 0.0)
        now = 0.0
        while not self._over(now):
            if not self._events:
                raise RuntimeError(f"{self._left} trajectories never finished: the run is stuck")
            now = self._events[0][0]
            while self._events and self._events[0][0] == now:
                _, _, epoch, kind, arg = heapq.heappop(self._events)
                if epoch == self._epoch:
                    self._handle(kind, arg, now)
            if not self.pools.full():
                self._apply(self.pools.core.schedule(now), now)
        return self._close(now)

    def _over(self, now: float) -> bool:
        """The iteration is done: start the next, or the run is over."""
        if self._left:
            return False
        if self._iteration + 1 == len(self.iterations):
            return True
        self._begin(self._iteration + 1, now)
        return False

    def _close(self, now: float) -> FaultResult:
        r = self.result
        r.makespan_s = now
        r.down_node_s += sum(now - since for _, since in self._dead.values())
        r.restore_s = self._restore_before + self.pools.restore_s
        r.attempts = list(self._attempts.values())
        return r

    def _push(self, t: float, kind: int, arg: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, self._epoch, kind, arg))

    def _handle(self, kind: int, arg: str, now: float) -> None:
        handlers = (self._submit, self._complete, self._detect, self._up)
        handlers[kind](arg, now)

    # ------------------------------------------------------------------ trajectories

    def _begin(self, iteration: int, now: float) -> None:
        self._iteration = iteration
        self._trajs = {t.trajectory_id: _Traj(t) for t in self.iterations[iteration]}
        self._left = len(self._trajs)
        for st in self._trajs.values():
            self._push(now + st.t.start_s + st.t.steps[0].gap_s, SUBMIT, st.t.trajectory_id)

    def _submit(self, tid: str, now: float) -> None:
        st = self._trajs[tid]
        idx = st.replay[0] if st.replay else st.done
        key = f"{tid}#{idx}.{self._keys}"
        self._keys += 1
        st.key = key
        self._attempts[key] = Attempt(key, tid, idx, bool(st.replay), now)
        self.pools.core.enqueue(self.pools.action(key, tid, st.t.steps[idx], now), now)

    def _complete(self, key: str, now: float) -> None:
        e = self._inflight.pop(key, None)
        if e is None:
            return  # its node died: it never completes
        self.pools.end(e, now)
        a = self._attempts[key]
        a.end, a.ended_at = "ok", now
        st = self._trajs[a.trajectory_id]
        st.key = None
        if a.replay:
            st.replay.pop(0)
            # no generation before a replayed command, nor before the step it was redone for
            self._push(now if st.replay else max(now, st.resume_at), SUBMIT, a.trajectory_id)
            return
        st.done += 1
        self.result.actions += 1
        if not st.finished:
            self._push(now + st.t.steps[st.done].gap_s, SUBMIT, a.trajectory_id)
        else:
            self._left -= 1
            self.pools.close(a.trajectory_id, now)
        self._strike(now)

    def _retry(self, key: str, why: str, now: float) -> None:
        """The client sees the attempt end ``why`` and submits its step again at once."""
        a = self._attempts[key]
        a.end, a.ended_at = why, now
        self._inflight.pop(key, None)
        st = self._trajs[a.trajectory_id]
        st.key = None
        self._rebuild(st)
        self._push(now, SUBMIT, a.trajectory_id)

    @staticmethod
    def _rebuild(st: _Traj) -> None:
        """Its environment is gone: re-run its earlier commands first (CPU steps only)."""
        st.replay = [k for k in range(st.done) if st.t.steps[k].pool == CPU]

    # ------------------------------------------------------------------ the core's effects

    def _apply(self, effects: list[Effect], now: float) -> None:
        for e in effects:
            if isinstance(e, StartOnNode):
                self._started(e, now)
            elif isinstance(e, Finish) and e.result.error is not None:
                kind = e.result.error.kind
                if kind not in RETRIED:
                    raise RuntimeError(f"{e.action.spec.action_id} ended {kind}: not simulated")
                self._retry(e.action.spec.action_id, str(kind), now)

    def _started(self, e: StartOnNode, now: float) -> None:
        key = e.action.spec.action_id
        a = self._attempts[key]
        a.node_id, a.started_at, a.units = e.node_id, now, len(e.units)
        if e.node_id in self._dead:
            self._on_dead[key] = e.node_id  # it never runs; the detector's verdict decides
            return
        step = self._trajs[a.trajectory_id].t.steps[a.step]
        self._inflight[key] = e
        self._push(now + self.pools.start(e, step, now), COMPLETE, key)

    # ------------------------------------------------------------------ failures

    def _strike(self, now: float) -> None:
        """Inject the next failure once progress reaches it."""
        while self._struck < len(self.failures):
            f = self.failures[self._struck]
            if self.result.actions < f.after:
                return
            self._struck += 1
            node = self._victim(f.node)
            if node is not None:
                self._fail(node, now)

    def _victim(self, index: int) -> str | None:
        n = len(self.nodes)
        up = [self.nodes[(index + j) % n] for j in range(n)]
        return next((node for node in up if node not in self._dead), None)

    def _fail(self, node: str, now: float) -> None:
        for key, e in list(self._inflight.items()):
            if e.node_id == node:
                self._waste(key, now)
                del self._inflight[key]
        self._dead[node] = (self.pools.die(node, now), now)
        self.result.failures += 1
        self._push(now + self.recovery.detect_s, DETECT, node)

    def _waste(self, key: str, now: float) -> None:
        a = self._attempts[key]
        if a.started_at is not None:
            self.result.wasted_unit_s += (now - a.started_at) * a.units

    def _detect(self, node: str, now: float) -> None:
        if self.recovery.restart_all:
            self._restart_all(now)
            return
        incarnation, _ = self._dead[node]
        why = "declared failed (simulated)"
        self._apply(
            self.pools.core.node_failed(node, incarnation, now, why, self.recovery.lease_s), now
        )
        for key in [k for k, n in self._on_dead.items() if n == node]:
            del self._on_dead[key]
            self._attempts[key].requeued += not self._attempts[key].end  # not ended: queued
        self._push(now + self.recovery.node_restart_s, UP, node)

    def _up(self, node: str, now: float) -> None:
        _, since = self._dead.pop(node)
        self.result.down_node_s += now - since
        self._revivals += 1
        self.pools.revive(node, f"sim-{self._revivals}", now)

    def _restart_all(self, now: float) -> None:
        """Everything stops now and is back after the job's restart time, empty."""
        resume = now + self.recovery.job_restart_s
        self._epoch += 1
        self.result.restarts += 1
        for node in self.nodes:
            since = self._dead[node][1] if node in self._dead else now
            self.result.down_node_s += resume - since
        self._dead.clear()
        self._on_dead.clear()
        for key in list(self._inflight):
            self._waste(key, now)
        self._inflight.clear()
        for st in self._trajs.values():
            if st.key is not None:
                a = self._attempts[st.key]
                a.end, a.ended_at = "restart", now
        self._restore_before += self.pools.restore_s
        self.pools = self.make_pools()
        if self.recovery.rollback:
            self.result.actions -= sum(st.done for st in self._trajs.values())
            self._begin(self._iteration, resume)
            return
        for st in self._trajs.values():
            if not st.finished:
                self._resume(st, resume)

    def _resume(self, st: _Traj, t: float) -> None:
        """After a job restart: an action in flight is redone in a fresh environment; an LLM
        generation under way is redone from its start."""
        tid = st.t.trajectory_id
        in_flight = st.key is not None or bool(st.replay)
        st.key = None
        if st.done == 0 and not in_flight:
            self._push(t + st.t.start_s + st.t.steps[0].gap_s, SUBMIT, tid)
            return
        self._rebuild(st)
        st.resume_at = t if in_flight else t + st.t.steps[st.done].gap_s
        self._push(t if st.replay else st.resume_at, SUBMIT, tid)


def run(
    iterations: Sequence[Trace],
    make_pools: Callable[[], Pools],
    recovery: Recovery = ROLE_ONLY,
    failures: Sequence[Failure] = (),
) -> FaultResult:
    """Run ``iterations`` through the pools ``make_pools`` builds (again at each job restart)."""
    return FaultRun(iterations, make_pools, recovery, failures).run()


# ---------------------------------------------------------------------- workloads


def coding(iterations: int, batch: int, seed: int) -> list[Trace]:
    """AI coding (``traces.ai_coding``): one seeded batch per RL iteration."""
    return [_tagged(i, ai_coding(CodingConfig(batch=batch), seed + i)) for i in range(iterations)]


def mopd(cfg: Config, iterations: int) -> list[Trace]:
    """MOPD (``mopd_workload``, Figure 8(b)'s): each trajectory ends in one teacher call on the
    GPU pool, arriving when its generation ends; one seeded batch per RL iteration."""
    out: list[Trace] = []
    for i in range(iterations):
        calls = workload(replace(cfg, seed=cfg.seed + i))
        trace = [
            Trajectory(
                c.call_id,
                0.0,
                (
                    Step(
                        c.at,
                        c.teacher.name,
                        c.teacher.dops,
                        c.teacher.t1_s,
                        cfg.parallel,
                        True,
                        GPU,
                    ),
                ),
            )
            for c in calls
        ]
        out.append(_tagged(i, trace))
    return out


def _tagged(iteration: int, trace: Trace) -> Trace:
    return [replace(t, trajectory_id=f"i{iteration}-{t.trajectory_id}") for t in trace]
