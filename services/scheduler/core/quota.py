"""The quota core: grants of HTTP calls and leases under cluster-wide quotas (§5.1).

Pure like the node core (every call takes ``now``, the scheduler's wall clock; effects are
returned). Per quota: a limiter (concurrency, request windows, a token window with reservation
and true-up, AIMD on 429s, ``policies/quota_limiter.py``) and a weighted fair queue across jobs
(``policies/quota_fair.py``; a job's weight from ``QuotaConfig.weights``, default 1). The head
of the fair order waits for its quota; nothing behind it overtakes it, so a big lease is not
starved by small calls.

An http action is granted one unit (and its reserved tokens) and dispatched to the least loaded
live quota agent; the agent makes one call and reports the facts. Its completion frees the
unit, trues the tokens up and feeds the limiter (status, ``Retry-After``, ``x-ratelimit-*``). A
429 or 5xx (or an unreachable upstream) with tries left queues the action again: a retry is a
new grant, so it spends quota, and it is charged to its job's fair share like any call. A lease
is granted here, without a dispatch: it ends ``succeeded`` carrying its ``LeaseGrant`` (the
lease id is the action id) and its units stay held until ``lease_end`` or its TTL runs out.

An action's limiter wait (``Timings.wait_s``, summed over a retried call's tries) runs from
its receipt here until its quota could admit it: the time the limiter's refusal of the queue's
head named, or the release that ended a refusal until one (``Quota.admits_from``); the pass
that grants it after that, and a wait for a quota agent, are the system's.

A call whose agent dies is not retried (the upstream may have seen it): it fails ``node_died``;
its unit is free again, its window entry stays (it was spent once, and counted once).

Windows count SENDS (the provider counts arrivals): a call counts from its grant until its agent
reports, then from when it was sent (``quota_books.sent_at``: on our clock, never earlier than
the real send); a call whose send is unknown (lost, redone, a lease) counts from its release.
"""

from __future__ import annotations

import math
from collections import Counter

import msgspec

from services.scheduler.core import unlisted
from services.scheduler.core.effects import (
    Effect,
    Finish,
    KillOnNode,
    StartOnNode,
    verdict,
)
from services.scheduler.core.quota_books import (
    Agent,
    Call,
    Deadlines,
    Lease,
    Quota,
    QuotaConfig,
    ask_of,
    call_result,
    judge,
    lease_result,
    limiter_wait,
    max_retries,
    reports,
    sent_at,
)
from services.scheduler.policies.quota_adaptive import parse_hints
from services.scheduler.policies.quota_limiter import Grant, WaitUntil
from tangram.contract import (
    ActionResult,
    Allocation,
    Completion,
    ErrorKind,
    LeaseAction,
    LeaseEnd,
    LeaseGrant,
    NodeLeaving,
    NodeReport,
    Outcome,
    QuotaSpec,
    QuotaState,
    UnifiedAction,
)
from tangram.errors import InvalidRequest

RECENT_LIMIT = 200_000
DEPARTED_LIMIT = 10_000
STALE_DEADLINES = 1024  # dropped past twice the live ones and this many


class QuotaCore:
    """Quotas, quota agents, waiting actions, calls in flight and held leases."""

    def __init__(self, cfg: QuotaConfig | None = None) -> None:
        self.cfg = cfg or QuotaConfig()
        self.quotas: dict[str, Quota] = {}
        self.agents: dict[str, Agent] = {}
        self.waiting: dict[str, UnifiedAction] = {}
        # per quota: the units its waiting actions ask (the fair queues also hold the entries
        # of cancelled and timed-out ones until they come up: they must not pace the others)
        self._asked: Counter[str] = Counter()
        # per waiting action: when its present wait began and its earlier tries' limiter waits
        self._since: dict[str, tuple[float, float]] = {}
        self.calls: dict[str, Call] = {}
        self.killed: dict[str, Call] = {}  # ended at their kill deadline, unit still held
        self.leases: dict[str, Lease] = {}
        self.recent: dict[str, None] = {}
        self.finished = 0  # calls and leases ended so far, each once (see pressure)
        self.departed: dict[tuple[str, str], None] = {}
        self.epoch = 0  # the shell's lead epoch: an agent's read mark counts in it alone
        self.issued = 0  # calls dispatched so far (Dispatch.issued)
        self._refused: list[Effect] = []  # results of actions refused at intake, not yet out
        # What the tick ends, by due time (it never scans every action it holds).
        self._timeouts = Deadlines()  # waiting actions with a queue timeout
        self._expiries = Deadlines()  # leases
        self._kills = Deadlines()  # calls cancelled, by the deadline of their kill
        self._restored: set[str] = set()  # calls restored and not yet confirmed

    # ------------------------------------------------------------------ quotas

    def set_quota(self, spec: QuotaSpec, now: float) -> None:
        """Declare or change a quota; a change keeps what was granted under it."""
        q = self.quotas.get(spec.name)
        if q is None:
            self.quotas[spec.name] = Quota.new(spec, self.cfg, now)
            return
        q.spec = spec
        q.limiter.respec(spec)
        q.freed(now, respec=True)

    def states(self, now: float) -> tuple[QuotaState, ...]:
        """Every quota with what its limiter learned and holds."""
        queued: dict[str, int] = {}
        for action in self.waiting.values():
            ask = ask_of(action)
            if ask is not None:
                queued[ask.quota] = queued.get(ask.quota, 0) + 1
        return tuple(self._state(q, queued.get(name, 0), now) for name, q in self.quotas.items())

    def _state(self, q: Quota, queued: int, now: float) -> QuotaState:
        paused = q.limiter.adaptive.paused_until
        return QuotaState(
            spec=q.spec,
            learned_per_s=q.learned_per_s(),
            in_use=q.limiter.held,
            queued=queued,
            paused_until=paused if paused > now else None,
            calls=q.calls,
            throttled=q.throttled,
        )

    # ------------------------------------------------------------------ intake and rebuild

    def owns(self, action_id: str) -> bool:
        """An action this core holds (waiting, in flight, or killed but not yet confirmed)."""
        return action_id in self.waiting or action_id in self.calls or action_id in self.killed

    def known(self, action_id: str) -> bool:
        return self.owns(action_id) or action_id in self.recent

    def enqueue(self, action: UnifiedAction, now: float) -> list[Effect]:
        """Queue an http or lease action (idempotent); one that can never be granted under its
        quota (unknown, or more than a limit) fails in the next pass with ``invalid_request``."""
        aid = action.spec.action_id
        ask = ask_of(action)
        if ask is None or self.known(aid):
            return []
        problem = self._refusal(ask.quota, ask.units, ask.tokens)
        if problem:  # ends in the next pass, like every decision
            self._refused += self._finish(
                action, verdict(action, ErrorKind.INVALID_REQUEST, problem, now=now)
            )
            return []
        self._wait(action, now)
        self.quotas[ask.quota].queue.push(action.spec.job_id, aid, float(ask.units))
        return []

    def _wait(self, action: UnifiedAction, now: float, before: float = 0.0) -> None:
        """Hold ``action`` for its quota from ``now`` (``before``: its earlier tries' waits)."""
        aid = action.spec.action_id
        ask = ask_of(action)
        if aid not in self.waiting:
            self._since[aid] = (now, before)
            if ask is not None:
                self._asked[ask.quota] += ask.units
        self.waiting[aid] = action
        limit = action.spec.queue_timeout_s
        if limit is not None:
            self._timeouts.add(action.submitted_at + limit, action.spec.action_id)

    def _unwait(self, action: UnifiedAction, now: float) -> float:
        """Take a waiting action out (granted, cancelled, timed out): its limiter waits up to
        ``now``, every try's (``Timings.wait_s``)."""
        aid = action.spec.action_id
        del self.waiting[aid]
        since, before = self._since.pop(aid)
        ask = ask_of(action)
        q = None if ask is None else self.quotas.get(ask.quota)
        if ask is not None:
            self._asked[ask.quota] -= ask.units
            if self._asked[ask.quota] <= 0:
                del self._asked[ask.quota]
        admits_from = -math.inf if q is None else q.admits_from
        return before + limiter_wait(since, admits_from, now)

    def _refusal(self, name: str, units: int, tokens: int) -> str:
        q = self.quotas.get(name)
        if q is None:
            known = ", ".join(sorted(self.quotas)) or "none"
            return f"unknown quota {name!r} (declared: {known})"
        try:
            q.limiter.check(units, tokens)
        except InvalidRequest as exc:
            return str(exc.message)
        return ""

    def record(self, name: str, units: int, tokens: int, at: float) -> None:
        """A grant made before a restart (rebuild, oldest first): it counts in the windows."""
        q = self.quotas.get(name)
        if q is not None:
            q.limiter.record(units, tokens, at)

    def restore_call(
        self, action: UnifiedAction, node_id: str, incarnation: str, now: float
    ) -> None:
        """An http call Postgres says is in flight: it holds its unit until its agent reports
        (already counted by :meth:`record`)."""
        ask = ask_of(action)
        q = None if ask is None else self.quotas.get(ask.quota)
        if ask is None or q is None:
            self.enqueue(action, now)
            return
        grant = q.limiter.hold(1, now)
        self.calls[action.spec.action_id] = Call(
            action, ask.quota, grant, node_id, incarnation, now, restored=True
        )
        self._restored.add(action.spec.action_id)

    def restore_lease(self, grant: LeaseGrant, now: float) -> None:
        """A lease granted before a restart and not expired: held again until released or its
        TTL (a release the old scheduler took is not persisted: the units wait for the TTL)."""
        q = self.quotas.get(grant.quota)
        if q is None or grant.expires_at <= now or grant.lease_id in self.leases:
            return
        held = q.limiter.hold(grant.units, now)
        self.leases[grant.lease_id] = Lease(grant.lease_id, grant.quota, held, grant.expires_at)
        self._expiries.add(grant.expires_at, grant.lease_id)
        self._remember(grant.lease_id)

    # ------------------------------------------------------------------ agents

    def node_report(self, report: NodeReport, now: float) -> list[Effect]:
        """Register a quota agent or take its heartbeat; match its calls with our books."""
        if (report.node_id, report.incarnation) in self.departed:
            return []
        agent = self.agents.get(report.node_id)
        effects: list[Effect] = []
        if agent is not None and agent.incarnation != report.incarnation:
            effects += self._agent_lost(agent, now, "agent restarted")
            agent = None
        if agent is None:
            agent = self.agents[report.node_id] = Agent(report.node_id, report.incarnation, now)
        agent.last_seen = now
        return effects + self._reconcile(agent, report, now)

    def _reconcile(self, agent: Agent, report: NodeReport, now: float) -> list[Effect]:
        reported = {r.action_id for r in report.running}
        effects: list[Effect] = []
        for aid, call in list(self.calls.items()):
            if call.node_id != agent.node_id:
                continue
            if aid in reported and call.incarnation == agent.incarnation:
                call.confirmed = True
            elif call.confirmed or call.incarnation != agent.incarnation:
                effects += self._lost(call, now, "lost track of the call")
            else:
                verdict_ = unlisted.judge(report, call, now, self.epoch, self.cfg.dispatch_grace_s)
                if verdict_ is unlisted.Verdict.REDO:
                    self._redo(call, now)  # it never reached the upstream
                elif verdict_ is unlisted.Verdict.RESEND and call.sent is not None:
                    call.sent_at = now
                    effects.append(call.sent)
        for aid in [a for a, c in self.killed.items() if c.node_id == agent.node_id]:
            if aid not in reported:
                self._release(self.killed.pop(aid), now)
        agent.in_flight = sum(1 for c in self.calls.values() if c.node_id == agent.node_id)
        return effects

    def node_leaving(self, leaving: NodeLeaving, now: float) -> list[Effect]:
        """A quota agent draining (no new calls) or gone; calls it never started go back to
        the queue."""
        agent = self.agents.get(leaving.node_id)
        if agent is None or agent.incarnation != leaving.incarnation:
            return []
        if leaving.draining:
            agent.draining = True
            return []
        if leaving.started is not None:
            started = set(leaving.started)
            for aid, call in list(self.calls.items()):
                if call.node_id == agent.node_id and aid not in started:
                    self._redo(call, now)
        return self._agent_lost(agent, now, "agent shut down")

    def agent_failed(self, node_id: str, incarnation: str, now: float, why: str) -> list[Effect]:
        """The health detector declared this agent failed (its start lease has run out): it
        is fenced and its calls, which may have reached the upstream, end ``node_died``."""
        agent = self.agents.get(node_id)
        if agent is None or agent.incarnation != incarnation:
            return []
        return self._agent_lost(agent, now, why)

    def fenced(self, node_id: str, incarnation: str) -> bool:
        return (node_id, incarnation) in self.departed

    def _agent_lost(self, agent: Agent, now: float, why: str) -> list[Effect]:
        del self.agents[agent.node_id]
        self.departed[agent.node_id, agent.incarnation] = None
        if len(self.departed) > DEPARTED_LIMIT:
            del self.departed[next(iter(self.departed))]
        effects: list[Effect] = []
        for call in [c for c in self.calls.values() if c.node_id == agent.node_id]:
            effects += self._lost(call, now, why)
        for aid in [a for a, c in self.killed.items() if c.node_id == agent.node_id]:
            self._release(self.killed.pop(aid), now)
        return effects

    def _lost(self, call: Call, now: float, why: str) -> list[Effect]:
        """The call may have reached the upstream: not made again, it fails ``node_died``."""
        del self.calls[call.action.spec.action_id]
        self._release(call, now)
        result = verdict(
            call.action,
            ErrorKind.NODE_DIED,
            f"quota agent {call.node_id} died: {why}",
            now=now,
            allocation=Allocation(node_id=call.node_id, quota=call.quota),
            started_at=call.started_at,
            wait_s=call.waited_s,
        )
        return self._finish(call.action, result)

    def _redo(self, call: Call, now: float) -> None:
        """The agent never got this dispatch: queue it again (its window entry stays spent)."""
        del self.calls[call.action.spec.action_id]
        self._release(call, now)
        self._requeue(call, now)

    def _release(self, call: Call, now: float) -> None:
        q = self.quotas.get(call.quota)
        if q is not None:
            q.limiter.release(call.grant, now)
            q.freed(now)

    def _requeue(self, call: Call, now: float) -> None:
        """Queue the call's action again: it waits anew, its earlier waits carried."""
        action = call.action
        ask = ask_of(action)
        if ask is not None and ask.quota in self.quotas:
            self._wait(action, now, call.waited_s)
            self.quotas[ask.quota].queue.push(action.spec.job_id, action.spec.action_id)

    def still_assigned(self, action_id: str, node_id: str, attempt: int) -> bool:
        """The dispatch of ``attempt`` to ``node_id`` is still the call's current one."""
        call = self.calls.get(action_id)
        return call is not None and call.node_id == node_id and call.action.attempt == attempt

    # ------------------------------------------------------------------ completions

    def complete(self, c: Completion, now: float) -> list[Effect]:
        """A quota agent reports a call's facts; stale or duplicate reports change nothing."""
        killed = self.killed.get(c.action_id)
        if killed is not None and reports(c, killed):
            del self.killed[c.action_id]
            self._feed(killed, c.outcome, now)
            return []
        call = self.calls.get(c.action_id)
        if call is None or not reports(c, call):
            return []
        del self.calls[c.action_id]
        agent = self.agents.get(call.node_id)
        if agent is not None:
            agent.in_flight = max(0, agent.in_flight - 1)
        self._feed(call, c.outcome, now)
        tries = call.action.attempt
        judged = judge(c.outcome, tries, max_retries(call.action))
        if judged.retry and call.kill_by is not None:
            why = "cancelled by the client"
            cancelled = verdict(
                call.action, ErrorKind.CANCELLED, why, now=now, wait_s=call.waited_s
            )
            return self._finish(call.action, cancelled)
        if judged.retry:
            self._requeue(call, now)
            return []
        return self._finish(call.action, call_result(call, c.outcome, judged, now))

    def _feed(self, call: Call, outcome: Outcome, now: float) -> None:
        """Free the call's unit; true its tokens up; teach the limiter what the upstream said."""
        q = self.quotas.get(call.quota)
        if q is None:
            return
        http = outcome.http
        hints = parse_hints(http.headers, now) if http is not None else None
        if hints is not None:
            q.limiter.observe(hints, now)
        status = None if http is None else http.status
        q.throttled += status == 429
        q.limiter.release(
            call.grant,
            now,
            sent_at=sent_at(outcome, now),
            tokens_used=outcome.tokens_used,
            status=status,
            retry_after_s=None if hints is None else hints.retry_after_s,
        )
        q.freed(now)

    def lease_end(self, end: LeaseEnd, now: float) -> None:
        """A client released a lease, with what its call saw; unknown or expired: harmless."""
        lease = self.leases.pop(end.lease_id, None)
        q = None if lease is None else self.quotas.get(lease.quota)
        if lease is None or q is None:
            return
        q.throttled += end.status == 429
        q.limiter.release(
            lease.grant,
            now,
            tokens_used=end.tokens_used,
            status=end.status,
            retry_after_s=end.retry_after_s,
        )
        q.freed(now)

    def cancel(
        self, action_id: str, now: float, why: str = "cancelled by the client"
    ) -> list[Effect]:
        action = self.waiting.get(action_id)
        if action is not None:  # its fair-queue entry is skipped when it comes up
            waited = self._unwait(action, now)
            return self._finish(
                action, verdict(action, ErrorKind.CANCELLED, why, now=now, wait_s=waited)
            )
        call = self.calls.get(action_id)
        if call is None:
            return []
        if call.kill_by is None:
            call.kill_by = now + self.cfg.kill_grace_s
            self._kills.add(call.kill_by, action_id)
        return [KillOnNode(call.node_id, action_id, ErrorKind.CANCELLED)]

    def _finish(self, action: UnifiedAction, result: ActionResult) -> list[Effect]:
        self._remember(action.spec.action_id)
        return [Finish(action, result)]

    def _remember(self, action_id: str) -> None:
        if action_id not in self.recent:
            self.finished += 1
        self.recent[action_id] = None
        if len(self.recent) > RECENT_LIMIT:
            del self.recent[next(iter(self.recent))]

    # ------------------------------------------------------------------ time

    def tick(self, now: float) -> list[Effect]:
        """Silent agents are lost; leases past their TTL end; queue timeouts and kill
        deadlines expire; restored calls whose agent never came back fail."""
        effects: list[Effect] = []
        silent = [a for a in self.agents.values() if now - a.last_seen > self.cfg.node_timeout_s]
        for agent in silent if self.cfg.node_timeouts else ():
            effects += self._agent_lost(agent, now, "no heartbeat")
        for at, lid in list(self._expiries.due(now)):
            lease = self.leases.get(lid)
            if lease is not None and lease.expires_at == at:
                self.lease_end(LeaseEnd(lease_id=lid), now)
        self._expiries.keep(self.leases.__contains__, 2 * len(self.leases) + STALE_DEADLINES)
        effects += self._queue_timeouts(now)
        effects += self._kill_deadlines(now)
        return effects + self._restored_lost(now)

    def _queue_timeouts(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for at, aid in list(self._timeouts.due(now)):
            act = self.waiting.get(aid)
            limit = None if act is None else act.spec.queue_timeout_s
            if act is None or limit is None:
                continue
            if not now - act.submitted_at > limit:  # due to the float, not yet past it
                self._timeouts.add(at, aid)
                continue
            waited = self._unwait(act, now)
            why = f"waited more than {limit}s for its quota"
            timed_out = verdict(act, ErrorKind.QUEUE_TIMEOUT, why, now=now, wait_s=waited)
            effects += self._finish(act, timed_out)
        self._timeouts.keep(self.waiting.__contains__, 2 * len(self.waiting) + STALE_DEADLINES)
        return effects

    def _restored_lost(self, now: float) -> list[Effect]:
        """Restored calls whose agent never came back fail (confirmed ones are the agent's)."""
        effects: list[Effect] = []
        for aid in list(self._restored):
            call = self.calls.get(aid)
            if call is None or not call.restored or call.confirmed:
                self._restored.discard(aid)
            elif call.node_id not in self.agents:
                if now - call.started_at > self.cfg.node_timeout_s:
                    self._restored.discard(aid)
                    effects += self._lost(call, now, "did not come back")
        return effects

    def _kill_deadlines(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for at, aid in list(self._kills.due(now)):
            call = self.calls.get(aid)
            if call is None or call.kill_by != at:
                continue
            del self.calls[aid]
            self.killed[aid] = call
            why = f"cancelled; quota agent {call.node_id} did not confirm the kill in time"
            allocation = Allocation(node_id=call.node_id, quota=call.quota)
            result = verdict(
                call.action,
                ErrorKind.CANCELLED,
                why,
                now=now,
                allocation=allocation,
                wait_s=call.waited_s,
            )
            effects += self._finish(call.action, result)
        return effects

    def next_at(self, now: float) -> float | None:
        """When a waiting head could next be granted by time alone (None: not by time)."""
        times = [
            t
            for q in self.quotas.values()
            if len(q.queue)
            for t in [q.limiter.next_free_at(now, self._asked[q.spec.name])]
            if math.isfinite(t)
        ]
        return min(times, default=None)

    # ------------------------------------------------------------------ decisions

    def schedule(self, now: float) -> list[Effect]:
        """Grant every waiting head its quota allows now, in weighted-fair order per quota."""
        effects, self._refused = self._refused, []
        for q in self.quotas.values():
            effects += self._grant(q, now)
        return effects

    def _grant(self, q: Quota, now: float) -> list[Effect]:
        """Grant the heads of ``q``'s fair queue while its limiter admits them; a refusal
        says until when the head waits for the limiter (``Quota.admits_from``)."""
        effects: list[Effect] = []
        while (head := q.queue.peek()) is not None:
            action = self.waiting.get(head[1])
            ask = None if action is None else ask_of(action)
            if action is None or ask is None:
                q.queue.pop()  # cancelled or timed out while waiting
                continue
            agent = None if ask.lease else self._pick_agent()
            if not ask.lease and agent is None:
                break
            got: Grant | WaitUntil | InvalidRequest
            try:
                got = q.limiter.try_acquire(ask.units, ask.tokens, now, self._asked[q.spec.name])
            except InvalidRequest as exc:  # the quota changed under it
                got = exc
            if isinstance(got, WaitUntil):
                q.refused(got.at)
                break
            q.queue.pop()
            effects += self._start(q, action, got, agent, now, self._unwait(action, now))
        if not len(q.queue):
            q.admits_from = -math.inf  # the next arrival waits only if refused
        return effects

    def _start(
        self,
        q: Quota,
        action: UnifiedAction,
        got: Grant | InvalidRequest,
        agent: Agent | None,
        now: float,
        waited: float,
    ) -> list[Effect]:
        if isinstance(got, InvalidRequest):
            refused = verdict(
                action, ErrorKind.INVALID_REQUEST, got.message, now=now, wait_s=waited
            )
            return self._finish(action, refused)
        q.calls += 1
        action = msgspec.structs.replace(action, attempt=action.attempt + 1)
        if agent is None:
            return self._lease(q, action, got, now, waited)
        aid = action.spec.action_id
        call = Call(
            action, q.spec.name, got, agent.node_id, agent.incarnation, now, waited_s=waited
        )
        self.calls[aid] = call
        agent.in_flight += 1
        self.issued += 1  # see Dispatch.issued
        call.sent = StartOnNode(
            agent.node_id,
            action,
            (),
            agent.incarnation,
            quota=q.spec,
            tokens=got.tokens,
            issued=self.issued,
        )
        return [call.sent]

    def _lease(
        self, q: Quota, action: UnifiedAction, got: Grant, now: float, waited: float
    ) -> list[Effect]:
        act = action.spec.action
        ttl = act.ttl_s if isinstance(act, LeaseAction) else 60.0
        lease = self.leases[action.spec.action_id] = Lease(
            action.spec.action_id, q.spec.name, got, now + ttl
        )
        self._expiries.add(lease.expires_at, lease.lease_id)
        return self._finish(action, lease_result(action, lease, now, waited))

    def _pick_agent(self) -> Agent | None:
        """The live, not draining quota agent with the fewest calls in flight."""
        live = [a for a in self.agents.values() if not a.draining]
        return min(live, key=lambda a: (a.in_flight, a.node_id), default=None)

    def snapshot(self) -> dict[str, int]:
        return {
            "quota_waiting": len(self.waiting),
            "quota_calls": len(self.calls),
            "leases": len(self.leases),
            "quota_agents": len(self.agents),
        }
