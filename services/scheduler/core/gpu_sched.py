"""The GPU half of the scheduler core: registered services, their preparation on GPU nodes, and
infer actions granted buddy chunks of a node's GPUs (§5.3).

Pure, driven by ``SchedulerCore`` (which owns the queue, the nodes and the running actions and
routes here what concerns GPU nodes and infer actions). One pass: infer actions for unknown
services fail at once (``invalid_request`` naming the registered ones) and those every GPU node
failed to prepare fail (``backend_unavailable`` with the factory's error); the rest are ordered
(FCFS, or HRRS: plexrl Algorithm 1), each goes to a node that prepared it -- preferring one where
it is resident on a free chunk, then the one with the most free GPUs -- and each node's list is
arranged as one pool: the elastic policy chooses among the ready DoP variants over the node's
free chunks (Algorithm 4), with the restore cost in the duration of a variant that is not
resident where it would run; other policies give each call its smallest variant.

Wait or restore (``gpu_wait``): before placement, a call whose service is resident on a busy
chunk that would finish it sooner than a restore (counting the calls booked on that copy
before it in the pass) stays queued this pass, and the elastic policy sees it behind its pool's
candidates in its estimate only; the others go on as above. Calls booked behind busy copies do
not take the window's places (up to ``WAIT_WINDOWS`` windows a pass).

Co-batching (issue 11 item 3: one service's forward pass per GPU at a time, concurrent calls
to it coalesced up to ``max_batch``). A busy chunk runs one variant of one service; a queued
call to that variant (at a DoP it may run as) joins it while fewer than ``max_batch`` calls
share it, and the agent coalesces the calls on a chunk into forward passes (those that arrive
while one runs form the next). Joining is free capacity: it takes no free GPU and delays no
other call, so it comes first in a pass, before the policy's grants, in the pass's order (under
HRRS, the highest response ratio joins first when room is short). The policy then arranges
batches, not calls: the remaining calls of one service (same smallest DoP) form groups of up
to ``max_batch``, each one candidate whose chunk all its calls share, and a busy chunk shows in
its view once (it frees when its last call ends, so as the latest started). Never two services
or variants on one GPU: free chunks are those no call holds; a chunk's GPUs return to the pool
only when the last call on it ends (``held``). A chunk a cancelled call still holds takes no
more (the call may be stuck). With ``max_batch=1`` all of this is a no-op.

Device failures are facts: ``device_oom`` retries the call once on the next larger variant (when
the service has one some node prepared), else it fails ``device_oom``; ``device_lost`` fails the
call and marks its GPUs down: none is granted again until the node's inventory has left it out
and listed it again (an agent drops a lost GPU from its inventory and lists it when healthy) or
the agent restarts (a new incarnation starts with every GPU it lists up).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

import msgspec

from services.scheduler.core import gpu, gpu_share, gpu_wait
from services.scheduler.core.books import Dispatched, GpuFacts, Node
from services.scheduler.core.effects import (
    Effect,
    PrepareOnNode,
    ServiceSettled,
    StartOnNode,
    verdict,
)
from services.scheduler.core.gpu_share import Group, service_of
from services.scheduler.core.registry import (
    Registration,
    changed,
    failed_everywhere,
    has_reported,
    missing,
    state_of,
)
from services.scheduler.policies.base import (
    ArrangesChunks,
    Policy,
    Running,
    Waiting,
)
from services.scheduler.policies.chunks import fits_chunks_at_min
from services.scheduler.policies.durations import (
    DEFAULT_DURATION_S,
    DurationLearner,
    resolve,
)
from tangram.chunks import chunk_of
from tangram.contract import (
    Completion,
    ErrorKind,
    Inventory,
    NodeReport,
    PreparedService,
    ServiceSpec,
    ServiceState,
    UnifiedAction,
)

if TYPE_CHECKING:
    from services.scheduler.core.scheduler import SchedulerCore

GpuOrder = Literal["fcfs", "hrrs"]
WAIT_WINDOWS = 2  # the calls a pass looks at, in windows, when some wait for busy copies
# A node whose agent died this many times in a row while building a service is not asked to
# build it again (a factory that ends the process -- os._exit, abort, a crash in native code --
# would have the supervisor restart it into the same build for ever); it reports the service
# failed until the service is registered again. One death may be the machine's: it is retried.
MAX_BUILD_DEATHS = 2


def profile_of(act: UnifiedAction) -> str:
    """What durations are learned under: the client's profile, else the service."""
    return act.spec.profile or f"infer:{service_of(act)}"


def new_facts(inv: Inventory) -> GpuFacts:
    devices = sorted(inv.gpus, key=lambda g: g.index)
    return GpuFacts(
        gpus=tuple(g.index for g in devices),
        restore_gb_per_s=inv.restore_gb_per_s,
        links=tuple(g.link for g in devices),
        gather_gb_per_s=inv.gather_gb_per_s,
    )


class GpuScheduler:
    """Services, registrations and GPU grants; see the module docstring."""

    def __init__(
        self, core: SchedulerCore, order: GpuOrder, prepare_timeout_s: float, retry_s: float
    ) -> None:
        self.core = core
        self.order = order
        self.prepare_timeout_s = prepare_timeout_s
        self.retry_s = retry_s
        self.services: dict[str, ServiceSpec] = {}
        self.registering: dict[str, Registration] = {}
        self.oom_floor: dict[str, int] = {}  # action -> the smallest DoP its retry may get
        policy: Policy = core.policy
        self.chunks = policy if isinstance(policy, ArrangesChunks) else None
        self.learner = self.chunks.learner if self.chunks is not None else DurationLearner()
        # per pass: each node's free chunks, the restore part of a (node, service, dop) grant
        # and the variants a call may run as on a node (``_dops``)
        self._free: dict[str, tuple[gpu.Chunk, ...]] = {}
        self._costs: dict[tuple[str, str, int], float] = {}
        self._variants: dict[tuple[str, str], tuple[int, ...]] = {}
        self._failed: dict[str, str] = {}  # service -> why every GPU node failed it
        # what _failed is out of date for: its services whose inputs changed (``changed``), or
        # all of them (GPU nodes came or went); recomputed at the next pass, so a pass costs
        # what changed rather than every service on every node
        self._stale: set[str] = set()
        self._failed_on: set[str] | None = None  # the GPU nodes _failed was computed over
        self._shared: dict[tuple[str, tuple[int, ...]], gpu.Shared] = {}  # busy chunks
        self._hot: set[str] = set()  # per pass: the services with calls queued or running
        self._queued: Counter[str] = Counter()  # per pass: calls queued per service
        self._copies = gpu_wait.Copies({}, 0.0)  # per pass: where each service is resident
        self._ends: dict[str, float] = {}  # a dispatched call -> its predicted end
        # (node, service) -> the agent's deaths in a row while it built the service, and the
        # failure a node reports for it from MAX_BUILD_DEATHS on (see MAX_BUILD_DEATHS)
        self.build_deaths: Counter[tuple[str, str]] = Counter()
        self.unbuildable: dict[tuple[str, str], str] = {}
        self._chunk_ends: dict[tuple[str, tuple[int, ...]], float] = {}  # per pass, busy chunks

    # ------------------------------------------------------------------ services

    def facts(self) -> dict[str, GpuFacts]:
        return {n.node_id: n.gpu for n in self.core.nodes.values() if n.gpu is not None}

    def restore(self, specs: Sequence[ServiceSpec]) -> None:
        """Services registered before a restart (from Postgres): known, nobody waits."""
        for spec in specs:
            self.services[spec.name] = spec
            self._stale.add(spec.name)

    def register(self, spec: ServiceSpec, now: float) -> list[Effect]:
        """Record ``spec`` and ask every GPU node to prepare it; the answer (``ServiceSettled``)
        comes when each has reported it. What a node said of an earlier spec of the same name
        is forgotten, so the answer waits for its report of this one. The same spec again while
        it is being prepared (a client re-sending its request) joins that registration: its
        deadline holds, so a node that never answers ends it as "not prepared within", not in
        the client's own timeout."""
        pending = self.registering.get(spec.name)
        if pending is not None and pending.spec == spec:
            return []
        self._forgive(spec.name)  # registered again: every node may try its build afresh
        self.services[spec.name] = spec
        self._stale.add(spec.name)
        nodes = self.facts()
        for facts in nodes.values():
            facts.services = {k: v for k, v in facts.services.items() if k[0] != spec.name}
            facts.asked[spec.name] = now
        deadline = now + self.prepare_timeout_s
        self.registering[spec.name] = Registration(spec, set(nodes), deadline)
        return [PrepareOnNode(n, (spec,)) for n in sorted(nodes)] + self.settle(now)

    def states(self) -> tuple[ServiceState, ...]:
        nodes = self.facts()
        return tuple(state_of(self.services[n], nodes) for n in sorted(self.services))

    def on_report(self, node: Node, report: NodeReport, now: float) -> list[Effect]:
        """Take a GPU node's facts: which GPUs it lists, which services it prepared."""
        facts = node.gpu
        assert facts is not None
        listed = {g.index for g in report.inventory.gpus}
        for g in facts.gpus:
            if g not in listed:
                facts.absent.add(g)
                facts.down.add(g)
            elif g in facts.absent:  # listed again: healthy
                facts.absent.discard(g)
                facts.down.discard(g)
        reported = {(e.name, e.dop): e for e in report.services}
        for (node_id, name), why in self.unbuildable.items():
            if node_id == node.node_id and name in self.services:
                dop = self.services[name].dops[0]
                reported[(name, dop)] = PreparedService(name=name, dop=dop, error=why)
        self._stale |= changed(facts.services, reported)
        facts.services = reported
        effects: list[Effect] = []
        ask = [
            s
            for s in missing(facts, self.services.values())
            if now - facts.asked.get(s.name, -self.retry_s) >= self.retry_s
        ]
        if ask:
            facts.asked.update((s.name, now) for s in ask)
            effects.append(PrepareOnNode(node.node_id, tuple(ask)))
        for reg in self.registering.values():
            if node.node_id in reg.waiting_on and has_reported(facts, reg.spec):
                reg.waiting_on.discard(node.node_id)
        for name in {name for name, _ in reported}:
            if (node.node_id, name) not in self.unbuildable:
                self.build_deaths.pop((node.node_id, name), None)  # built, or failed cleanly
        return effects + self.settle(now)

    def node_gone(self, node: Node, now: float, died: bool = True) -> list[Effect]:
        """A GPU node left (``died``: it did not shut down). Registrations stop waiting for it,
        except for the services it died building: its next incarnation answers for those (or
        the registration's deadline), after it is asked once more or, at MAX_BUILD_DEATHS,
        reports them failed."""
        self._failed_on = None  # every service's answer may change: recomputed next pass
        building = self._building(node) if died else set()
        for name in building:
            key = (node.node_id, name)
            self.build_deaths[key] += 1
            if self.build_deaths[key] >= MAX_BUILD_DEATHS:
                self.unbuildable[key] = (
                    f"the gpu_manager of node {node.node_id} ended {self.build_deaths[key]} "
                    f"times in a row while it built service {name!r} (a factory that ends the "
                    "process: os._exit, abort, a crash in native code?); not built there again "
                    "until the service is registered again"
                )
        for reg in self.registering.values():
            if reg.spec.name not in building:
                reg.waiting_on.discard(node.node_id)
        return self.settle(now)

    def _building(self, node: Node) -> set[str]:
        """The services ``node`` was asked to build and has said nothing of yet."""
        facts = _facts(node)
        named = {name for name, _ in facts.services}
        return {name for name in facts.asked if name in self.services and name not in named}

    def _forgive(self, name: str) -> None:
        for key in [k for k in self.build_deaths if k[1] == name]:
            del self.build_deaths[key]
        for key in [k for k in self.unbuildable if k[1] == name]:
            del self.unbuildable[key]

    def settle(self, now: float) -> list[Effect]:
        """Answer the registrations whose wait is over."""
        effects: list[Effect] = []
        for name, reg in list(self.registering.items()):
            if reg.waiting_on and now < reg.deadline:
                continue
            del self.registering[name]
            nodes = self.facts()
            state = state_of(reg.spec, nodes)
            effects.append(ServiceSettled(name, state, self._settle_error(reg, state, nodes)))
        return effects

    def _settle_error(
        self, reg: Registration, state: ServiceState, nodes: dict[str, GpuFacts]
    ) -> str:
        if state.prepared_on or not nodes:
            return ""
        name = reg.spec.name
        failed = failed_everywhere(reg.spec, nodes)
        if failed:
            return f"service {name!r} could not be prepared on any GPU node: {failed}"
        late = ", ".join(sorted(reg.waiting_on)) or "any GPU node"
        return f"service {name!r} was not prepared within {self.prepare_timeout_s:g}s by {late}"

    # ------------------------------------------------------------------ decisions

    def schedule(self, now: float) -> list[Effect]:
        """One pass over the queued infer actions (see the module docstring)."""
        queue = self.core.queue
        acts = [queue[aid] for aid in self.core.pending.gpu()]  # FCFS, as in the queue
        if not acts:
            return []
        self._variants = {}
        effects: list[Effect] = []
        live = [n for n in self.core.nodes.values() if n.gpu is not None and not n.draining]
        servable: list[UnifiedAction] = []
        facts = self.facts()
        self._refresh_failed(facts)
        for act in acts:
            fail = self._unservable(act, now)
            if fail:
                effects += fail
            else:
                servable.append(act)
        self._hot = {service_of(a) for a in servable} | {
            service_of(r.action) for r in self.core.running.values()
        }
        self._shared = gpu_share.occupancy(
            self.core.running.values(), self.core.killed.values(), self.core.nodes
        )
        # joins take no free GPU: the free chunks (and what a grant would restore) hold
        self._free = {n.node_id: gpu.free_chunks_of(gpu.usable(_facts(n), n.free)) for n in live}
        self._costs = {}
        self._chunk_ends = {}
        self._queued = Counter(service_of(a) for a in servable)
        self._copies = gpu_wait.Copies({n.node_id: self._times(n, now) for n in live}, now)
        rest: list[UnifiedAction] = []
        behind: dict[str, list[UnifiedAction]] = {}  # node -> calls waiting for its copies
        # a call booked behind a busy copy leaves its place in the window to the next one
        # (at most WAIT_WINDOWS windows a pass, so a pass still costs the same under any backlog)
        lo, hi = 0, min(self.window, len(servable))
        while lo < hi:
            waiting = 0
            for act in self._ordered(servable[lo:hi], live, now):
                joined = self._join(act, now)
                if joined:
                    effects += joined
                elif (node_id := self._waits(act, live)) is not None:
                    behind.setdefault(node_id, []).append(act)
                    waiting += 1
                else:
                    rest.append(act)
            lo, hi = hi, min(hi + waiting, WAIT_WINDOWS * self.window, len(servable))
        batch = self.services.__getitem__
        groups = gpu_share.groups(rest, self._floor, lambda name: batch(name).max_batch)
        return effects + self._place(groups, behind, live, now)

    def _place(
        self,
        groups: list[Group],
        behind: dict[str, list[UnifiedAction]],
        live: list[Node],
        now: float,
    ) -> list[Effect]:
        """Each group to a node's pool, and each pool arranged by the policy."""
        pools: dict[str, list[Group]] = {}
        budget = {n.node_id: sum(gpu.usable(_facts(n), n.free)) for n in live}
        for group in groups:
            node = self._choose(group[0], live, budget)
            if node is not None and len(pools.get(node.node_id, ())) < self._cap(node):
                pools.setdefault(node.node_id, []).append(group)
                budget[node.node_id] -= self._dops(group[0], node)[0]
        effects: list[Effect] = []
        for node_id, waiting in pools.items():
            effects += self._admit(self.core.nodes[node_id], waiting, behind.get(node_id, []), now)
        return effects

    @property
    def window(self) -> int:
        """How many of the oldest servable calls one pass orders and places: enough to fill
        every GPU node's pool with its lookahead, each candidate a batch of the largest
        ``max_batch``, so a pass costs the same under any backlog."""
        nodes = sum(self._cap(n) for n in self.core.nodes.values() if n.gpu is not None)
        return nodes * max((s.max_batch for s in self.services.values()), default=1)

    # ------------------------------------------------------------------ co-batching

    def held(self, node: Node) -> set[int]:
        """The GPUs of ``node`` some call (running, or cancelled and unconfirmed) is on."""
        return gpu_share.held([*self.core.running.values(), *self.core.killed.values()], node)

    def shares(self, node: Node, act: UnifiedAction, gpus: tuple[int, ...]) -> bool:
        """Whether a call ``node`` runs on ``gpus`` may be adopted beside the calls there."""
        return gpu_share.shares(self.core.running.values(), node, act, gpus)

    def _join(self, act: UnifiedAction, now: float) -> list[Effect]:
        """Start ``act`` on a busy chunk running its service (fewest calls on it first), if
        one has room: the agent batches it with the calls there, no free GPU is taken."""
        name = service_of(act)
        spec = self.services[name]
        if spec.max_batch <= 1:  # a busy chunk holds a call already: none can join
            return []
        best: tuple[int, int, str, tuple[int, ...]] | None = None
        for (node_id, gpus), shared in self._shared.items():
            node = self.core.nodes[node_id]
            if node.draining or set(gpus) & _facts(node).down:
                continue
            if shared.takes(name, self._dops(act, node), spec.max_batch):
                key = (shared.calls, shared.dop, node_id, gpus)
                best = key if best is None or key < best else best
        if best is None:
            return []
        return self._dispatch(self.core.nodes[best[2]], act, best[3], now)

    def _waits(self, act: UnifiedAction, live: list[Node]) -> str | None:
        """The node whose busy copy of its service ``act`` waits for this pass (``gpu_wait``),
        if it waits."""
        name = service_of(act)
        allowed = {n.node_id: self._dops(act, n) for n in live}
        dops = sorted({d for ds in allowed.values() for d in ds})
        if not dops:
            return None
        exec_s = dict(zip(dops, self._durations(act, dops), strict=True))
        restore = {
            (n.node_id, d): gpu.restore_s(_facts(n), name, d)
            for n in live
            for d in allowed[n.node_id]
        }
        max_batch = self.services[name].max_batch
        rivals = self._queued.total() - self._queued[name]
        freed = sum(c.size for chunks in self._free.values() for c in chunks)  # usable, free
        weight = gpu_wait.restore_weight(rivals, freed)
        return self._copies.waits(name, allowed, exec_s, restore, max_batch, weight)

    def _times(self, node: Node, now: float) -> gpu_wait.NodeTimes:
        """When each GPU of ``node`` frees: its calls' predicted ends (``_end``)."""
        runs = [
            (r.cores, gpu_wait.NEVER if r.kill_by is not None else self._end(r, now))
            for r in self.core.running.values()
            if r.node_id == node.node_id and r.incarnation == node.incarnation
        ]
        runs += [
            (r.cores, gpu_wait.NEVER)  # cancelled, not confirmed ended: may be stuck
            for r in self.core.killed.values()
            if r.node_id == node.node_id and r.incarnation == node.incarnation
        ]
        for gpus, end in runs:
            key = (node.node_id, gpus)
            self._chunk_ends[key] = max(end, self._chunk_ends.get(key, end))
        running = {
            gpus: (s.service, s.dop) for (n, gpus), s in self._shared.items() if n == node.node_id
        }
        return gpu_wait.node_times(node, runs, running, now)

    def _end(self, run: Dispatched, now: float) -> float:
        """When ``run`` frees its GPUs as this pass sees it: predicted at dispatch (restore
        included), else (dispatched before a restart) its start plus its duration."""
        aid = run.action.spec.action_id
        end = self._ends.get(aid)
        if end is None:
            end = run.started_at + self._duration(run.action, len(run.cores))
        return gpu_wait.until(end, run.started_at, now)

    def _cost(self, node: Node, service: str, dop: int) -> float:
        key = (node.node_id, service, dop)
        hit = self._costs.get(key)
        if hit is None:
            hit = self._costs[key] = gpu.grant_cost(
                _facts(node), self._free[node.node_id], service, dop
            )
        return hit

    def _cap(self, node: Node) -> int:
        return len(_facts(node).gpus) + self.core.cfg.lookahead

    def _refresh_failed(self, nodes: dict[str, GpuFacts]) -> None:
        """Bring ``_failed`` up to date for the services whose inputs changed since it was
        computed (all of them when the GPU nodes are not the same ones)."""
        if self._failed_on is None or nodes.keys() != self._failed_on:
            self._failed_on = set(nodes)
            self._stale = set(self.services)
        for name in self._stale & self.services.keys():
            self._failed[name] = failed_everywhere(self.services[name], nodes)
        self._stale = set()

    def _unservable(self, act: UnifiedAction, now: float) -> list[Effect]:
        name = service_of(act)
        spec = self.services.get(name)
        if spec is None:
            known = ", ".join(sorted(self.services)) or "none"
            why = f"unknown service {name!r}; registered services: {known}"
            return self._fail(act, ErrorKind.INVALID_REQUEST, why, now)
        failed = self._failed.get(name, "")
        if failed:
            why = f"no GPU node could prepare service {name!r}: {failed}"
            return self._fail(act, ErrorKind.BACKEND_UNAVAILABLE, why, now)
        return []

    def _fail(self, act: UnifiedAction, kind: ErrorKind, why: str, now: float) -> list[Effect]:
        self.core.unqueue(act.spec.action_id)
        return self.core.finish(act, verdict(act, kind, why, now=now))

    def _floor(self, act: UnifiedAction) -> int:
        return self.oom_floor.get(act.spec.action_id, 1)

    def _dops(self, act: UnifiedAction, node: Node) -> tuple[int, ...]:
        """The variants this call may run as on ``node`` (empty: not there)."""
        key = (act.spec.action_id, node.node_id)
        hit = self._variants.get(key)
        if hit is None:
            spec = self.services[service_of(act)]
            floor = self._floor(act)
            dops = (d for d in spec.dops if d >= floor)
            hit = self._variants[key] = gpu.ready_dops(_facts(node), spec.name, dops)
        return hit

    def _choose(self, act: UnifiedAction, live: list[Node], budget: dict[str, int]) -> Node | None:
        """Its pool this pass: where it is resident on a free chunk, else the node with the most
        free GPUs that fits it, else (it waits) the largest node that prepared it."""
        best: tuple[int, int, int, str] | None = None
        for node in live:
            dops = self._dops(act, node)
            if not dops:
                continue
            # a free copy at any DoP the policy may grant (one without chunk arrangement
            # grants the smallest)
            tried = dops if self.chunks is not None else dops[:1]
            warm = any(self._cost(node, service_of(act), d) == 0.0 for d in tried)
            fits = budget[node.node_id] >= dops[0]
            key = (int(fits and warm), int(fits), budget[node.node_id], node.node_id)
            if best is None or key[:3] > best[:3]:
                best = key
        return None if best is None else self.core.nodes[best[3]]

    def _ordered(
        self, acts: list[UnifiedAction], live: list[Node], now: float
    ) -> list[UnifiedAction]:
        """FCFS (queue order), or by HRRS score, highest first (ties: FCFS)."""
        if self.order == "fcfs":
            return acts
        scores = {a.spec.action_id: self._score(a, live, now) for a in acts}
        return sorted(acts, key=lambda a: -scores[a.spec.action_id])

    def _score(self, act: UnifiedAction, live: list[Node], now: float) -> float:
        """HRRS with the call's expected time at its smallest variant, and a setup cost unless
        some node could run it where it is resident."""
        setup, exec_s = float("inf"), DEFAULT_DURATION_S
        for node in live:
            dops = self._dops(act, node)
            if dops:
                setup = min(setup, self._cost(node, service_of(act), dops[0]))
                exec_s = self._duration(act, dops[0])
        setup = 0.0 if setup == float("inf") else setup
        return gpu.hrrs_score(now - act.submitted_at, exec_s, setup)

    def _duration(self, act: UnifiedAction, dop: int) -> float:
        return self._durations(act, (dop,))[0]

    def _durations(self, act: UnifiedAction, dops: Sequence[int]) -> list[float]:
        """Its expected execution at each of ``dops`` (restore excluded)."""
        hint = act.spec.duration
        t_ori = hint.t_ori_s if hint else None
        pf = hint.parallel_fraction if hint else None
        model = resolve(profile_of(act), t_ori, pf, self.learner)
        if model is None:
            return [DEFAULT_DURATION_S] * len(dops)
        return [model.at(d) for d in dops]

    def _admit(
        self, node: Node, groups: list[Group], behind: list[UnifiedAction], now: float
    ) -> list[Effect]:
        """Arrange ``node``'s pool: ``groups`` may start; ``behind`` (calls waiting for its
        busy copies, no restore) weigh in the elastic estimate only."""
        facts = _facts(node)
        chunks = gpu.free_chunks_of(gpu.usable(facts, node.free))
        views = [self._view(g[0], node, facts, chunks) for g in groups]
        counts = gpu.chunk_counts(chunks)
        if self.chunks is not None:
            running = self._running_views(node)
            later = [replace(self._view(a, node, facts, chunks), setup_s=()) for a in behind]
            grants = self.chunks.arrange_chunks(views + later, counts, running, now, len(views))
        else:
            grants = [w.min for w in views[: fits_chunks_at_min(views, counts)]]
        effects: list[Effect] = []
        for group, units in zip(groups, grants, strict=False):
            if units > 0:
                effects += self._start(node, group, units, now)
        return effects

    def _running_views(self, node: Node) -> list[Running]:
        """One per busy chunk (it frees when its last call ends: the latest started), ending
        when its calls were predicted to at dispatch: a restore included, which a duration
        model alone leaves out (the policy would see a chunk that restores for seconds free
        after the execution alone)."""
        latest: dict[tuple[int, ...], Dispatched] = {}
        ends: dict[tuple[int, ...], float | None] = {}
        for r in self.core.running.values():
            if r.node_id == node.node_id:
                seen = latest.get(r.cores)
                if seen is None or r.started_at > seen.started_at:
                    latest[r.cores] = r
                end = self._ends.get(r.action.spec.action_id)
                prior = ends.get(r.cores, end)
                ends[r.cores] = None if end is None or prior is None else max(end, prior)
        return [_running_view(r, ends[r.cores]) for r in latest.values()]

    def _view(
        self, act: UnifiedAction, node: Node, facts: GpuFacts, chunks: Sequence[gpu.Chunk]
    ) -> Waiting:
        dops = self._dops(act, node)
        hint = act.spec.duration
        name = service_of(act)
        return Waiting(
            action_id=act.spec.action_id,
            choices=dops,
            enqueued_at=act.submitted_at,
            profile=profile_of(act),
            t_ori_s=hint.t_ori_s if hint else None,
            parallel_fraction=hint.parallel_fraction if hint else None,
            setup_s=tuple(gpu.grant_cost(facts, chunks, name, d) for d in dops),
        )

    def _start(self, node: Node, group: Group, units: int, now: float) -> list[Effect]:
        """The group's chunk: its first call takes it, the others share it."""
        facts = _facts(node)
        name = service_of(group[0])
        chunks = gpu.free_chunks_of(gpu.usable(facts, node.free))
        held = gpu.cached(facts, self._hot.__contains__)
        chunk = gpu.pick(chunks, units, gpu.resident_positions(facts, name, units), held)
        if chunk is None:  # the policy arranged what the chunks cannot hold: wait
            return []
        gpus = gpu.gpus_of(facts, chunk)
        effects = self._dispatch(node, group[0], gpus, now)
        shared = self._shared[node.node_id, gpus]
        for act in group[1:]:
            if shared.takes(name, self._dops(act, node), self.services[name].max_batch):
                effects += self._dispatch(node, act, gpus, now)
        return effects

    def _dispatch(
        self, node: Node, act: UnifiedAction, gpus: tuple[int, ...], now: float
    ) -> list[Effect]:
        name = service_of(act)
        end = self._predict(node, act, gpus, now)
        self._ends[act.spec.action_id] = end
        self._copies.took(node.node_id, gpus, end)
        node.free -= set(gpus)
        shared = self._shared.setdefault((node.node_id, gpus), gpu.Shared(name, len(gpus)))
        shared.calls += 1
        aid = act.spec.action_id
        self.core.unqueue(aid)
        act = msgspec.structs.replace(act, attempt=act.attempt + 1)
        run = self.core.running[aid] = Dispatched(act, node.node_id, node.incarnation, gpus, now)
        spec = self.services[name]
        run.sent = StartOnNode(
            node.node_id,
            act,
            (),
            node.incarnation,
            gpus=gpus,
            service=spec,
            issued=self.core.issue(),
        )
        return [run.sent]

    def _predict(self, node: Node, act: UnifiedAction, gpus: tuple[int, ...], now: float) -> float:
        """When a call dispatched now on ``gpus`` will end: on a free chunk after restoring its
        service unless resident there; joining a busy chunk, in the batch after the one there."""
        facts = _facts(node)
        exec_s = self._duration(act, len(gpus))
        key = (node.node_id, gpus)
        if not set(gpus) <= node.free:
            end = self._chunk_ends[key] = max(now, self._chunk_ends.get(key, now)) + exec_s
            return end
        where = gpu.positions_of(facts.gpus)
        name = service_of(act)
        positions = [where[g] for g in gpus]
        if gpu.resident_positions(facts, name, len(gpus)).issuperset(positions):
            return now + exec_s
        chunk = chunk_of(positions, len(facts.gpus))
        return now + gpu.restore_s(facts, name, len(gpus), chunk) + exec_s

    # ------------------------------------------------------------------ failures

    def on_failure(self, run: Dispatched, c: Completion, now: float) -> bool:
        """Take a device failure's facts; True when the call goes back to the queue."""
        kind = c.outcome.failure
        node = self.core.nodes.get(run.node_id)
        if kind is ErrorKind.DEVICE_LOST and node is not None and node.gpu is not None:
            node.gpu.down |= set(run.cores)
            return False
        if kind is not ErrorKind.DEVICE_OOM or run.action.spec.action_id in self.oom_floor:
            return False
        larger = [d for d in self.services[service_of(run.action)].dops if d > len(run.cores)]
        if not any(self._dops_at(run.action, d) for d in larger):
            return False
        aid = run.action.spec.action_id
        self.oom_floor[aid] = min(larger)
        self.core.requeue_first(run.action)
        return True

    def _dops_at(self, act: UnifiedAction, dop: int) -> bool:
        name = service_of(act)
        return any(gpu.ready_dops(f, name, (dop,)) for f in self.facts().values())

    def forget(self, action_id: str) -> None:
        self.oom_floor.pop(action_id, None)
        self._ends.pop(action_id, None)

    def learn(self, run: Dispatched, exec_s: float, restore_s: float) -> None:
        """What a successful call took on its GPUs, restore excluded (that is placement's)."""
        self.learner.observe(profile_of(run.action), len(run.cores), max(0.0, exec_s - restore_s))


def _facts(node: Node) -> GpuFacts:
    assert node.gpu is not None
    return node.gpu


def _running_view(r: Dispatched, end: float | None = None) -> Running:
    hint = r.action.spec.duration
    return Running(
        r.action.spec.action_id,
        len(r.cores),
        r.started_at,
        expected_end=end,
        profile=profile_of(r.action),
        t_ori_s=hint.t_ori_s if hint else None,
        parallel_fraction=hint.parallel_fraction if hint else None,
    )
