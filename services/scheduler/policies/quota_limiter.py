"""One quota's limiter: concurrency (leases held), request windows and a token window.

Windows are sliding-window logs: a grant is recorded with its time and amount and counts
against the window for ``span + margin`` seconds. A log guarantees that *every* interval of
length ``span`` holds at most ``limit`` units, so a provider counting by fixed windows (however
aligned) or by sliding windows never sees more than its limit; a token bucket or GCRA lets up
to twice the limit into one fixed window (a full burst at the end of one window and a refill
at the start of the next). ``margin_s`` absorbs jitter between our clock and the provider's
arrival times. The log holds one entry per grant; ``per_day`` quotas of up to ~1e6 a day fit.

Tokens are reserved from the caller's estimate at grant time and trued up on release from the
tokens actually used (the entry keeps its time, so the window stays conservative). A 429 still
spends its quota: a retry is a new acquire. The AIMD factor scales every window's limit; an
empty window always admits one request, so a limit never scales below one per window.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from services.scheduler.policies.quota_adaptive import Aimd, AimdConfig, Hints
from tangram.contract import QuotaSpec
from tangram.errors import InvalidRequest

TOKEN_SPAN_S = 60.0
DEFAULT_MARGIN_S = 0.01


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


@dataclass
class _Entry:
    at: float
    amount: float
    expired: bool = False


class Window:
    """A sliding-window log: at most ``limit * factor`` units in any ``span_s`` interval.
    ``name`` is the spec field it enforces, declared as ``limit`` per ``per_s`` seconds."""

    def __init__(self, name: str, limit: float, per_s: float, margin_s: float) -> None:
        self.name, self.declared, self.per_s = name, limit, per_s
        # Below one per window, stretch the window instead: one request per 1/limit windows.
        self.limit, self.span_s = (limit, per_s) if limit >= 1 else (1.0, per_s / limit)
        self.margin_s = margin_s
        self._log: deque[_Entry] = deque()
        self.used = 0.0

    def wait(self, amount: float, now: float, factor: float) -> float | None:
        """When ``amount`` would fit (None: it fits now)."""
        self._expire(now)
        cap = self.limit * factor
        if self.used + amount <= cap or not self._log:
            return None
        need = self.used + amount - cap if amount <= cap else self.used
        freed = 0.0
        for entry in self._log:
            freed += entry.amount
            if freed >= need - 1e-9:
                return entry.at + self.span_s + self.margin_s
        return now  # unreachable: freeing the whole log always suffices

    def add(self, amount: float, now: float) -> _Entry:
        """Record a grant of ``amount`` at ``now``."""
        entry = _Entry(now, amount)
        self._log.append(entry)
        self.used += amount
        return entry

    def entries(self) -> list[_Entry]:
        """The grants still counted, oldest first."""
        return list(self._log)

    def adopt(self, entry: _Entry) -> None:
        """Count an entry of another window of the same quota (a changed spec)."""
        entry.expired = False
        self._log.append(entry)
        self.used += entry.amount

    def true_up(self, entry: _Entry, amount: float, now: float) -> None:
        """Replace a reservation's amount by what was really used (if still in the window)."""
        self._expire(now)
        if not entry.expired:
            self.used += amount - entry.amount
        entry.amount = amount

    def _expire(self, now: float) -> None:
        # The same sum as the time ``wait`` returns, so waiting until then always suffices.
        while self._log and self._log[0].at + self.span_s + self.margin_s <= now:
            entry = self._log.popleft()
            entry.expired = True
            self.used -= entry.amount
        if not self._log:
            self.used = 0.0  # no float drift survives an empty window


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
        self._live: dict[int, _Entry | None] = {}
        self._ids = itertools.count(1)

    def check(self, units: int, tokens: int) -> None:
        """InvalidRequest if ``units`` / ``tokens`` could never be granted under this quota."""
        self._validate(units, tokens)

    def record(self, units: int, tokens: int, at: float) -> None:
        """Count a past grant (at ``at``, no longer held) against the windows: a rebuild after a
        restart, in time order and before any new grant."""
        for window in self.windows:
            window.add(units, at)
        if self.tokens is not None:
            self.tokens.add(tokens, at)

    def hold(self, units: int, at: float) -> Grant:
        """Hold ``units`` of concurrency for a grant already counted by :meth:`record`, whatever
        the limit says (a rebuilt call or lease in flight); release it as any other grant."""
        self.held += units
        grant = Grant(next(self._ids), units, 0, at)
        self._live[grant.id] = None
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

    def try_acquire(self, units: int, tokens: int, now: float) -> Grant | WaitUntil:
        """A grant of ``units`` requests and ``tokens`` reserved tokens, or when to retry."""
        self._validate(units, tokens)
        waiting = self._wait(units, tokens, now)
        if waiting is not None:
            return waiting
        for window in self.windows:
            window.add(units, now)
        entry = self.tokens.add(tokens, now) if self.tokens is not None else None
        self.held += units
        grant = Grant(next(self._ids), units, tokens, now)
        self._live[grant.id] = entry
        return grant

    def release(
        self,
        grant: Grant,
        now: float,
        *,
        tokens_used: int | None = None,
        status: int | None = None,
        retry_after_s: float | None = None,
    ) -> bool:
        """Free ``grant``'s units and feed what the call saw; False if already released."""
        if grant.id not in self._live:
            return False
        entry = self._live.pop(grant.id)
        self.held -= grant.units
        if entry is not None and self.tokens is not None and tokens_used is not None:
            self.tokens.true_up(entry, float(tokens_used), now)
        self._learn(grant, now, status, retry_after_s)
        return True

    def observe(self, hints: Hints, now: float) -> None:
        """Honour rate-limit headers of a response (pause while the provider says 0 remain)."""
        self.adaptive.on_hints(hints, now)

    def next_free_at(self, now: float) -> float:
        """The earliest time one unit without tokens could be granted (``inf``: on a release)."""
        waiting = self._wait(1, 0, now)
        return now if waiting is None else waiting.at

    def learned_rates(self) -> dict[str, float]:
        """The request and token limits in force now, by spec field name."""
        f = self.adaptive.factor
        windows = [*self.windows, *([self.tokens] if self.tokens is not None else [])]
        return {w.name: w.declared * f for w in windows}

    def _wait(self, units: int, tokens: int, now: float) -> WaitUntil | None:
        if now < self.adaptive.paused_until:
            return WaitUntil(self.adaptive.paused_until, "paused")
        limit = self.spec.concurrency
        if limit is not None and self.held + units > limit:
            return WaitUntil(math.inf, "concurrency")
        f = self.adaptive.factor
        waits = [(w.wait(units, now, f), "rate") for w in self.windows]
        if self.tokens is not None and tokens > 0:
            waits.append((self.tokens.wait(tokens, now, f), "tokens"))
        blocked = [(t, why) for t, why in waits if t is not None]
        return WaitUntil(*max(blocked)) if blocked else None

    def _validate(self, units: int, tokens: int) -> None:
        if units < 1 or tokens < 0:
            raise InvalidRequest(f"units must be >= 1 and tokens >= 0 (got {units}, {tokens})")
        limits = [(w.name, w.limit, units) for w in self.windows]
        if self.tokens is not None:
            limits.append((self.tokens.name, self.tokens.limit, tokens))
        if self.spec.concurrency is not None:
            limits.append(("concurrency", self.spec.concurrency, units))
        for field, limit, amount in limits:
            if amount > limit:
                raise InvalidRequest(
                    f"quota {self.spec.name!r}: {amount} exceeds {field}={limit:g}",
                    hint="a single call can never be granted more than the limit",
                )

    def _learn(self, grant: Grant, now: float, status: int | None, retry_s: float | None) -> None:
        if status == 429:
            self.adaptive.on_throttle(now, sent_at=grant.at, retry_after_s=retry_s)
        elif status is not None and status < 500:
            self.adaptive.on_success(now)


def _carried(window: Window, source: Window | None) -> Window:
    """``window`` holding ``source``'s entries (the same objects, so live reservations still
    true up); entries are kept in time order, each expiring by ``window``'s own span."""
    for entry in [] if source is None else source.entries():
        window.adopt(entry)
    return window
