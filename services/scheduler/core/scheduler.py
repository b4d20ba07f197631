"""The scheduler's pure core: the single owner of allocation bookkeeping.

No I/O and no clock of its own: every method takes ``now`` and returns effects for the shell
(dispatch, finish, kill, drop env, record env). The live service and the simulator drive this
same code. Pools are per node (§5.2): a trajectory's environment lives on one node, chosen at
its first action by CPU-memory load balance, and all its actions run there. Each pool is
FCFS; the policy decides how many of the head actions start now and with how many cores. A
policy that keeps state per pool (``PerPool``: trajectory-static reservations) gets an instance
per node, told when a trajectory's environment ends and dropped with its node; a policy that
``Learns`` is told the execution time of every action that succeeded.

A cancelled running action ends within ``kill_grace_s`` whatever becomes of its completion: the
core sends the kill, and if the node has not confirmed it by then (its completion), the action
ends ``cancelled`` at that deadline. Its cores stay booked until the node shows the process is
over -- its completion arrives, or its report no longer lists it, or the node is lost -- because a
process that ignores the kill may still be running on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import chain
from typing import Annotated

import msgspec

from services.scheduler.core import env_tiers, pipeline, unlisted, views
from services.scheduler.core.books import Dispatched, EnvPlacement, Node
from services.scheduler.core.capacity import impossible, reclaim_plan
from services.scheduler.core.effects import (
    DropEnvOnNode,
    Effect,
    EnvChanged,
    Finish,
    KillOnNode,
    StartOnNode,
    completed,
    verdict,
)
from services.scheduler.core.gpu_sched import GpuOrder, GpuScheduler, new_facts
from services.scheduler.core.gpu_share import GPU
from services.scheduler.core.pending import HOMELESS, Pending
from services.scheduler.core.placement import pick_cores
from services.scheduler.policies.base import Learns, MinPolicy, PerPool, Policy, Waiting
from tangram.contract import (
    ActionResult,
    Allocation,
    Completion,
    ErrorKind,
    Inventory,
    NodeLeaving,
    NodeReport,
    RunningAction,
    ServiceSpec,
    ServiceState,
    UnifiedAction,
)

RECENT_LIMIT = 200_000  # finished action ids remembered (at least) so late duplicates are harmless
DEPARTED_LIMIT = 10_000  # node incarnations remembered as gone, so their late reports are ignored
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
RUN_WEIGHT = 0.2  # of a completed action's run time in its node's running mean (Node.run_s)
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]


class CoreConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The core's timing and limits (part of ``SchedulerConfig``, same env var names)."""

    node_timeout_s: PositiveFloat = 5.0
    # the core itself declares a node lost after ``node_timeout_s`` without a report (the
    # simulator); the live scheduler leaves that to its health detector (services/scheduler/
    # health.py), which tells a pause or a broker outage from a death
    node_timeouts: bool = True
    # how long a dispatch may go unreported before it is redone (if the node's report shows it
    # read and refused it) or sent once more (if the node has not read it yet)
    dispatch_grace_s: PositiveFloat = 3.0
    # how long a cancelled running action may wait for its node's confirmation before it ends
    kill_grace_s: PositiveFloat = 5.0
    lookahead: NonNegInt = 64  # waiting actions per pool shown to the policy past the block
    gpu_order: GpuOrder = "fcfs"  # infer actions' candidate order: fcfs or hrrs (plexrl Alg. 1)
    prepare_timeout_s: PositiveFloat = 120.0  # a registration waits this long for GPU nodes
    prepare_retry_s: PositiveFloat = 10.0  # re-ask a GPU node that reports a service missing
    # the longest an action that sets no ``queue_timeout_s`` waits before ``queue_timeout``
    # (None: no bound; the simulator's, whose virtual queues are the thing measured)
    queue_timeout_s: PositiveFloat | None = 1800.0
    # grant a full node's next fixed-size actions on its busy cores (see pipeline); off in the
    # simulator, whose virtual agents start what they get at once
    pipeline: bool = False
    pipeline_depth: Annotated[int, msgspec.Meta(ge=1)] = 2  # waiting grants per core at most
    # ... and this many while the node's recent actions ran under ``pipeline_short_s`` each
    # (their running mean, see Node.run_s): a short holder frees its core within the round
    # trip that refills it, so two waiting grants left its cores idle (bench.throughput:
    # ~770 -> ~830 no-op actions/s at depth 6 on this 2-core machine). One long action lifts
    # the mean over the bound at once, and the node keeps to ``pipeline_depth`` again until
    # a dozen short ones bring it down: what it may delay is then bounded as before. The
    # price grows with the depth: a node killed outright ends every grant waiting on it
    # ``node_died`` (see pipeline), up to ``pipeline_depth_short`` per core of short actions.
    pipeline_depth_short: Annotated[int, msgspec.Meta(ge=1)] = 6
    pipeline_short_s: Annotated[float, msgspec.Meta(ge=0)] = 0.01


@dataclass
class _Pass:
    """Scratch state of one scheduling pass."""

    waiting: dict[str, list[UnifiedAction]] = field(default_factory=dict)
    need: dict[str, int] = field(default_factory=dict)  # sum of minimums offered per node
    blocked: set[str] = field(default_factory=set)  # an offered action did not fit at minimum
    extra: dict[str, int] = field(default_factory=dict)  # lookahead offered past the block
    full: set[str] = field(default_factory=set)  # lookahead exhausted
    reserved: set[str] = field(default_factory=set)  # held for a blocked new trajectory
    placed: dict[str, str] = field(default_factory=dict)  # trajectory -> node, this pass
    placed_mb: dict[str, int] = field(default_factory=dict)  # env memory placed per node
    unplaced_blocked: bool = False
    follow: list[str] = field(default_factory=list)  # queued actions of trajectories placed
    recheck: list[str] = field(default_factory=list)  # checked against a placement of this pass
    restoring: set[str] = field(default_factory=set)  # envs on disk counted in placed_mb


class SchedulerCore:
    """Queue, nodes, environments and running actions; decisions via a :class:`Policy`."""

    def __init__(self, policy: Policy | None = None, cfg: CoreConfig | None = None) -> None:
        self.policy = policy or MinPolicy()
        self.cfg = cfg or CoreConfig()
        self.nodes: dict[str, Node] = {}
        self.envs: dict[str, EnvPlacement] = {}
        self.gone_envs: dict[str, str] = {}  # trajectory -> why its environment is gone
        self.waits: dict[str, str] = {}  # queued action -> why it cannot be placed (status, log)
        self.queue: dict[str, UnifiedAction] = {}  # FCFS by insertion
        self.pending = Pending()  # the queue's index: what a pass must look at
        self.running: dict[str, Dispatched] = {}
        # cancelled actions ended at their kill deadline whose cores the node may still use
        self.killed: dict[str, Dispatched] = {}
        self.recent: dict[str, None] = {}
        self.finished = 0  # actions ended so far, each once (the drain rate, see pressure)
        self.departed: dict[tuple[str, str], None] = {}  # (node, incarnation) left or replaced
        self.not_before = 0.0
        self.epoch = 0  # the shell's lead epoch: a node's read mark counts in it alone
        self.issued = 0  # dispatches granted so far (Dispatch.issued)
        self._views: dict[str, Waiting] = {}  # the policy's view of each queued action
        self._pools: dict[str, PerPool] = {}  # node -> its own instance of a per-pool policy
        # the optional hooks, checked once (the policy's class does not change)
        self._learns = self.policy if isinstance(self.policy, Learns) else None
        self._per_pool = self.policy if isinstance(self.policy, PerPool) else None
        # A policy that only admits what fits at minimum needs no view past the block.
        self._lookahead = self.cfg.lookahead if self.policy.lookahead else 0
        # A shared policy has nothing to decide for a node with no free core; a per-pool one
        # (reservations) is still shown its pool.
        self._idle_policy_when_full = self._per_pool is None
        c = self.cfg
        self.gpu = GpuScheduler(self, c.gpu_order, c.prepare_timeout_s, c.prepare_retry_s)

    # ------------------------------------------------------------------ intake

    def known(self, action_id: str) -> bool:
        return action_id in self.queue or action_id in self.running or action_id in self.recent

    def enqueue(self, action: UnifiedAction, now: float) -> list[Effect]:
        """Queue an action (idempotent by action_id)."""
        if self.known(action.spec.action_id):
            return []
        self.queue[action.spec.action_id] = action
        self._pend(action)
        return []

    def requeue_first(self, action: UnifiedAction) -> None:
        """Put ``action`` back at the head of the queue (its dispatch never ran)."""
        aid = action.spec.action_id
        self.queue = {aid: action, **self.queue}
        self._pend(action, first=True)

    def _pend(self, action: UnifiedAction, first: bool = False) -> None:
        limit = self._queue_limit(action)
        due = None if limit is None else action.submitted_at + limit
        lane = self._lane(action)
        self.pending.add(action.spec.action_id, action.spec.trajectory_id, lane, due, first)

    def _queue_limit(self, action: UnifiedAction) -> float | None:
        return action.spec.queue_timeout_s or self.cfg.queue_timeout_s

    def unqueue(self, action_id: str) -> UnifiedAction | None:
        """Take an action out of the queue (None: it was not queued)."""
        action = self.queue.pop(action_id, None)
        if action is not None:
            self.pending.remove(action_id)
        return action

    def _lane(self, action: UnifiedAction) -> str | None:
        """The pending lane: None for a GPU call, else where its environment is (or none)."""
        if action.key_resource == GPU:
            return None
        env = self.envs.get(action.spec.trajectory_id)
        return HOMELESS if env is None else env.node_id

    def restore_running(
        self,
        action: UnifiedAction,
        node_id: str,
        incarnation: str,
        cores: tuple[int, ...],
        now: float,
    ) -> None:
        """An action Postgres says is running; it stays unconfirmed until its node reports."""
        self.running[action.spec.action_id] = Dispatched(
            action, node_id, incarnation, cores, now, restored=True
        )

    def restore_env(self, env: EnvPlacement) -> None:
        self.envs[env.trajectory_id] = env
        self.pending.move(env.trajectory_id, env.node_id)

    def register_service(self, spec: ServiceSpec, now: float) -> list[Effect]:
        """Register (or update) a model service; ``ServiceSettled`` answers it later."""
        return self.gpu.register(spec, now)

    def restore_services(self, specs: list[ServiceSpec]) -> None:
        self.gpu.restore(specs)

    def service_states(self) -> tuple[ServiceState, ...]:
        return self.gpu.states()

    def hold_until(self, t: float) -> None:
        """Make no decisions before ``t`` (node agents are reporting after a restart)."""
        self.not_before = t

    # ------------------------------------------------------------------ nodes

    def node_report(self, report: NodeReport, now: float) -> list[Effect]:
        """Register a node or take its heartbeat, and reconcile what it runs with our books.

        A new incarnation of a known node means the old one died: what ran there and the
        environments it held are lost. A late report from an incarnation that left or was
        replaced changes nothing (it must not bring a ghost of the node back).
        """
        if (report.node_id, report.incarnation) in self.departed:
            return []
        node = self.nodes.get(report.node_id)
        effects: list[Effect] = [*env_tiers.adopt(self.envs, report)]
        if node is not None and node.incarnation != report.incarnation:
            self._depart(node)
            effects += self._node_lost(node, now, "node agent restarted")
            node = None
        if node is None:
            node = self._add_node(report, now)
            effects += self._drop_stale(node, now)
            self._restore_chains(node, report)
        node.last_seen = now
        if report.full:
            node.envs_seen = frozenset(report.envs)
        effects += self._reconcile(node, report, now)
        effects += env_tiers.sync(node, self.envs, report, self.running)
        if node.gpu is not None:
            effects += self.gpu.on_report(node, report, now)
        return effects

    def _add_node(self, report: NodeReport, now: float) -> Node:
        inv: Inventory = report.inventory
        if inv.kind == GPU:  # its units are GPU indices, its facts kept beside them
            facts = new_facts(inv)
            node = Node(report.node_id, report.incarnation, {}, 0, set(facts.gpus), now)
            node.kind, node.gpu = GPU, facts
            self.nodes[node.node_id] = node
            self.pending.all_unchecked = True  # what can ever fit where may have changed
            return node
        numa = {n.numa_node: tuple(n.cores) for n in inv.numa}
        all_cores = {c for cs in numa.values() for c in cs}
        node = Node(report.node_id, report.incarnation, numa, inv.memory_mb, all_cores, now)
        node.idle_envs_hold_memory = inv.idle_envs_hold_memory
        self.nodes[node.node_id] = node
        self.pending.all_unchecked = True
        return node

    def _drop_stale(self, node: Node, now: float) -> list[Effect]:
        """Books restored from Postgres for this node: keep the current incarnation's only."""
        effects: list[Effect] = []
        busy = {
            r.action.spec.trajectory_id
            for r in self.running.values()
            if r.node_id == node.node_id and r.incarnation == node.incarnation
        }
        for env in [e for e in self.envs.values() if e.node_id == node.node_id]:
            if env.incarnation == node.incarnation:
                if node.idle_envs_hold_memory or env.trajectory_id in busy:
                    node.reserved_mb += env.memory_mb
                else:  # idle, holding nothing (see env_tiers.idled)
                    env.on_disk = True
                    node.on_disk.add(env.trajectory_id)
            else:
                effects.append(self._end_env(env, "lost", f"node {node.node_id} restarted"))
        for aid, run in list(self.running.items()):
            if run.node_id != node.node_id:
                continue
            if run.incarnation == node.incarnation:
                node.free -= set(run.cores)
            else:
                del self.running[aid]
                effects += self._finish(run.action, self._died(run, now, "node agent restarted"))
        return effects

    def _restore_chains(self, node: Node, report: NodeReport) -> None:
        """Who is next on each core (pipelining), from the first report of a node whose runs
        were restored from Postgres: its waiting dispatches, in the order they will start."""
        for r in report.running:
            run = self.running.get(r.action_id)
            if r.waiting and run is not None and run.incarnation == node.incarnation:
                for core in r.cores:
                    node.next.setdefault(core, []).append(r.action_id)

    def _died(self, run: Dispatched, now: float, why: str) -> ActionResult:
        return verdict(
            run.action,
            ErrorKind.NODE_DIED,
            f"node {run.node_id} died: {why}",
            now=now,
            allocation=_allocation(run),
            started_at=run.started_at,
        )

    def _reconcile(self, node: Node, report: NodeReport, now: float) -> list[Effect]:
        """Match what the node reports running (or holding unacked) with our books."""
        effects: list[Effect] = []
        reported = {r.action_id: r for r in report.running}
        for aid, run in list(self.running.items()):
            if run.node_id != node.node_id or aid in reported:
                if aid in reported:
                    run.confirmed = True
                continue
            if run.confirmed:  # it ran there and vanished without a completion
                del self.running[aid]
                self._free(run)
                effects += self._finish(run.action, self._died(run, now, "lost track of it"))
            else:
                verdict_ = unlisted.judge(report, run, now, self.epoch, self.cfg.dispatch_grace_s)
                if verdict_ is unlisted.Verdict.REDO:
                    effects += self._redo(aid, node, now)  # it never ran there
                elif verdict_ is unlisted.Verdict.RESEND and run.sent is not None:
                    run.sent_at = now
                    effects.append(run.sent)
        for aid, r in reported.items():
            if aid in self.killed:
                if r.cores:  # still running there: kill it once more
                    effects.append(KillOnNode(node.node_id, aid, ErrorKind.CANCELLED))
            elif aid not in self.running:
                effects += self._adopt(node, aid, r.cores, r.attempt, now)
        self._reconcile_killed(node, reported)
        return effects

    def _reconcile_killed(self, node: Node, reported: Mapping[str, RunningAction]) -> None:
        """A killed action the node no longer lists, or lists without cores (only its
        completion is pending there), is over: its cores are free again."""
        for aid, run in list(self.killed.items()):
            if run.node_id == node.node_id and not (aid in reported and reported[aid].cores):
                del self.killed[aid]
                self._free(run)

    def _adopt(
        self, node: Node, aid: str, cores: tuple[int, ...], attempt: int, now: float
    ) -> list[Effect]:
        """A node runs an action we only knew as queued (its dispatch record was lost)."""
        action = self.unqueue(aid)
        self._views.pop(aid, None)
        if action is None or not (set(cores) <= node.free or self.gpu.shares(node, action, cores)):
            return [KillOnNode(node.node_id, aid, ErrorKind.INTERNAL)]
        action = msgspec.structs.replace(action, attempt=attempt)
        node.free -= set(cores)
        self.running[aid] = Dispatched(action, node.node_id, node.incarnation, cores, now, True)
        env = self.envs.get(action.spec.trajectory_id)
        if env is not None and env.node_id == node.node_id:
            env_tiers.booked(env, node)
        return []

    def _redo(self, aid: str, node: Node, now: float) -> list[Effect]:
        """The node never got this dispatch: it never started, so running it again is safe
        (unless it was cancelled meanwhile: then it ends now)."""
        run = self.running.pop(aid)
        self._free(run)
        if run.kill_by is not None:
            cancelled = verdict(
                run.action, ErrorKind.CANCELLED, "cancelled before it started", now=now
            )
            return self._finish(run.action, cancelled)
        self.requeue_first(run.action)
        return []

    def _node_lost(self, node: Node, now: float, why: str, died: bool = True) -> list[Effect]:
        """Fail what ran there (it may have half-run) and lose its environments (``died``:
        it did not shut down)."""
        effects: list[Effect] = []
        del self.nodes[node.node_id]
        self.pending.all_unchecked = True
        self._pools.pop(node.node_id, None)  # its reservations end with its environments
        for aid, run in list(self.running.items()):
            if run.node_id == node.node_id:
                del self.running[aid]
                effects += self._finish(run.action, self._died(run, now, why))
        for aid in [a for a, run in self.killed.items() if run.node_id == node.node_id]:
            del self.killed[aid]  # its cores went with the node
        for env in list(self.envs.values()):  # not those a new incarnation kept (env_tiers)
            if env.node_id == node.node_id and env.incarnation == node.incarnation:
                effects.append(self._end_env(env, "lost", f"node {node.node_id} died: {why}"))
        if node.gpu is not None:
            effects += self.gpu.node_gone(node, now, died)
        return effects

    def node_leaving(self, leaving: NodeLeaving, now: float) -> list[Effect]:
        """A node agent is shutting down: first it drains (no new work), then it is gone.

        When it is gone and says what it started, a dispatch it never started (it reached
        the agent after it stopped taking work) goes back to the queue instead of failing,
        and an environment booked for it but never created is released, not lost.
        """
        node = self.nodes.get(leaving.node_id)
        if node is None or node.incarnation != leaving.incarnation:
            return []
        if leaving.draining:
            node.draining = True
            return []
        self._depart(node)
        effects: list[Effect] = []
        if leaving.started is not None:
            started, envs = set(leaving.started), set(leaving.envs or ())
            effects += self._requeue_unstarted(node, started, envs, now)
        return effects + self._node_lost(node, now, "node agent shut down", died=False)

    def node_failed(
        self, node_id: str, incarnation: str, now: float, why: str, lease_s: float
    ) -> list[Effect]:
        """The health detector declared this incarnation failed (robustrl §5): it is fenced
        (its later reports are refused), what it may have started ends ``node_died``, and a
        dispatch granted ``lease_s`` or more after its last report was read goes back to the
        queue: its start lease had run out before it was sent, so it never started there."""
        node = self.nodes.get(node_id)
        if node is None or node.incarnation != incarnation:
            return []
        self._depart(node)
        effects: list[Effect] = []
        for aid, run in list(self.running.items()):
            unstarted = not (run.confirmed or run.restored) and run.kill_by is None
            if run.node_id == node_id and unstarted and run.started_at >= node.last_seen + lease_s:
                effects += self._redo(aid, node, now)
                effects += self._uncreated(node, run, node.envs_seen)
        return effects + self._node_lost(node, now, why)

    def fenced(self, node_id: str, incarnation: str) -> bool:
        """This incarnation left, was replaced or was declared failed: nothing of it counts."""
        return (node_id, incarnation) in self.departed

    def _requeue_unstarted(
        self, node: Node, started: set[str], envs: set[str], now: float
    ) -> list[Effect]:
        effects: list[Effect] = []
        for aid, run in list(self.running.items()):
            if run.node_id != node.node_id or aid in started:
                continue
            effects += self._redo(aid, node, now)
            effects += self._uncreated(node, run, envs)
        return effects

    def _uncreated(self, node: Node, run: Dispatched, envs: AbstractSet[str]) -> list[Effect]:
        """A dispatch queued again because it never started: its environment, booked on
        ``node`` but not among the ``envs`` the node said it held, was never created there, so
        it is released, not lost (the trajectory's next action is told nothing)."""
        env = self.envs.get(run.action.spec.trajectory_id)
        if env is None or env.node_id != node.node_id or env.trajectory_id in envs:
            return []
        why = f"node {node.node_id} left before creating it"
        return [self._end_env(env, "closed", why)]  # nothing in it was lost

    def _depart(self, node: Node) -> None:
        self.departed[node.node_id, node.incarnation] = None
        if len(self.departed) > DEPARTED_LIMIT:
            del self.departed[next(iter(self.departed))]

    def env_expired(self, node_id: str, trajectory_id: str) -> list[Effect]:
        env = self.envs.get(trajectory_id)
        if env is None or env.node_id != node_id:
            return []
        return [self._end_env(env, "expired", "idle longer than the environment TTL")]

    def _end_env(self, env: EnvPlacement, status: str, reason: str) -> EnvChanged:
        self.envs.pop(env.trajectory_id, None)
        self.pending.move(env.trajectory_id, HOMELESS)
        self._release(env.node_id, env.trajectory_id)
        node = self.nodes.get(env.node_id)
        if node is not None and node.incarnation == env.incarnation:
            env_tiers.released(env, node)
        if status != "closed":
            self.gone_envs[env.trajectory_id] = reason
        else:
            self.gone_envs.pop(env.trajectory_id, None)
        return EnvChanged(
            env.trajectory_id,
            env.job_id,
            env.node_id,
            env.incarnation,
            env.memory_mb,
            status,
            reason,
        )

    # ------------------------------------------------------------------ completions

    def complete(self, c: Completion, now: float) -> list[Effect]:
        """A node reports an attempt's end; stale or duplicate reports change nothing."""
        killed = self.killed.get(c.action_id)
        if killed is not None and _reports(c, killed):
            del self.killed[c.action_id]  # ended already; the process is over: its cores are free
            self._free(killed)
            return []
        run = self.running.get(c.action_id)
        if run is None or not _reports(c, run):
            return []
        del self.running[c.action_id]
        self._free(run)
        self._touch(run.action.spec.trajectory_id, now)
        gpu_run = run.action.key_resource == GPU
        if gpu_run and c.outcome.failure is not None and self.gpu.on_failure(run, c, now):
            return []  # retried on a larger chunk
        result = completed(run.action, c.outcome, _allocation(run), now=now)
        if not gpu_run and c.outcome.failure is None and result.timings is not None:
            self._ran(run.node_id, result.timings.exec_s)  # ran to its exit: a run time
        if result.status == "succeeded" and result.timings:
            t = result.timings
            if gpu_run:
                self.gpu.learn(run, t.exec_s, t.restore_s)
            elif self._learns is not None:
                self._learns.observe(run.action.spec.profile, len(run.cores), t.exec_s)
        return self._finish(run.action, result)

    def _ran(self, node_id: str, exec_s: float) -> None:
        """Fold an action's run time into its node's running mean (pipelining's depth)."""
        node = self.nodes.get(node_id)
        if node is not None:
            node.run_s = (
                exec_s
                if node.run_s == math.inf
                else node.run_s + RUN_WEIGHT * (exec_s - node.run_s)
            )

    def _touch(self, trajectory_id: str, now: float) -> None:
        env = self.envs.get(trajectory_id)
        if env is not None:
            env.last_used = now

    def _free(self, run: Dispatched) -> None:
        """Give the cores back, unless the node they were booked on is gone or replaced."""
        node = self.nodes.get(run.node_id)
        if node is not None and node.incarnation == run.incarnation:
            self._give_back(node, run)
            live = chain(self.running.values(), self.killed.values())
            env_tiers.idled(self.envs.get(run.action.spec.trajectory_id), node, live)

    def _give_back(self, node: Node, run: Dispatched) -> None:
        """Free an ended run's units (a GPU chunk only when no other call shares it). A core
        granted next (pipelining) passes to that action instead; a waiting action that ends
        leaves the core to its holder."""
        units = set(run.cores)
        if node.gpu is not None:
            node.free |= units - self.gpu.held(node)
            return
        for core in units:
            chain = node.next.get(core)
            if not chain:
                node.free.add(core)
                continue
            if run.action.spec.action_id in chain:  # it waited: the core stays with its holder
                chain.remove(run.action.spec.action_id)
            else:  # it held the core: the first waiting action has it now
                chain.pop(0)
            if not chain:
                del node.next[core]

    def finish(self, action: UnifiedAction, result: ActionResult) -> list[Effect]:
        """End an action no longer queued or running with ``result``."""
        return self._finish(action, result)

    def _finish(self, action: UnifiedAction, result: ActionResult) -> list[Effect]:
        self._views.pop(action.spec.action_id, None)
        self.gpu.forget(action.spec.action_id)
        self.waits.pop(action.spec.action_id, None)
        if action.spec.action_id not in self.recent:
            self.finished += 1
        self.recent[action.spec.action_id] = None
        if len(self.recent) > RECENT_LIMIT + RECENT_LIMIT // 4:
            # forget the oldest in one go: deleting one at a time from the front of a dict
            # makes each next look at its front pass over every hole left before it
            self.recent = dict.fromkeys(list(self.recent)[-RECENT_LIMIT:])
        return [Finish(action, result)]

    def cancel(
        self, action_id: str, now: float, why: str = "cancelled by the client"
    ) -> list[Effect]:
        action = self.unqueue(action_id)
        if action is not None:
            return self._finish(action, verdict(action, ErrorKind.CANCELLED, why, now=now))
        run = self.running.get(action_id)
        if run is not None:
            return self._kill(action_id, run, now)
        return []

    def _kill(self, action_id: str, run: Dispatched, now: float) -> list[Effect]:
        """Ask the node to kill it; it ends at the deadline if the node does not confirm."""
        if run.kill_by is None:
            run.kill_by = now + self.cfg.kill_grace_s
        return [KillOnNode(run.node_id, action_id, ErrorKind.CANCELLED)]

    def close_env(self, trajectory_id: str, now: float) -> list[Effect]:
        """Cancel the trajectory's queued and running actions and remove its environment."""
        effects: list[Effect] = []
        for aid in list(self.pending.by_tid.get(trajectory_id, ())):
            effects += self.cancel(aid, now, "environment closed")
        for aid, run in self.running.items():
            if run.action.spec.trajectory_id == trajectory_id:
                effects += self._kill(aid, run, now)
        self.gone_envs.pop(trajectory_id, None)
        env = self.envs.get(trajectory_id)
        if env is not None:
            effects.append(DropEnvOnNode(env.node_id, trajectory_id))
            effects.append(self._end_env(env, "closed", "closed by the client"))
        return effects

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[Effect]:
        """Expire queue timeouts, declare silent nodes dead, fail orphaned restored actions."""
        effects: list[Effect] = []
        silent = [n for n in self.nodes.values() if now - n.last_seen > self.cfg.node_timeout_s]
        for node in silent if self.cfg.node_timeouts else ():
            self._depart(node)  # a late report of it must not bring a ghost back
            effects += self._node_lost(node, now, "no heartbeat")
        for aid in self.pending.expired(now, lambda aid: self._expired(aid, now)):
            act = self.queue[aid]
            self.unqueue(aid)
            why = f"waited more than {self._queue_limit(act)}s in the queue"
            why += _because(self.waits.get(aid))
            effects += self._finish(act, verdict(act, ErrorKind.QUEUE_TIMEOUT, why, now=now))
        if now >= self.not_before + self.cfg.node_timeout_s:
            effects += self._fail_orphans(now)
        return effects + self._end_unconfirmed_kills(now) + self.gpu.settle(now)

    def _expired(self, aid: str, now: float) -> bool:
        act = self.queue[aid]
        limit = self._queue_limit(act)
        return limit is not None and now - act.submitted_at > limit

    def _end_unconfirmed_kills(self, now: float) -> list[Effect]:
        """Cancelled actions whose node did not confirm the kill in time end ``cancelled``;
        their cores stay booked (``killed``) until the node shows the process is over."""
        effects: list[Effect] = []
        for aid, run in list(self.running.items()):
            if run.kill_by is None or now < run.kill_by:
                continue
            del self.running[aid]
            self.killed[aid] = run
            why = f"cancelled; node {run.node_id} did not confirm the kill within "
            why += f"{self.cfg.kill_grace_s:g}s"
            effects += self._finish(
                run.action,
                verdict(
                    run.action,
                    ErrorKind.CANCELLED,
                    why,
                    now=now,
                    allocation=_allocation(run),
                    started_at=run.started_at,
                ),
            )
        return effects

    def _fail_orphans(self, now: float) -> list[Effect]:
        """Restored running actions whose node never came back."""
        effects: list[Effect] = []
        for aid, run in list(self.running.items()):
            node = self.nodes.get(run.node_id)
            if run.restored and (node is None or node.incarnation != run.incarnation):
                del self.running[aid]
                effects += self._finish(
                    run.action,
                    verdict(
                        run.action,
                        ErrorKind.NODE_DIED,
                        f"node {run.node_id} did not come back",
                        now=now,
                        started_at=run.started_at,
                    ),
                )
        return effects

    # ------------------------------------------------------------------ decisions

    def schedule(self, now: float) -> list[Effect]:
        """Start every action the policy admits now, FCFS per node pool."""
        if now < self.not_before or not self.queue:
            return []
        p = _Pass()
        # GPU calls are granted by ``self.gpu``; with none queued it has nothing to do
        effects: list[Effect] = self.gpu.schedule(now) if self.pending.has_gpu() else []
        cpu_nodes = sum(1 for n in self.nodes.values() if n.gpu is None)
        walk = self.pending.walk(lambda lane: self._lane_open(p, lane), p.follow)
        self.pending.begin_walk()
        try:
            for aid in walk:
                effects += self._visit(self.queue[aid], p, now)
                if p.full and len(p.full) == cpu_nodes:
                    break  # every pool is blocked with its lookahead filled: nothing can start
        finally:
            walk.close()
            self.pending.end_walk()
        for aid in p.recheck:  # their trajectory may have no node next pass
            self.pending.mark(aid)
        for node_id, waiting in p.waiting.items():
            effects += self._admit(self.nodes[node_id], waiting, now)
        if self.cfg.pipeline:
            for node_id, waiting in p.waiting.items():
                effects += self._pipeline(self.nodes[node_id], waiting, now, p.placed)
        return effects

    def _pipeline(
        self,
        node: Node,
        offered: list[UnifiedAction],
        now: float,
        placed: Mapping[str, str],
    ) -> list[Effect]:
        """Grant a full CPU node's next actions on its busy cores (see pipeline): FCFS from
        the head of what its pool offered and did not start, trajectories already there or
        new ones this pass ``placed`` there (their environment opens with the grant)."""
        if node.gpu is not None or node.draining or node.free:
            return []  # free cores are the policy's to give
        head: list[UnifiedAction] = []
        for act in offered:
            if act.spec.action_id not in self.queue:
                continue  # started by the policy
            tid = act.spec.trajectory_id
            env = self.envs.get(tid)
            there = placed.get(tid) if env is None else env.node_id
            if there != node.node_id:
                break
            head.append(act)
        effects: list[Effect] = []
        for _ in range(self._depth(node)):  # one more grant per core each round
            grants = pipeline.plan(head, self._holders(node))
            if not grants:
                break
            head = head[len(grants) :]
            for grant in grants:
                for core in grant.cores:
                    node.next.setdefault(core, []).append(grant.action.spec.action_id)
                effects += self._open_env(node, grant.action)
                effects += self._book(node, grant.action, grant.cores, now, grant.after)
        return effects

    def _holders(self, node: Node) -> list[pipeline.Holder]:
        """The node's busy cores that may take one more waiting grant, each with the action a
        new grant there would wait for (the last granted the core) and when that was granted."""
        holders = []
        for aid, run in self.running.items():
            if run.node_id != node.node_id or run.kill_by is not None:
                continue
            for core in run.cores:  # ``run`` holds the core unless it waits for it
                chain = node.next.get(core, [])
                if aid in chain or len(chain) >= self._depth(node):
                    continue
                last = self.running.get(chain[-1]) if chain else run
                if last is not None:
                    holders.append(
                        pipeline.Holder(core, last.action.spec.action_id, last.started_at)
                    )
        return holders

    def _lane_open(self, p: _Pass, lane: str) -> bool:
        """Whether an action of ``lane`` may still be offered or placed in this pass (what the
        walk skips once not: in a full scan, visiting it would change nothing)."""
        node = self.nodes.get(lane)
        if node is None:  # no environment, or one on a node that is gone: placed anew
            return not p.unplaced_blocked
        return not (lane in p.full or lane in p.reserved or node.draining)

    def _visit(self, act: UnifiedAction, p: _Pass, now: float) -> list[Effect]:
        """One queued CPU action in FCFS order: offered to its pool, placed, or ended."""
        tid = act.spec.trajectory_id
        node_id = self._node_of(tid, p)
        if node_id is None and tid in self.gone_envs:
            return self._report_lost(act, now)
        if node_id is not None and tid not in self.envs:
            p.recheck.append(act.spec.action_id)
        if self._could_not_fit(act, node_id):
            impossible = self._reject_impossible(act, node_id, now)
            if impossible:
                return impossible
        effects: list[Effect] = []
        if node_id is None:
            if p.unplaced_blocked:
                return effects
            node_id, effects = self._place_new(act, p)
            if node_id is None:
                return effects
        else:
            env = self.envs.get(tid)
            if env is not None and env.on_disk:
                fits, effects = self._room_to_restore(act, env, p)
                if not fits:
                    return effects
        self._offer(p, node_id, act)
        return effects

    def _room_to_restore(
        self, act: UnifiedAction, env: EnvPlacement, p: _Pass
    ) -> tuple[bool, list[Effect]]:
        """An environment on disk books its memory again when its action starts: only if its
        node has that memory free (reclaiming idle environments there if that is what stops
        it); else the action waits, saying why. Booked in the pass when it fits."""
        node_id = env.node_id
        if env.trajectory_id in p.restoring:
            return True, []  # counted once in this pass, however many of its actions wait
        reclaimed: list[Effect] = []
        node = self.nodes[node_id]
        kept = node.idle_envs_hold_memory
        if kept and self._free_on(node, p) < env.memory_mb:
            reclaimed = self._reclaim_memory(env.memory_mb, p, only=node_id)
        if self._free_on(node, p) < env.memory_mb:
            self.waits[act.spec.action_id] = (
                f"its environment is on disk and node {node_id} has not the "
                f"{env.memory_mb} MB to restore it"
                if kept
                else f"waiting for memory: its environment needs {env.memory_mb} MiB while "
                f"an action runs in it, node {node_id} has less unbooked"
            )
            return False, reclaimed
        self.waits.pop(act.spec.action_id, None)
        p.restoring.add(env.trajectory_id)
        p.placed_mb[node_id] = p.placed_mb.get(node_id, 0) + env.memory_mb
        return True, reclaimed

    @staticmethod
    def _free_on(node: Node, p: _Pass) -> int:
        """One node's memory not booked, this pass's placements included (see _free_mb)."""
        if node.draining or node.gpu is not None:
            return 0
        return node.memory_mb - node.reserved_mb - p.placed_mb.get(node.node_id, 0)

    def _report_lost(self, act: UnifiedAction, now: float) -> list[Effect]:
        """The trajectory's first action after its environment was lost says so, once; the
        loss is recorded as reported (a restart does not report it again), and the
        trajectory's next action gets a fresh environment."""
        tid = act.spec.trajectory_id
        why = self.gone_envs.pop(tid)
        self.unqueue(act.spec.action_id)
        reported = EnvChanged(tid, act.spec.job_id, "", "", 0, "closed", f"loss reported: {why}")
        return [
            reported,
            *self._finish(act, verdict(act, ErrorKind.ENVIRONMENT_LOST, why, now=now)),
        ]

    def _node_of(self, tid: str, p: _Pass) -> str | None:
        env = self.envs.get(tid)
        if env is not None:
            return env.node_id if env.node_id in self.nodes else None
        return p.placed.get(tid)

    def _offer(self, p: _Pass, node_id: str, act: UnifiedAction) -> None:
        """Add ``act`` to its pool's FCFS list: fitting at minimum, or as lookahead."""
        if node_id in p.full or node_id in p.reserved or self.nodes[node_id].draining:
            return
        if self._idle_policy_when_full and not self.nodes[node_id].free:
            self._offer_full(p, self.nodes[node_id], act)
            return
        p.waiting.setdefault(node_id, []).append(act)
        if node_id in p.blocked:
            p.extra[node_id] = extra = p.extra.get(node_id, 0) + 1
            if extra >= self._lookahead:
                p.full.add(node_id)
            return
        need = p.need.get(node_id, 0) + act.demands[0].min
        if need > len(self.nodes[node_id].free):
            p.blocked.add(node_id)
        else:
            p.need[node_id] = need

    def _offer_full(self, p: _Pass, node: Node, act: UnifiedAction) -> None:
        """A node with no free core starts nothing in this pass: only pipelining may take
        the head of its pool, so it is offered no more than that can take (a pass behind
        full nodes costs what can move, not the policy's lookahead)."""
        waiting = p.waiting.setdefault(node.node_id, [])
        room = self._pipeline_room(node)
        if len(waiting) < room:
            waiting.append(act)
        if len(waiting) >= room:
            p.full.add(node.node_id)

    def _pipeline_room(self, node: Node) -> int:
        """Waiting grants a full node can still take (0 without pipelining)."""
        if not self.cfg.pipeline or node.gpu is not None:
            return 0
        waiting = sum(len(chain) for chain in node.next.values())
        return max(0, node.capacity * self._depth(node) - waiting)

    def _depth(self, node: Node) -> int:
        """Waiting grants per core this node may hold now (see ``pipeline_depth_short``)."""
        depth = self.cfg.pipeline_depth
        if node.run_s <= self.cfg.pipeline_short_s:
            return max(depth, self.cfg.pipeline_depth_short)
        return depth

    def _place(self, act: UnifiedAction, p: _Pass) -> str | None:
        """CPU-memory load balance over nodes with room for the action and its environment."""
        best: tuple[float, int, str] | None = None
        for node in self.nodes.values():
            if node.node_id in p.blocked or node.node_id in p.reserved or node.draining:
                continue
            if node.gpu is not None:
                continue
            free_cores = len(node.free) - p.need.get(node.node_id, 0)
            free_mem = node.memory_mb - node.reserved_mb - p.placed_mb.get(node.node_id, 0)
            if free_cores < act.demands[0].min or free_mem < act.env_memory_mb:
                continue
            load = (node.memory_mb - free_mem + act.env_memory_mb) / max(1, node.memory_mb)
            key = (load, -free_cores, node.node_id)
            if best is None or key < best:
                best = key
        node_id = best[2] if best is not None else self._place_behind(act, p)
        if node_id is None:
            return None
        p.placed[act.spec.trajectory_id] = node_id
        p.placed_mb[node_id] = p.placed_mb.get(node_id, 0) + act.env_memory_mb
        return node_id

    def _place_behind(self, act: UnifiedAction, p: _Pass) -> str | None:
        """With every CPU node's cores busy, a new trajectory is placed where pipelining can
        still take it (the node with the fewest grants waiting per core): its first action
        waits behind a running one there, as a known trajectory's would, instead of for a core
        to free and the pass after (a round trip per core, so that a burst of new trajectories
        started at half the rate of known ones). Only on a node whose recent actions ran short
        (the trajectory stays where it is placed: behind a long action it would wait where
        another node frees first); not for an action pipelining would not take (see
        ``pipeline.pipelinable``), nor under a per-pool policy (which books the trajectories of
        its pool as it starts them)."""
        if not self._idle_policy_when_full or pipeline.pipelinable(act) is None:
            return None
        best: tuple[float, float, str] | None = None
        for node in self.nodes.values():
            if node.gpu is not None or node.free or node.draining:
                continue  # a node with free cores is the first loop's (or promised this pass)
            if node.run_s > self.cfg.pipeline_short_s:
                continue
            if node.node_id in p.full or node.node_id in p.reserved:
                continue
            free_mb = self._free_on(node, p)
            room = self._pipeline_room(node) - len(p.waiting.get(node.node_id, ()))
            if free_mb < act.env_memory_mb or room <= 0:
                continue
            # the most room per core is the fewest grants waiting per core: every node here
            # runs short actions, so all hold the same depth of grants per core
            load = (node.memory_mb - free_mb) / max(1, node.memory_mb)
            key = (-room / max(1, node.capacity), load, node.node_id)
            if best is None or key < best:
                best = key
        return best[2] if best is not None else None

    def _place_new(self, act: UnifiedAction, p: _Pass) -> tuple[str | None, list[Effect]]:
        """Place a new trajectory's environment, reclaiming idle environments' memory if
        that is what stops it; else block behind it, saying why it waits."""
        node_id = self._place(act, p)
        reclaimed: list[Effect] = []
        if node_id is None:
            reclaimed = self._reclaim_memory(act.env_memory_mb, p)
            node_id = self._place(act, p) if reclaimed else None
        if node_id is None:
            self.waits[act.spec.action_id] = self._wait_reason(act, p)
            self._block_unplaced(act, p)
            # no more placements this pass: of what has no environment, only the actions of
            # trajectories placed in it can still be offered
            for tid in p.placed:
                p.follow.extend(self.pending.by_tid.get(tid, ()))
        return node_id, reclaimed

    def _block_unplaced(self, act: UnifiedAction, p: _Pass) -> None:
        """The first new trajectory that fits nowhere reserves the emptiest node that could hold
        it, so that later actions cannot starve it; later new trajectories wait behind it."""
        p.unplaced_blocked = True
        room = [
            (len(n.free) - p.need.get(n.node_id, 0), n.node_id)
            for n in self.nodes.values()
            if n.gpu is None
            and n.memory_mb - n.reserved_mb - p.placed_mb.get(n.node_id, 0) >= act.env_memory_mb
        ]
        if room:
            p.reserved.add(max(room)[1])

    def _could_not_fit(self, act: UnifiedAction, node_id: str | None) -> bool:
        """Cheap pre-check: the action may need more than its node (or any node) has."""
        if node_id is not None:
            return bool(act.demands[0].min > self.nodes[node_id].capacity)
        return bool(self.nodes)

    def _reject_impossible(
        self, act: UnifiedAction, node_id: str | None, now: float
    ) -> list[Effect]:
        """An action no live node could ever hold fails now instead of blocking the queue
        forever; so does one larger than the node its trajectory's environment lives on."""
        cpu = [n for n in self.nodes.values() if n.gpu is None]
        why = impossible(act, cpu, self.nodes.get(node_id or ""))
        if why is None:
            return []
        self.unqueue(act.spec.action_id)
        self.waits.pop(act.spec.action_id, None)
        return self._finish(act, verdict(act, ErrorKind.INVALID_REQUEST, why, now=now))

    def _admit(self, node: Node, acts: list[UnifiedAction], now: float) -> list[Effect]:
        if self._idle_policy_when_full and not node.free:
            return []  # nothing can start (see _offer_full)
        waiting = [self._view(a) for a in acts]
        busy = [
            views.running(r.action, len(r.cores), r.started_at)
            for r in self.running.values()
            if r.node_id == node.node_id
        ]
        policy = self._pool_policy(node.node_id)
        grants = policy.arrange(waiting, len(node.free), node.capacity, busy, now)
        effects: list[Effect] = []
        for act, units in zip(acts, grants, strict=False):
            if units > 0:  # a policy that is not prefix-only says "not now" with 0
                effects += self._start(node, act, units, now)
        self._release_unstarted(node.node_id, acts)
        return effects

    def _pool_policy(self, node_id: str) -> Policy:
        """The node's own instance of a policy with per-pool state, else the shared policy."""
        if self._per_pool is None:
            return self.policy
        policy = self._pools.get(node_id)
        if policy is None:
            policy = self._pools[node_id] = self._per_pool.for_pool()
        return policy

    def _release(self, node_id: str, trajectory_id: str) -> None:
        """Tell the node's pool policy that the trajectory holds nothing there any more."""
        pool = self._pools.get(node_id)
        if pool is not None:
            pool.close_trajectory(trajectory_id)

    def _release_unstarted(self, node_id: str, acts: list[UnifiedAction]) -> None:
        """A new trajectory the pool reserved for but did not start has no environment here
        yet; the next pass may place it on another node, so it must not hold this pool."""
        if node_id not in self._pools:
            return
        for act in acts:
            if act.spec.trajectory_id not in self.envs:
                self._release(node_id, act.spec.trajectory_id)

    def _view(self, act: UnifiedAction) -> Waiting:
        aid = act.spec.action_id
        view = self._views.get(aid)
        if view is None:
            view = self._views[aid] = views.waiting(act)
        return view

    def _start(self, node: Node, act: UnifiedAction, units: int, now: float) -> list[Effect]:
        effects = self._open_env(node, act)
        cores = pick_cores(node.free, node.numa, units)
        node.free -= set(cores)
        return effects + self._book(node, act, cores, now)

    def _open_env(self, node: Node, act: UnifiedAction) -> list[Effect]:
        """A new trajectory's environment, on ``node`` from its first action's grant: booked,
        recorded, and its other queued actions now wait in this pool. Nothing for a known one."""
        tid = act.spec.trajectory_id
        if tid in self.envs:
            return []
        env = EnvPlacement(tid, act.spec.job_id, node.node_id, node.incarnation, act.env_memory_mb)
        self.envs[tid] = env
        node.reserved_mb += env.memory_mb
        self.unqueue(act.spec.action_id)
        self.pending.move(tid, node.node_id)
        return [EnvChanged(tid, env.job_id, env.node_id, env.incarnation, env.memory_mb, "active")]

    def _book(
        self,
        node: Node,
        act: UnifiedAction,
        cores: tuple[int, ...],
        now: float,
        after: tuple[str, ...] = (),
    ) -> list[Effect]:
        """Out of the queue, running on ``cores`` (booked by the caller), dispatched."""
        self.unqueue(act.spec.action_id)
        self._views.pop(act.spec.action_id, None)
        self.waits.pop(act.spec.action_id, None)
        self.envs[act.spec.trajectory_id].last_used = now
        env_tiers.booked(self.envs[act.spec.trajectory_id], node)
        act = msgspec.structs.replace(act, attempt=act.attempt + 1)
        run = Dispatched(act, node.node_id, node.incarnation, cores, now)
        self.running[act.spec.action_id] = run
        run.sent = StartOnNode(
            node.node_id, act, cores, node.incarnation, after=after, issued=self.issue()
        )
        return [run.sent]

    def issue(self) -> int:
        """Number a dispatch (see ``Dispatch.issued``); the caller keeps it in ``run.sent``,
        to send once more if its node never reads it."""
        self.issued += 1
        return self.issued

    def _reclaim_memory(self, need_mb: int, p: _Pass, only: str | None = None) -> list[Effect]:
        """Make room for an environment of ``need_mb`` by ending the oldest idle ones (no
        action queued or running) on one node (``only``, if given), until that node has the
        memory; their trajectories' next action says ``environment_lost`` once."""
        live = chain(self.running.values(), self.killed.values())
        busy = {r.action.spec.trajectory_id for r in live}
        queued = self.pending.by_tid
        idle = [
            e
            for e in self.envs.values()
            if e.trajectory_id not in busy
            and e.trajectory_id not in queued
            and not e.on_disk
            and self._holds_idle(e.node_id)
        ]
        free = self._free_mb(p)
        if only is not None:
            free = {only: free[only]} if only in free else {}
        plan = reclaim_plan(need_mb, idle, free)
        return [
            effect
            for env in plan
            for effect in (
                DropEnvOnNode(env.node_id, env.trajectory_id),
                self._end_env(
                    env, "lost", f"reclaimed idle under memory pressure on {env.node_id}"
                ),
            )
        ]

    def _holds_idle(self, node_id: str) -> bool:
        """Ending an idle environment of this node frees memory (not so on the process
        backend, whose environment is a directory: it is never reclaimed)."""
        node = self.nodes.get(node_id)
        return node is None or node.idle_envs_hold_memory

    def _free_mb(self, p: _Pass) -> dict[str, int]:
        """Memory not booked on each usable node, this pass's placements included."""
        return {
            n.node_id: n.memory_mb - n.reserved_mb - p.placed_mb.get(n.node_id, 0)
            for n in self.nodes.values()
            if not n.draining and n.gpu is None
        }

    def _wait_reason(self, act: UnifiedAction, p: _Pass) -> str:
        free = self._free_mb(p)
        most = max(free.values(), default=0)
        if most < act.env_memory_mb:
            return (
                f"waiting for memory: its environment needs {act.env_memory_mb} MiB, "
                f"the most any node has unbooked is {most} MiB"
            )
        return f"waiting for {act.demands[0].min} free core(s)"

    def snapshot(self) -> dict[str, int]:
        """Counters for status lines and metrics."""
        return {
            "queued": len(self.queue),
            "running": len(self.running),
            "nodes": len(self.nodes),
            "envs": len(self.envs),
            "free_cores": sum(len(n.free) for n in self.nodes.values() if n.gpu is None),
        }


def _because(reason: str | None) -> str:
    return f" ({reason})" if reason else ""


def _allocation(run: Dispatched) -> Allocation:
    """Where it ran: its cores, or the GPUs of an infer action."""
    if run.action.key_resource == GPU:
        return Allocation(node_id=run.node_id, gpus=run.cores)
    return Allocation(node_id=run.node_id, cores=run.cores)


def _reports(c: Completion, run: Dispatched) -> bool:
    """The completion is of this very dispatch (an agent that left or was replaced, or an
    earlier attempt, never ran it)."""
    return bool(
        run.node_id == c.node_id
        and run.action.attempt == c.attempt
        and run.incarnation == c.incarnation
    )
