"""The quota core's records: a quota (its limiter, fair queue and counters), a live quota agent,
an HTTP call in flight and a held lease; and the pure helpers that judge an agent's answer."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from services.scheduler.core.effects import StartOnNode, completed
from services.scheduler.policies.quota_adaptive import AimdConfig
from services.scheduler.policies.quota_fair import FairQueue
from services.scheduler.policies.quota_limiter import Grant, Limiter
from tangram.contract import (
    ActionResult,
    Allocation,
    Completion,
    ErrorKind,
    HttpAction,
    LeaseAction,
    LeaseGrant,
    Outcome,
    QuotaSpec,
    UnifiedAction,
)

PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]


class QuotaConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The quota core's timing, per-job weights (default 1) and AIMD tuning."""

    node_timeout_s: PositiveFloat = 5.0
    node_timeouts: bool = True  # off: the health detector declares silent agents failed
    dispatch_grace_s: PositiveFloat = 3.0
    kill_grace_s: PositiveFloat = 5.0
    weights: dict[str, PositiveFloat] = {}
    aimd: AimdConfig = AimdConfig()


@dataclass
class Quota:
    """One declared quota and what it decides: who waits (fair across jobs) and who holds."""

    spec: QuotaSpec
    limiter: Limiter
    queue: FairQueue[str]
    calls: int = 0
    throttled: int = 0
    # Since when the limiter admits the head of the queue: the time its last refusal named
    # (inf: a release), the release or changed spec that ended such a wait, -inf once the queue
    # was empty. A wait ends here, not at the pass that grants (see ``limiter_wait``).
    admits_from: float = -math.inf

    def refused(self, at: float) -> None:
        """The limiter refused the head until ``at`` (``inf``: until a release)."""
        self.admits_from = at

    def freed(self, now: float, *, respec: bool = False) -> None:
        """Units released (or the spec changed) at ``now``: a head refused until a release
        is admitted from now (any head, on a new spec); the next pass refuses it again if
        not. A refusal until a known time stands: a release does not move a window's or a
        pause's time (a token true-up, or cancelled calls ending a pace, could: such a wait
        ends at the pass that grants, a pass late)."""
        if respec or self.admits_from == math.inf:
            self.admits_from = min(self.admits_from, now)

    @classmethod
    def new(cls, spec: QuotaSpec, cfg: QuotaConfig, now: float) -> Quota:
        limiter = Limiter(spec, now=now, aimd=cfg.aimd)
        return cls(spec, limiter, FairQueue(dict(cfg.weights)))

    def learned_per_s(self) -> float | None:
        """The tightest request rate in force now, per second (None: no request window)."""
        f = self.limiter.adaptive.factor
        rates = [w.declared * f / w.per_s for w in self.limiter.windows]
        return min(rates, default=None)


@dataclass
class Agent:
    """A live quota agent (a node whose inventory kind is ``quota``)."""

    node_id: str
    incarnation: str
    last_seen: float
    draining: bool = False
    in_flight: int = 0


@dataclass
class Call:
    """An HTTP call granted and dispatched: it holds ``grant`` until its agent reports."""

    action: UnifiedAction  # attempt already bumped
    quota: str
    grant: Grant
    node_id: str
    incarnation: str
    started_at: float
    restored: bool = False  # rebuilt from Postgres: unconfirmed until its agent reports
    confirmed: bool = False
    kill_by: float | None = None
    sent: StartOnNode | None = None  # the dispatch, sent once more if its agent never read it
    sent_at: float | None = None  # when it was last sent (None: at ``started_at``)
    waited_s: float = 0.0  # its limiter waits, this try's and the earlier ones' (Timings.wait_s)


@dataclass
class Lease:
    """A granted lease: its units stay held until released or ``expires_at`` (wall clock)."""

    lease_id: str
    quota: str
    grant: Grant
    expires_at: float


class Deadlines:
    """Ids by the time they fall due, so a tick costs what is due, not everything held.

    Lazy: an id that left (granted, released) keeps its entry until it falls due or
    :meth:`keep` drops it; the caller checks each id :meth:`due` yields is still its own."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, at: float, key: str) -> None:
        heapq.heappush(self._heap, (at, key))

    def due(self, now: float) -> Iterator[tuple[float, str]]:
        """Pop every entry due by ``now``, earliest first."""
        while self._heap and self._heap[0][0] <= now:
            yield heapq.heappop(self._heap)

    def keep(self, live: Callable[[str], bool], floor: int) -> None:
        """Drop the entries of ids no longer ``live`` once there are more than ``floor``
        (given as twice the live ids and more: the sweep is paid for by the adds before it)."""
        if len(self._heap) > floor:
            self._heap = [e for e in self._heap if live(e[1])]
            heapq.heapify(self._heap)


@dataclass(frozen=True, slots=True)
class Ask:
    """What a waiting action asks of its quota."""

    quota: str
    units: int
    tokens: int
    lease: bool


def ask_of(action: UnifiedAction) -> Ask | None:
    """The quota demand of an http or lease action (None for any other kind)."""
    match action.spec.action:
        case HttpAction(quota=quota, tokens=tokens):
            return Ask(quota, 1, tokens, lease=False)
        case LeaseAction(quota=quota, units=units, tokens=tokens):
            return Ask(quota, units, tokens, lease=True)
    return None


def limiter_wait(since: float, admits_from: float, now: float) -> float:
    """The limiter's part of a wait from ``since`` to ``now``: until the quota admitted its
    head (``Quota.admits_from``), or all of it while still refused. The rest (the pass that
    came after, a quota agent to dispatch to) is the system's. Calls granted together by one
    late pass all take the head's time, though the later ones may have fitted only at later
    expiries: their waits err short, by at most that pass's lateness (a saturated quota is
    paced, one grant per pace)."""
    return max(0.0, min(now, max(since, admits_from)) - since)


def max_retries(action: UnifiedAction) -> int:
    act = action.spec.action
    return act.max_retries if isinstance(act, HttpAction) else 0


@dataclass(frozen=True, slots=True)
class Verdict:
    """How an agent's answer ends the attempt: ``retry`` it, or finish with ``failure``
    (None: succeeded with the response)."""

    retry: bool
    failure: ErrorKind | None = None
    detail: str = ""
    status: int | None = field(default=None)


def judge(outcome: Outcome, tries: int, retries: int) -> Verdict:
    """A 429 or 5xx (or an unreachable upstream) is retried while ``tries <= retries``, then
    fails ``rate_limited`` / ``upstream_failed``; any other response is the call's success; any
    other failure (a refusal, a timeout, a kill) ends the action as reported."""
    status = outcome.http.status if outcome.http is not None else None
    retryable = status == 429 or (status is not None and status >= 500)
    unreachable = outcome.failure is ErrorKind.UPSTREAM_FAILED and status is None
    if not (retryable or unreachable):
        return Verdict(False, outcome.failure, outcome.detail, status)
    if tries <= retries:
        return Verdict(True, status=status)
    kind = ErrorKind.RATE_LIMITED if status == 429 else ErrorKind.UPSTREAM_FAILED
    what = f"status {status}" if status is not None else f"unreachable ({outcome.detail})"
    return Verdict(False, kind, f"upstream answered {what} on all {tries} tries", status)


def reports(c: Completion, call: Call) -> bool:
    """The completion is of this very dispatch (not an earlier attempt or another agent)."""
    return bool(
        call.node_id == c.node_id
        and call.action.attempt == c.attempt
        and call.incarnation == c.incarnation
    )


def sent_at(outcome: Outcome, now: float) -> float | None:
    """When the call was sent, on the scheduler's clock: ``now`` minus how long ago the agent
    says it sent it (``started_at`` is taken when the request went out). The report's transit
    only makes this later than the real send, whatever the agent's clock reads, so a window
    counting from here never undercounts. None when the agent did not say."""
    started, finished = outcome.started_at, outcome.finished_at
    if started is None or finished is None:
        return None
    return now - max(0.0, float(finished - started))


def call_result(call: Call, outcome: Outcome, judged: Verdict, now: float) -> ActionResult:
    """An http action's result from its last call: ``tries`` counts every grant it took."""
    http = outcome.http
    if http is not None:
        http = msgspec.structs.replace(http, tries=call.action.attempt)
    facts = msgspec.structs.replace(
        outcome, http=http, failure=judged.failure, detail=judged.detail
    )
    allocation = Allocation(node_id=call.node_id, quota=call.quota)
    return completed(call.action, facts, allocation, now=now, wait_s=call.waited_s)


def lease_result(
    action: UnifiedAction, lease: Lease, now: float, waited_s: float = 0.0
) -> ActionResult:
    """A granted lease: ``succeeded`` at once, carrying its grant (the lease id is the action
    id, so a rebuild finds it in the action's stored result) and its limiter wait."""
    grant = LeaseGrant(
        lease_id=lease.lease_id,
        quota=lease.quota,
        units=lease.grant.units,
        expires_at=lease.expires_at,
        tokens=lease.grant.tokens,
    )
    facts = Outcome(exit_code=0, started_at=now, finished_at=now)
    allocation = Allocation(node_id="", quota=lease.quota)
    result = completed(action, facts, allocation, now=now, wait_s=waited_s)
    return msgspec.structs.replace(result, exit_code=None, lease=grant)


def parse_weights(text: str) -> dict[str, float]:
    """Job weights for the quotas' fair share from ``"job=2,other=0.5"`` (unlisted jobs: 1),
    or ValueError naming the bad entry."""
    weights: dict[str, float] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        job, sep, value = entry.partition("=")
        try:
            weight = float(value)
        except ValueError:
            weight = math.nan
        if not sep or not job.strip() or not 0 < weight < math.inf:
            raise ValueError(f"bad job weight {entry!r}: want job=weight with weight > 0")
        weights[job.strip()] = weight
    return weights
