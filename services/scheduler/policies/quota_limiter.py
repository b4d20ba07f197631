"""One quota's limiter: concurrency (leases held), request windows and a token window.

Windows are sliding-window logs of SENDS, because the provider counts a request when it
arrives, not when we grant it (the hop scheduler -> bus -> agent adds a variable delay, so a
call granted one window after another can arrive less than a window after it). A grant counts
from the moment it is made until it is released, whatever the time (an *open* entry); its
release says when the call was sent (``sent_at``, never earlier than the real send: see
``QuotaCore``) and the entry then counts for ``span + margin`` seconds from that send. So when
a call is granted, every earlier call sent less than ``span + margin`` before any later moment
is counted, and no interval of length ``span`` ever holds more than ``limit`` sends (proof in
``tests/unit/test_quota_sends.py``). A provider counting by fixed windows (however aligned) or by
sliding windows never sees more than its limit; a token bucket or GCRA lets up to twice the
limit into one fixed window. ``margin_s`` absorbs only the jitter between our send time and the
provider's arrival stamp (network, its own queue). The log holds one entry per grant;
``per_day`` quotas of up to ~1e6 a day fit. A release without a send time (a lost agent, a
lease) settles at the release: the call may have been sent until then.

While the waiting actions ask more units of a request window than it has left, its grants are
paced: one unit every ``span / limit`` seconds (``PACED_SPAN_S``: windows of a minute at most;
never slower than one per window), instead of all it holds at once and then one per expiry,
which replays the same burst every window. A saturated quota sends as many calls, evenly: a
provider that enforces its limit over shorter periods, or by a token bucket with a small burst,
sees no burst, and the mesh handles one call at a time instead of a window's worth together
(``bench.quota``: p50 overhead per call 2.5 -> 1.4 ms). A window with room for every queued
call grants them at once.

Tokens are reserved from the caller's estimate at grant time and trued up on release from the
tokens actually used. A 429 still spends its quota: a retry is a new acquire. The AIMD factor
scales every window's limit; an empty window always admits one request, so a limit never scales
below one per window.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from services.scheduler.policies.quota_adaptive import Aimd, AimdConfig, Hints
from tangram.contract import QuotaSpec, check_fits

TOKEN_SPAN_S = 60.0
DEFAULT_MARGIN_S = 0.01
PACED_SPAN_S = 60.0  # request windows of at most this span pace their grants when saturated


class Grant(NamedTuple):
    """A permit: hold it for the call, then ``release`` it exactly once."""

    id: int
    units: int
    tokens: int
    at: float


class WaitUntil(NamedTuple):
    """Not now: try again at ``at`` (``inf``: when a held lease is released)."""

    at: float
    reason: str


@dataclass(slots=True)
class _Entry:
    at: float  # when the call was sent (only meaningful once settled)
    amount: float
    grant: int  # the grant's id; 0 for a past grant rebuilt from Postgres


class Window:
    """A sliding-window log: at most ``limit * factor`` units sent in any ``span_s`` interval.
    ``name`` is the spec field it enforces, declared as ``limit`` per ``per_s`` seconds."""

    def __init__(self, name: str, limit: float, per_s: float, margin_s: float) -> None:
        self.name, self.declared, self.per_s = name, limit, per_s
        # Below one per window, stretch the window instead: one request per 1/limit windows
        # (so a grant never takes more than ``window_capacity(limit)``: see ``check_fits``).
        self.limit, self.span_s = (limit, per_s) if limit >= 1 else (1.0, per_s / limit)
        self.margin_s = margin_s
        self._log: deque[_Entry] = deque()  # settled: counted until ``at + span + margin``
        self._open: dict[int, _Entry] = {}  # granted, not yet released: always counted
        self.settled = 0.0
        self.open = 0.0
        self.paces = name != "tokens_per_minute" and self.span_s <= PACED_SPAN_S
        self.paced_until = -math.inf  # the last grant's pace: when a paced grant may follow

    @property
    def used(self) -> float:
        return self.settled + self.open

    def wait(self, amount: float, now: float, factor: float, queued: int = 0) -> float | None:
        """When ``amount`` would fit (None: it fits now; ``inf``: only after a release), with
        ``queued`` units waiting for this window (these included): paced when they are more
        than it holds (the module docstring)."""
        self._expire(now)
        cap = self.limit * factor
        if self.used + amount <= cap or not (self._log or self._open):
            if self.paces and now < self.paced_until and self.used + queued > cap:
                return self.paced_until
            return None
        need = self.used + amount - cap if amount <= cap else self.used
        freed = 0.0
        for entry in self._log:
            freed += entry.amount
            if freed >= need - 1e-9:
                return entry.at + self.span_s + self.margin_s
        return math.inf  # calls in flight hold the rest: their release frees it

    def add(self, grant: int, amount: float) -> None:
        """Count a new grant until it is settled."""
        self._open[grant] = _Entry(math.nan, amount, grant)
        self.open += amount

    def pace(self, amount: float, now: float, factor: float) -> None:
        """A grant of ``amount`` made at ``now``: a paced one follows ``amount`` paces later."""
        # never slower than the one request an empty window always admits
        self.paced_until = now + amount * self.span_s / max(self.limit * factor, 1.0)

    def settle(self, grant: int, at: float, now: float, amount: float | None = None) -> None:
        """The grant's call was sent at ``at``: it counts until ``at + span + margin``, with
        ``amount`` if given (tokens trued up); an unknown grant changes nothing."""
        entry = self._open.pop(grant, None)
        if entry is None:
            return
        self.open = self.open - entry.amount if self._open else 0.0
        entry.at = at
        entry.amount = entry.amount if amount is None else amount
        self._insert(entry)
        self._expire(now)

    def record(self, amount: float, at: float) -> None:
        """Count a past call sent at ``at`` (a rebuild)."""
        self._insert(_Entry(at, amount, 0))

    def adopt(self, source: Window) -> None:
        """Count another window's entries (a changed spec): open ones stay open."""
        for entry in source._log:
            self._insert(_Entry(entry.at, entry.amount, entry.grant))
        for grant, entry in source._open.items():
            self.add(grant, entry.amount)
        self.paced_until = max(self.paced_until, source.paced_until)

    def _insert(self, entry: _Entry) -> None:
        # Sends settle nearly in time order: walk back from the newest to keep the log sorted.
        i = len(self._log)
        while i and self._log[i - 1].at > entry.at:
            i -= 1
        self._log.insert(i, entry)
        self.settled += entry.amount

    def _expire(self, now: float) -> None:
        # The same sum as the time ``wait`` returns, so waiting until then always suffices.
        while self._log and self._log[0].at + self.span_s + self.margin_s <= now:
            self.settled -= self._log.popleft().amount
        if not self._log:
            self.settled = 0.0  # no float drift survives an empty log


class Limiter:
    """Everything one quota limits, decided from the injected ``now``."""

    def __init__(
        self,
        spec: QuotaSpec,
        *,
        now: float = 0.0,
        margin_s: float = DEFAULT_MARGIN_S,
        aimd: AimdConfig | None = None,
    ) -> None:
        self.spec = spec
        self.margin_s = margin_s
        self.adaptive = Aimd(aimd, now=now)
        self.windows = [Window(name, n, w, margin_s) for name, n, w in spec.windows()]
        tpm = spec.tokens_per_minute
        self.tokens = (
            None if tpm is None else Window("tokens_per_minute", tpm, TOKEN_SPAN_S, margin_s)
        )
        self.held = 0
        self._live: dict[int, bool] = {}  # grant id -> it reserved tokens
        self._ids = itertools.count(1)

    def check(self, units: int, tokens: int) -> None:
        """InvalidRequest if ``units`` / ``tokens`` could never be granted under this quota."""
        self._validate(units, tokens)

    def record(self, units: int, tokens: int, at: float) -> None:
        """Count a past grant (made at ``at``, sent then or later) against the windows: a
        rebuild after a restart, before any new grant. A call still in flight is also held
        (:meth:`hold`), so it counts twice until this entry expires: conservative."""
        for window in self.windows:
            window.record(units, at)
        if self.tokens is not None:
            self.tokens.record(tokens, at)

    def hold(self, units: int, at: float) -> Grant:
        """Hold ``units`` of concurrency for a grant already counted by :meth:`record`, whatever
        the limit says (a rebuilt call or lease in flight), counted in the request windows until
        released (its send is unknown); release it as any other grant."""
        self.held += units
        grant = Grant(next(self._ids), units, 0, at)
        for window in self.windows:
            window.add(grant.id, units)
        self._live[grant.id] = False
        return grant

    def respec(self, spec: QuotaSpec) -> None:
        """Take a changed spec, keeping what was granted: a window that existed keeps its log; a
        new one starts from the longest old window's log (older grants are unknown to it)."""
        old = {w.name: w for w in self.windows}
        longest = max(self.windows, key=lambda w: w.span_s, default=None)
        self.spec = spec
        self.windows = [
            _carried(Window(name, n, w, self.margin_s), old.get(name) or longest)
            for name, n, w in spec.windows()
        ]
        tpm = spec.tokens_per_minute
        fresh = (
            None if tpm is None else Window("tokens_per_minute", tpm, TOKEN_SPAN_S, self.margin_s)
        )
        self.tokens = None if fresh is None else _carried(fresh, self.tokens)

    def try_acquire(
        self, units: int, tokens: int, now: float, queued: int = 0
    ) -> Grant | WaitUntil:
        """A grant of ``units`` requests and ``tokens`` reserved tokens, or when to retry;
        ``queued``: the units the actions waiting for this quota ask, these included (paced
        beyond a window's room: the module docstring; 0, a caller without a queue: never)."""
        self._validate(units, tokens)
        waiting = self._wait(units, tokens, now, queued)
        if waiting is not None:
            return waiting
        grant = Grant(next(self._ids), units, tokens, now)
        for window in self.windows:
            window.add(grant.id, units)
            window.pace(units, now, self.adaptive.factor)
        if self.tokens is not None:
            self.tokens.add(grant.id, tokens)
        self.held += units
        self._live[grant.id] = True
        return grant

    def release(
        self,
        grant: Grant,
        now: float,
        *,
        sent_at: float | None = None,
        tokens_used: int | None = None,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> bool:
        """Free ``grant``'s units, count its call from ``sent_at`` (None: unknown, so from
        ``now``; kept within the grant and ``now``) and feed what the call saw; False if
        already released."""
        if grant.id not in self._live:
            return False
        reserved = self._live.pop(grant.id)
        self.held -= grant.units
        at = now if sent_at is None else min(max(sent_at, grant.at), now)
        for window in self.windows:
            window.settle(grant.id, at, now)
        if self.tokens is not None:
            used = float(tokens_used) if reserved and tokens_used is not None else None
            self.tokens.settle(grant.id, at, now, used)
        # A 429 speaks of the rate its call was GRANTED at: one granted before the last cut is
        # of the same episode and must not cut again (a send time, later, would say otherwise).
        self._learn(grant.at, now, status, retry_after_s)
        return True

    def observe(self, hints: Hints, now: float) -> None:
        """Honour rate-limit headers of a response (pause while the provider says 0 remain)."""
        self.adaptive.on_hints(hints, now)

    def next_free_at(self, now: float, queued: int = 0) -> float:
        """The earliest time one unit without tokens could be granted with ``queued`` units
        waiting (``inf``: on a release)."""
        waiting = self._wait(1, 0, now, queued)
        return now if waiting is None else waiting.at

    def learned_rates(self) -> dict[str, float]:
        """The request and token limits in force now, by spec field name."""
        f = self.adaptive.factor
        windows = [*self.windows, *([self.tokens] if self.tokens is not None else [])]
        return {w.name: w.declared * f for w in windows}

    def _wait(self, units: int, tokens: int, now: float, queued: int = 0) -> WaitUntil | None:
        if now < self.adaptive.paused_until:
            return WaitUntil(self.adaptive.paused_until, "paused")
        limit = self.spec.concurrency
        if limit is not None and self.held + units > limit:
            return WaitUntil(math.inf, "concurrency")
        f = self.adaptive.factor
        waits = [(w.wait(units, now, f, queued), "rate") for w in self.windows]
        if self.tokens is not None and tokens > 0:
            waits.append((self.tokens.wait(tokens, now, f), "tokens"))
        blocked = [(t, why) for t, why in waits if t is not None]
        return WaitUntil(*max(blocked)) if blocked else None

    def _validate(self, units: int, tokens: int) -> None:
        check_fits(self.spec, units, tokens)  # the gateway's rule: one copy, in the contract

    def _learn(self, granted: float, now: float, status: int | None, retry_s: float | None) -> None:
        if status == 429:
            self.adaptive.on_throttle(now, sent_at=granted, retry_after_s=retry_s)
        elif status is not None and status < 500:
            self.adaptive.on_success(now)


def _carried(window: Window, source: Window | None) -> Window:
    """``window`` counting ``source``'s entries (in flight ones still open, settled ones
    expiring by ``window``'s own span)."""
    if source is not None:
        window.adopt(source)
    return window
