"""The node agent's pure core: the agent half of the scheduler <-> agent protocol.

No I/O and no clock of its own: every method takes ``now`` (the agent's wall clock, seconds)
and returns effects for the shell to carry out, in order. It owns the facts of one agent
incarnation: which actions run here and on which granted units (opaque ids, cores on a CPU
node), which completions await the scheduler's ack, and the progress counters heartbeats
carry. Decisions made here, once for every kind of agent:

- fencing: a command with an epoch older than the agent's floor is refused (a deposed
  scheduler cannot start or kill work). The floor rises only to an epoch the agent has
  verified: the one carried by the answer to its own report, which only the leading scheduler
  serves; a command's epoch is never adopted (a forged huge epoch would otherwise wedge the
  agent, every later real dispatch refused as stale). A dispatch meant for another
  incarnation is refused.
- the start lease: the agent starts a dispatch only while its lease holds: ``lease_s`` from
  when it sent the last report the scheduler answered (the registration counts: nothing is
  dispatched here before the scheduler has read one). The scheduler declares a node failed
  only once that many seconds have passed since it last read a report, so a dispatch that
  sat unread in a paused or cut-off agent never starts after its node was declared failed;
  it is held and starts once a report is answered again, or is dropped if the answer is that
  this incarnation was fenced. The lease is measured on a monotonic clock (``mono``).
- the read mark: reports carry the highest ``Dispatch.issued`` read in the floor's epoch
  (``seen``), so the scheduler re-queues an unreported dispatch only when the agent has
  provably read it (and refused it), and otherwise sends the same one again.
- duplicates: a dispatch of an action running here, awaiting its ack, or acked lately at the
  same or a later attempt is ignored (the scheduler may send one again, see the read mark).
- overlap: a dispatch granted a unit that a running action holds is refused, never run
  beside it. The scheduler then sees it unreported and queues it again after its dispatch
  grace; an overlap only arises while a kill is in flight (or from a bug), and sharing a core
  would break the isolation an action's pinning promises. Refusals are counted.
- pipelining: a dispatch that names, in ``after``, the actions holding its units waits here
  (reported as running) and starts the moment they are free, in arrival order, with no round
  trip to the scheduler; killed or dropped while it waits, it ends at once, never run.
- the outbox: a completion is delivered until acked; re-sent when older than ``resend_s``
  and not in flight, at once on ``Reconcile``, and a last time when leaving.
- probes: a ``Ping`` is answered whatever its epoch; one naming another incarnation is
  refused (the detector must not take this one's answer for it); one asking for the canary
  has the shell run the executor's canary first (see ``shell.Canaries``).
- goodbye is last: once :meth:`AgentCore.goodbye` returned, every method returns nothing
  and :meth:`AgentCore.may_send` refuses all but the goodbye itself.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec

from tangram.agent.fit import COMPLETION_BUDGET, fit_completion
from tangram.contract import (
    Ack,
    Commands,
    Completion,
    Dispatch,
    DropEnv,
    EnvExpired,
    ErrorKind,
    Inventory,
    Kill,
    NodeCommand,
    NodeLeaving,
    NodeReport,
    Outcome,
    Ping,
    Prepare,
    Progress,
    Reconcile,
    RunningAction,
    ServiceSpec,
)
from tangram.errors import InvalidRequest

DONE_LIMIT = 10_000  # acked action ids remembered, so a dispatch sent again never runs twice


@dataclass(frozen=True, slots=True)
class AgentConfig:
    node_id: str
    incarnation: str
    heartbeat_s: float = 1.0
    env_ttl_s: float = 3600.0  # an environment idle longer than this is removed
    resend_s: float = 1.0  # an unacknowledged completion is sent again this often
    completion_budget: int = COMPLETION_BUDGET  # encoded bytes a completion may take
    # completion batches awaiting the scheduler's ack at once: one lets the next batch gather
    # while the scheduler commits (two sent more, smaller batches: more messages and commits
    # per action, and no better latency measured at 200/s)
    completions_in_flight: int = 1
    # The shell's bounds (see shell.Agent.on_stop for the order they are spent in).
    completion_timeout_s: float = 5.0
    leave_timeout_s: float = 2.0
    kill_wait_s: float = 2.0
    flush_s: float = 2.0
    # the start lease until a scheduler's answer says otherwise (see the module docstring)
    lease_s: float = 3.0


# --------------------------------------------------------------------------- effects


@dataclass(frozen=True, slots=True)
class Run:
    """Run this dispatch on the executor, then report :meth:`AgentCore.finished`."""

    dispatch: Dispatch


@dataclass(frozen=True, slots=True)
class Stop:
    """Kill a running action on the executor."""

    action_id: str


@dataclass(frozen=True, slots=True)
class Drop:
    """Remove a trajectory's environment on the executor (before anything after it is sent)."""

    trajectory_id: str


@dataclass(frozen=True, slots=True)
class Publish:
    """Send to the scheduler without waiting for an answer."""

    msg: NodeReport | EnvExpired


@dataclass(frozen=True, slots=True)
class Deliver:
    """Request an ack for a completion; report :meth:`AgentCore.delivered` or ``undelivered``."""

    completion: Completion


@dataclass(frozen=True, slots=True)
class Announce:
    """Tell the scheduler the agent is leaving (best effort, bounded)."""

    msg: NodeLeaving


@dataclass(frozen=True, slots=True)
class PrepareServices:
    """Prepare model services on the executor (it reports them in later heartbeats)."""

    services: tuple[ServiceSpec, ...]


@dataclass(frozen=True, slots=True)
class Canary:
    """Run the executor's canary (a trivial action through its real execution path) and
    answer the probe only once it completed."""


Effect = Run | Stop | Drop | Publish | Deliver | Announce | PrepareServices | Canary


class Phase(enum.Enum):
    NEW = "new"  # not registered yet: nothing to report
    UP = "up"
    DRAINING = "draining"  # said so; what runs finishes
    GONE = "gone"  # said goodbye: silent for ever


@dataclass
class _Active:
    attempt: int
    trajectory_id: str
    units: tuple[int, ...]
    kill_reason: ErrorKind | None = None


REFUSED = "the scheduler refused this action's completion"


@dataclass
class _Unacked:
    completion: Completion
    trajectory_id: str
    sent_at: float
    in_flight: int = 1


def with_kill_reason(outcome: Outcome, reason: ErrorKind | None) -> Outcome:
    """A kill on request reports its reason, not the killed exit code or a bare ``cancelled``."""
    if reason is None or outcome.failure not in (None, ErrorKind.CANCELLED):
        return outcome
    detail = outcome.detail or "killed on request"
    return msgspec.structs.replace(outcome, failure=reason, detail=detail)


class AgentCore:
    """One agent incarnation's bookkeeping; every decision returns effects."""

    def __init__(self, cfg: AgentConfig, *, prepares: bool = False) -> None:
        self.cfg = cfg
        self.prepares = prepares  # the executor prepares model services (a GPU node)
        self.phase = Phase.NEW
        self.inventory = Inventory(numa=(), memory_mb=0, backend="", isolates=False)
        self.epoch = 0
        self.active: dict[str, _Active] = {}
        self.unacked: dict[str, _Unacked] = {}
        self.busy: set[int] = set()  # granted units held by running actions
        self.waiting: dict[str, Dispatch] = {}  # pipelined dispatches, in arrival order
        self.progress = Progress()
        self.refused_overlaps = 0
        self.duplicates = 0
        self.lease_s = cfg.lease_s
        self.lease_until = float("-inf")  # monotonic: dispatches start only before it
        self.held = 0  # dispatches held so far for want of a lease
        self.seen = 0  # the highest Dispatch.issued read in epoch ``self.epoch``
        self.done: dict[str, int] = {}  # acked action -> its attempt (bounded: DONE_LIMIT)
        self.on_disk: tuple[str, ...] = ()  # environments holding no memory (set by the shell)
        self._seq = 0
        self._last_words: NodeLeaving | None = None

    @property
    def gone(self) -> bool:
        return self.phase is Phase.GONE

    # ------------------------------------------------------------------ reports

    def register(
        self, inventory: Inventory, envs: Iterable[str], now: float, mono: float | None = None
    ) -> list[Effect]:
        """Come up with what the node offers; the first report registers it. Its sending
        starts the first lease (``mono``: the monotonic clock; ``now`` when not given)."""
        if self.phase is not Phase.NEW:
            return []
        self.inventory = inventory
        self.phase = Phase.UP
        self.lease_until = (now if mono is None else mono) + self.lease_s
        return self.heartbeat(envs, now)

    def heartbeat(self, envs: Iterable[str], now: float) -> list[Effect]:
        """A full report: what runs here, what awaits its ack, the environments, progress."""
        if self.phase not in (Phase.UP, Phase.DRAINING):
            return []
        self._seq += 1
        report = NodeReport(
            node_id=self.cfg.node_id,
            incarnation=self.cfg.incarnation,
            inventory=self.inventory,
            running=self._running(),
            envs=tuple(envs),
            seq=self._seq,
            full=True,
            progress=self.progress,
            envs_on_disk=self.on_disk,
            seen_epoch=self.epoch,
            seen=self.seen,
        )
        return [Publish(report)]

    def _running(self) -> tuple[RunningAction, ...]:
        running = [
            RunningAction(
                action_id=aid,
                attempt=a.attempt,
                trajectory_id=a.trajectory_id,
                cores=a.units,
                # waiting for cores (pipelined), not merely held for a lease: the scheduler
                # chains the waiting ones behind their cores' holders
                waiting=aid in self.waiting and not self.busy.isdisjoint(a.units),
            )
            for aid, a in self.active.items()
        ]
        running += [
            RunningAction(
                action_id=aid, attempt=u.completion.attempt, trajectory_id=u.trajectory_id, cores=()
            )
            for aid, u in self.unacked.items()
        ]
        return tuple(running)

    def may_send(self, msg: object) -> bool:
        """Nothing leaves the agent after its goodbye (a late heartbeat would revive it)."""
        return not self.gone or msg is self._last_words

    # ------------------------------------------------------------------ commands

    def command(
        self, cmd: NodeCommand, envs: Iterable[str], now: float, mono: float | None = None
    ) -> list[Effect]:
        """A scheduler's command; raises :class:`InvalidRequest` when it is refused.
        ``mono`` is the monotonic clock the lease is kept on (``now`` when not given)."""
        if isinstance(cmd, Ping):  # any answer shows the command path is alive
            return self._ping(cmd)
        if self.gone:
            raise InvalidRequest(f"node agent {self.cfg.incarnation} has left")
        if cmd.epoch < self.epoch:
            raise InvalidRequest(f"stale scheduler epoch {cmd.epoch} < {self.epoch}")
        match cmd:
            case Dispatch():
                return self._dispatch(cmd, now, now if mono is None else mono)
            case Kill(action_id=aid, reason=reason):
                return self._kill(aid, reason, now)
            case DropEnv(trajectory_id=tid):
                return self._drop(tid, now)
            case Reconcile():
                return self.heartbeat(envs, now) + self._deliver_all(now)
            case Prepare(services=services):
                if not self.prepares:
                    raise InvalidRequest("this agent prepares no model services")
                return [PrepareServices(services)]
            case Commands():  # the shell unpacks a batch, logging each refusal
                raise InvalidRequest("a batch of commands is taken one command at a time")
        return []

    def _ping(self, ping: Ping) -> list[Effect]:
        """A probe of this incarnation (another's is refused: the detector must not count
        this one's answer for it), with the canary when asked. Neither epoch nor goodbye
        refuses it: it changes nothing here."""
        if ping.incarnation and ping.incarnation != self.cfg.incarnation:
            raise InvalidRequest(
                f"ping for incarnation {ping.incarnation}, this is {self.cfg.incarnation}"
            )
        return [Canary()] if ping.canary else []

    def answered(self, ack: Ack, sent_mono: float, now: float, mono: float) -> list[Effect]:
        """The scheduler answered a report sent at ``sent_mono``: the floor rises to its epoch
        and the lease runs ``lease_s`` from that send; held dispatches may start. A deposed
        scheduler's answer (an epoch under the floor) renews nothing."""
        if ack.epoch < self.epoch:
            return []
        if ack.epoch > self.epoch:
            self.epoch, self.seen = ack.epoch, 0  # the read mark counts in the floor's epoch
        if ack.lease_s > 0:
            self.lease_s = ack.lease_s
        self.lease_until = max(self.lease_until, sent_mono + self.lease_s)
        return self._start_waiting(now, mono)

    def leased(self, mono: float) -> bool:
        """Whether a dispatch may start now (see the start lease)."""
        return mono < self.lease_until

    def _dispatch(self, d: Dispatch, now: float, mono: float) -> list[Effect]:
        if d.epoch == self.epoch:  # read, whatever becomes of it
            self.seen = max(self.seen, d.issued)
        inc = d.incarnation
        if inc and inc != self.cfg.incarnation:
            raise InvalidRequest(
                f"dispatch meant for incarnation {inc}, not {self.cfg.incarnation}"
            )
        aid = d.action.spec.action_id
        if aid in self.active or aid in self.unacked or self.done.get(aid, -1) >= d.action.attempt:
            self.duplicates += 1
            return []  # the first one is running or done
        overlap = self._claimed() & set(d.cores)
        if overlap and not overlap <= self._held_by(d.after):
            self.refused_overlaps += 1
            raise InvalidRequest(f"dispatch of {aid} overlaps busy cores {sorted(overlap)}")
        # Reported back as the action's units: its cores, or its GPUs (whose one-at-a-time
        # use the GPU executor enforces, batching calls to one resident service).
        units = d.cores or d.gpus
        self.active[aid] = _Active(d.action.attempt, d.action.spec.trajectory_id, units)
        if overlap or not self.leased(mono):
            self.held += 0 if overlap else 1
            self.waiting[aid] = d
            return []
        return self._start(d, now)

    def _start(self, d: Dispatch, now: float) -> list[Effect]:
        self.busy |= set(d.cores)
        self._progressed(now, started=1)
        return [Run(d)]

    def _claimed(self) -> set[int]:
        """Units held by running actions or promised to waiting ones."""
        return self.busy.union(*(w.cores for w in self.waiting.values()))

    def _held_by(self, action_ids: tuple[str, ...]) -> set[int]:
        return set().union(*(self.active[a].units for a in action_ids if a in self.active))

    def _start_waiting(self, now: float, mono: float | None = None) -> list[Effect]:
        """Start, in arrival order, each waiting dispatch whose units are all free now (none
        while the lease has lapsed)."""
        if not self.leased(now if mono is None else mono):
            return []
        effects: list[Effect] = []
        taken = set(self.busy)
        for aid, d in list(self.waiting.items()):
            if taken.isdisjoint(d.cores):
                del self.waiting[aid]
                effects += self._start(d, now)
            taken |= set(d.cores)  # a later one never jumps an earlier one on a unit
        return effects

    def _end_waiting(self, aid: str, reason: ErrorKind, now: float) -> list[Effect]:
        """A waiting dispatch killed: it ends now, never having run."""
        del self.waiting[aid]
        active = self.active.pop(aid)
        detail = "killed on request before it started"
        outcome = Outcome(failure=reason, detail=detail, started_at=now, finished_at=now)
        return self._report(aid, active, outcome, now)

    def _kill(self, action_id: str, reason: ErrorKind, now: float) -> list[Effect]:
        active = self.active.get(action_id)
        if active is None:
            return []
        if action_id in self.waiting:
            return self._end_waiting(action_id, reason, now)
        active.kill_reason = reason
        return [Stop(action_id)]

    def _drop(self, trajectory_id: str, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for aid, a in list(self.active.items()):
            if a.trajectory_id != trajectory_id:
                continue
            if aid in self.waiting:
                effects += self._end_waiting(aid, ErrorKind.CANCELLED, now)
            else:
                a.kill_reason = ErrorKind.CANCELLED
        return [*effects, Drop(trajectory_id)]

    def _progressed(self, now: float, started: int = 0, finished: int = 0) -> None:
        p = self.progress
        self.progress = Progress(
            started=p.started + started, finished=p.finished + finished, last_progress_at=now
        )

    # ------------------------------------------------------------------ runs

    def not_started(self, action_id: str, now: float) -> Outcome | None:
        """The outcome of an action killed before its run began (else None: run it)."""
        active = self.active.get(action_id)
        if active is None or active.kill_reason is None:
            return None
        detail = "killed on request before it started"
        return Outcome(failure=active.kill_reason, detail=detail, started_at=now, finished_at=now)

    def finished(
        self, action_id: str, outcome: Outcome, now: float, mono: float | None = None
    ) -> list[Effect]:
        """An action ended: free its units and deliver its completion (fitted to a message)."""
        if action_id in self.waiting:  # not started: nothing of it ran
            return []
        active = self.active.pop(action_id, None)
        if active is None:
            return []
        self.busy -= set(active.units)
        self._progressed(now, finished=1)
        return self._report(action_id, active, outcome, now) + self._start_waiting(now, mono)

    def _report(
        self, action_id: str, active: _Active, outcome: Outcome, now: float
    ) -> list[Effect]:
        """Deliver an ended action's completion (fitted to a message) until it is acked."""
        if self.gone:
            return []
        completion = Completion(
            node_id=self.cfg.node_id,
            incarnation=self.cfg.incarnation,
            action_id=action_id,
            attempt=active.attempt,
            outcome=with_kill_reason(outcome, active.kill_reason),
        )
        completion = fit_completion(completion, self.cfg.completion_budget)
        self.unacked[action_id] = _Unacked(completion, active.trajectory_id, now)
        return [Deliver(completion)]

    # ------------------------------------------------------------------ outbox

    def delivered(self, action_id: str) -> None:
        """The scheduler acked a completion: it is its to keep now (and the action is not run
        again here if its dispatch comes once more)."""
        entry = self.unacked.pop(action_id, None)
        if entry is None:
            return
        self.done[action_id] = entry.completion.attempt
        if len(self.done) > DONE_LIMIT + DONE_LIMIT // 4:  # forget the oldest in one go
            self.done = dict(list(self.done.items())[-DONE_LIMIT:])

    def refused(self, action_id: str, why: str) -> None:
        """The scheduler refused a completion as invalid: it would be at every resend, and the
        action would never end. Its outcome gives way, once, to a plain failure naming why;
        refused again, the completion is dropped (the scheduler then finds the action gone
        from this node's reports, as it does for one lost with a node)."""
        entry = self.unacked.get(action_id)
        if entry is None:
            return
        old = entry.completion.outcome
        if old.failure is ErrorKind.INTERNAL and old.detail.startswith(REFUSED):
            del self.unacked[action_id]
            return
        plain = Outcome(
            failure=ErrorKind.INTERNAL,
            detail=f"{REFUSED}: {why}",
            started_at=old.started_at,
            finished_at=old.finished_at,
        )
        plain_one = msgspec.structs.replace(entry.completion, outcome=plain)
        entry.completion = fit_completion(plain_one, self.cfg.completion_budget)
        entry.in_flight = max(0, entry.in_flight - 1)

    def undelivered(self, action_id: str) -> None:
        """A delivery failed (no ack within its timeout, or refused); it is due again later."""
        entry = self.unacked.get(action_id)
        if entry is not None:
            entry.in_flight = max(0, entry.in_flight - 1)

    def resend(self, now: float) -> list[Effect]:
        """Completions not in flight whose last send is older than ``resend_s``."""
        if self.gone:
            return []
        due = [
            aid
            for aid, u in self.unacked.items()
            if u.in_flight == 0 and now - u.sent_at >= self.cfg.resend_s
        ]
        return [self._send(aid, now) for aid in due]

    def _deliver_all(self, now: float) -> list[Effect]:
        return [self._send(aid, now) for aid in list(self.unacked)]

    def _send(self, action_id: str, now: float) -> Deliver:
        entry = self.unacked[action_id]
        entry.sent_at = now
        entry.in_flight += 1
        return Deliver(entry.completion)

    # ------------------------------------------------------------------ environments

    def expire(self, envs: Mapping[str, float], now: float) -> list[Effect]:
        """Environments idle longer than the TTL with nothing running in them: drop each,
        then tell the scheduler."""
        if self.phase not in (Phase.UP, Phase.DRAINING):
            return []
        busy = {a.trajectory_id for a in self.active.values()}
        effects: list[Effect] = []
        for tid, last_used in envs.items():
            if tid not in busy and now - last_used > self.cfg.env_ttl_s:
                msg = EnvExpired(
                    node_id=self.cfg.node_id, incarnation=self.cfg.incarnation, trajectory_id=tid
                )
                effects += [Drop(tid), Publish(msg)]
        return effects

    # ------------------------------------------------------------------ leaving

    def drain(self) -> list[Effect]:
        """Say the agent is shutting down: no new work for it; what runs finishes."""
        if self.phase is not Phase.UP:
            return []
        self.phase = Phase.DRAINING
        return [Announce(self._leaving(draining=True))]

    def kill_all(self, reason: ErrorKind) -> list[Effect]:
        """Kill what still runs (the drain bound is spent), reporting ``reason``. What still
        waits is forgotten: the goodbye does not list it as started, so the scheduler queues
        it again (it never ran)."""
        for aid in list(self.waiting):
            del self.waiting[aid]
            del self.active[aid]
        for a in self.active.values():
            a.kill_reason = reason
        return [Stop(aid) for aid in self.active]

    def flush(self, now: float) -> list[Effect]:
        """A last delivery of each unacknowledged completion not in flight (the shell waits
        for those, bounded) before the goodbye."""
        if self.gone:
            return []
        return [self._send(aid, now) for aid, u in self.unacked.items() if u.in_flight == 0]

    def goodbye(self, envs: Iterable[str]) -> list[Effect]:
        """The last message: what this incarnation started and the scheduler has not acked,
        and the environments it held. Nothing is sent after it."""
        if self.gone:
            return []
        started = (*self.active, *self.unacked)
        self._last_words = self._leaving(draining=False, started=started, envs=tuple(envs))
        self.phase = Phase.GONE
        return [Announce(self._last_words)]

    def _leaving(
        self,
        *,
        draining: bool,
        started: tuple[str, ...] | None = None,
        envs: tuple[str, ...] | None = None,
    ) -> NodeLeaving:
        return NodeLeaving(
            node_id=self.cfg.node_id,
            incarnation=self.cfg.incarnation,
            draining=draining,
            started=started,
            envs=envs,
        )
