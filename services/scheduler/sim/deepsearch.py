"""Discrete-event models for quotas: a provider with a true rate limit, a closed loop of
callers behind one limiter, and the DeepSearch comparison of three policies.

Seeded and deterministic; simulated time only. The provider counts *accepted* calls in a
sliding window (429s do not count) and answers a 429 with the exact time until its window
frees, as a well-behaved API does with a fractional ``Retry-After``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.policies.quota_fair import FairQueue
from services.scheduler.policies.quota_limiter import Grant, Limiter
from tangram.contract import QuotaSpec


class Provider:
    """An API that accepts at most ``limit`` calls in any ``span_s`` interval."""

    def __init__(self, limit: int, span_s: float = 1.0) -> None:
        self.limit, self.span_s = limit, span_s
        self._accepted: deque[float] = deque()
        self.ok = 0
        self.throttled = 0
        self.wakes: dict[tuple[str, int], float] = {}

    def call(self, now: float) -> tuple[int, float | None]:
        """``(200, None)`` or ``(429, retry_after_s)`` for a call arriving at ``now``."""
        while self._accepted and self._accepted[0] + self.span_s <= now:
            self._accepted.popleft()
        if len(self._accepted) < self.limit:
            self._accepted.append(now)
            self.ok += 1
            return 200, None
        self.throttled += 1
        return 429, self._accepted[0] + self.span_s - now


@dataclass
class CallLog:
    """What a closed loop saw: each call's ``(time, status)`` and the factor over time."""

    calls: list[tuple[float, int]] = field(default_factory=list)
    factor: list[tuple[float, float]] = field(default_factory=list)

    def share_429(self, since: float) -> float:
        """Fraction of calls after ``since`` answered 429."""
        later = [s for t, s in self.calls if t >= since]
        return sum(s == 429 for s in later) / max(1, len(later))

    def ok_rate(self, since: float, until: float) -> float:
        """Accepted calls per second in ``[since, until)``."""
        ok = sum(1 for t, s in self.calls if since <= t < until and s == 200)
        return ok / (until - since)


def closed_loop(
    limiter: Limiter, provider: Provider, *, callers: int, latency_s: float, duration_s: float
) -> CallLog:
    """``callers`` each calling again as soon as the last call returns, through ``limiter``."""
    log = CallLog()
    seq = itertools.count()
    events: list[tuple[float, int, int, Grant | None]] = [
        (0.0, next(seq), c, None) for c in range(callers)
    ]
    parked: list[int] = []
    while events:
        now, _, caller, done = heapq.heappop(events)
        if now > duration_s:
            break
        if done is not None:
            status, retry = provider.call(done.at)
            log.calls.append((done.at, status))
            limiter.release(done, now, sent_at=done.at, status=status, retry_after_s=retry)
            log.factor.append((now, limiter.adaptive.factor))
            for waiter in [*parked, caller]:
                heapq.heappush(events, (now, next(seq), waiter, None))
            parked.clear()
            continue
        result = limiter.try_acquire(1, 0, now)
        if isinstance(result, Grant):
            heapq.heappush(events, (now + latency_s, next(seq), caller, result))
        elif math.isinf(result.at):
            parked.append(caller)
        else:
            heapq.heappush(events, (result.at, next(seq), caller, None))
    return log


# --- The DeepSearch comparison ------------------------------------------------------------

POLICIES = ("tangram", "per_process", "retry")


@dataclass(frozen=True)
class Workload:
    """Multi-turn trajectories from several jobs, each turn thinking then calling one API."""

    trajectories: int = 240
    jobs: int = 3
    turns: tuple[int, int] = (3, 8)
    think_s: float = 1.0
    rates: tuple[tuple[str, int], ...] = (("search", 10), ("fetch", 20), ("llm", 5))
    latency_s: float = 0.2
    workers: int = 8
    max_retries: int = 3
    backoff_s: float = 0.5
    seed: int = 0


@dataclass
class Report:
    """One policy's outcome: 429s seen, mean action completion time (issue to success),
    failed and completed trajectories, goodput (calls of *completed* trajectories per second
    of makespan; a failed trajectory's calls are wasted) and makespan. ``useful`` counts the
    calls of completed trajectories, so goodput over another horizon can be derived."""

    policy: str
    throttled: int = 0
    act_s: float = 0.0
    failed: int = 0
    completed: int = 0
    goodput: float = 0.0
    makespan_s: float = 0.0
    useful: int = 0


@dataclass
class _Call:
    traj: int
    job: str
    api: str
    turn: int
    issued: float
    attempt: int = 0


def draw(workload: Workload) -> tuple[list[list[str]], list[list[float]]]:
    """Each trajectory's APIs, one per turn, and its think time before each turn."""
    rng = random.Random(workload.seed)
    apis = [api for api, _ in workload.rates]
    plans: list[list[str]] = []
    thinks: list[list[float]] = []
    for _ in range(workload.trajectories):
        turns = rng.randint(*workload.turns)
        plans.append([rng.choice(apis) for _ in range(turns)])
        thinks.append([rng.expovariate(1.0 / workload.think_s) for _ in range(turns)])
    return plans, thinks


def floor_s(workload: Workload) -> float:
    """A lower bound on any policy's makespan for completing every trajectory: the busiest
    provider's calls at its limit per second, and the longest chain of thinks and calls."""
    plans, thinks = draw(workload)
    calls = Counter(api for plan in plans for api in plan)
    provider = max((math.ceil(calls[api] / limit) - 1) for api, limit in workload.rates)
    chain = max(sum(t) + len(t) * workload.latency_s for t in thinks)
    return max(float(provider), chain)


class _Run:
    """One policy over one workload: an event heap and the callbacks the policy chains."""

    def __init__(self, workload: Workload, policy: str) -> None:
        self.w, self.policy = workload, policy
        # Backoff jitter has its own stream: the workload (plans, think times) is drawn up front
        # by ``draw``, so every policy runs exactly the same trajectories.
        self.jitter = random.Random(f"backoff-{workload.seed}")
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.providers = {api: Provider(limit) for api, limit in workload.rates}
        owners = workload.workers if policy == "per_process" else 1
        self.limiters = {
            (api, k): Limiter(QuotaSpec(api, per_second=limit))
            for api, limit in workload.rates
            for k in range(owners)
        }
        self.queues: dict[tuple[str, int], FairQueue[_Call]] = {
            k: FairQueue() for k in self.limiters
        }
        self.plans, self.thinks = draw(workload)
        self.acts: list[float] = []
        self.failed: set[int] = set()
        self.throttled = 0
        self.wakes: dict[tuple[str, int], float] = {}

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (t, next(self.seq), fn))

    def run(self) -> Report:
        for i in range(self.w.trajectories):
            self.at(0.0, functools.partial(self._next_turn, i, 0))
        now = 0.0
        while self.events:
            now, _, fn = heapq.heappop(self.events)
            fn(now)
        done = [i for i in range(self.w.trajectories) if i not in self.failed]
        useful = sum(len(self.plans[i]) for i in done)
        return Report(
            self.policy,
            throttled=self.throttled,
            act_s=sum(self.acts) / max(1, len(self.acts)),
            failed=len(self.failed),
            completed=len(done),
            goodput=useful / now if now > 0 else 0.0,
            makespan_s=now,
            useful=useful,
        )

    def _next_turn(self, traj: int, turn: int, now: float) -> None:
        if turn >= len(self.plans[traj]) or traj in self.failed:
            return
        think = self.thinks[traj][turn]
        call = _Call(traj, f"job{traj % self.w.jobs}", self.plans[traj][turn], turn, now + think)
        self.at(now + think, lambda t: self._submit(call, t))

    def _submit(self, call: _Call, now: float) -> None:
        if self.policy == "retry":
            self._send(call, None, now)
            return
        owner = (call.api, call.traj % self.w.workers if self.policy == "per_process" else 0)
        self.queues[owner].push(call.job, call)
        self._dispatch(owner, now)

    def _dispatch(self, owner: tuple[str, int], now: float) -> None:
        queue, limiter = self.queues[owner], self.limiters[owner]
        while len(queue):
            # Tangram's core paces a saturated window by its queue (quota_limiter); a worker's
            # own limiter (per_process) knows no queue but its own and grants as it can
            queued = len(queue) if self.policy == "tangram" else 0
            result = limiter.try_acquire(1, 0, now, queued)
            if not isinstance(result, Grant):
                self._wake(owner, result.at)
                return
            _, call = queue.pop()
            self._send(call, (owner, result), now)

    def _wake(self, owner: tuple[str, int], t: float) -> None:
        if math.isinf(t) or self.wakes.get(owner, math.inf) <= t:
            return  # a release or an earlier wake-up will dispatch
        self.wakes[owner] = t
        self.at(t, lambda now: self._woken(owner, now))

    def _woken(self, owner: tuple[str, int], now: float) -> None:
        if self.wakes.get(owner) == now:
            del self.wakes[owner]
        self._dispatch(owner, now)

    def _send(self, call: _Call, held: tuple[tuple[str, int], Grant] | None, now: float) -> None:
        status, retry = self.providers[call.api].call(now)
        self.at(now + self.w.latency_s, lambda t: self._answer(call, held, status, retry, t))

    def _answer(
        self,
        call: _Call,
        held: tuple[tuple[str, int], Grant] | None,
        status: int,
        retry: float | None,
        now: float,
    ) -> None:
        if held is not None:
            owner, grant = held
            learns = self.policy == "tangram"  # a per-process limiter does not learn
            self.limiters[owner].release(
                grant,
                now,
                sent_at=grant.at,
                status=status if learns else None,
                retry_after_s=retry,
            )
        if status == 200:
            self.acts.append(now - call.issued)
            self._next_turn(call.traj, call.turn + 1, now)
        else:
            self._throttled(call, now)

    def _throttled(self, call: _Call, now: float) -> None:
        self.throttled += 1
        if self.policy != "tangram" and call.attempt >= self.w.max_retries:
            self.failed.add(call.traj)
            return
        backoff = 0.0 if self.policy == "tangram" else self._backoff(call.attempt)
        call.attempt += 1
        self.at(now + backoff, lambda t: self._submit(call, t))

    def _backoff(self, attempt: int) -> float:
        return float(self.w.backoff_s * 2.0**attempt * self.jitter.uniform(0.5, 1.5))


def compare(workload: Workload | None = None) -> list[Report]:
    """Run every policy on the same seeded workload."""
    workload = workload or Workload()
    return [_Run(workload, policy).run() for policy in POLICIES]
