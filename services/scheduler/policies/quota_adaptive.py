"""AIMD learning of a provider's real limit, and the rate-limit hints in response headers.

``Aimd`` keeps a factor ``f`` in ``[floor, 1]`` that scales every declared rate window. A 429
pauses the quota (``Retry-After`` or a default) and cuts ``f`` by ``beta``; every calm period
(``period_s`` with no 429) adds ``step``. Plain AIMD saws between the limit and ``beta`` times it
and keeps hitting 429s, so the factor at each cut is remembered as a ceiling (a rate known to be
too high) and recovery stops ``headroom`` below it; after ``probe_periods`` calm periods at that
cap the ceiling is raised a little, so a limit the provider raises is found again. 429s from calls
sent before the last cut belong to the same episode: they extend the pause but do not cut again.
"""

from __future__ import annotations

import email.utils
import math
import re
from collections.abc import Mapping

from msgspec import Struct


class AimdConfig(Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Tuning of the AIMD controller (defaults suit per-second to per-minute windows)."""

    beta: float = 0.5
    step: float = 0.05
    period_s: float = 1.0
    floor: float = 0.02
    headroom: float = 0.05
    probe_periods: int = 30
    probe_step: float = 0.02
    default_pause_s: float = 1.0


class Hints(Struct, frozen=True):
    """What a response's headers say about the quota: delays are seconds from now."""

    retry_after_s: float | None = None
    remaining: float | None = None
    reset_s: float | None = None


class Aimd:
    """The learned factor on one quota's declared rates, and its pause."""

    def __init__(self, config: AimdConfig | None = None, *, now: float = 0.0) -> None:
        self.config = config or AimdConfig()
        self.factor = 1.0
        self.ceiling = math.inf
        self.paused_until = -math.inf
        self._last_cut_at = -math.inf
        self._calm_since = now
        self._at_cap_periods = 0

    def cap(self) -> float:
        """The highest factor recovery climbs to before probing."""
        return min(1.0, self.ceiling * (1.0 - self.config.headroom))

    def on_throttle(self, now: float, *, sent_at: float, retry_after_s: float | None) -> None:
        """A 429 for a call sent at ``sent_at``: pause, and cut once per episode."""
        pause = self.config.default_pause_s if retry_after_s is None else retry_after_s
        self.pause_until(now + pause)
        if sent_at < self._last_cut_at:
            return
        self.ceiling = self.factor
        self.factor = max(self.config.floor, self.factor * self.config.beta)
        self._last_cut_at = now
        self._calm_since = now
        self._at_cap_periods = 0

    def on_success(self, now: float) -> None:
        """A call went through: credit every calm period elapsed since the last change."""
        periods = int((now - self._calm_since) // self.config.period_s)
        for _ in range(min(periods, 1000)):
            self._recover()
        self._calm_since += periods * self.config.period_s

    def on_hints(self, hints: Hints, now: float) -> None:
        """Honour ``remaining == 0``: pause until the provider's window resets."""
        if hints.remaining is not None and hints.remaining <= 0:
            reset = self.config.default_pause_s if hints.reset_s is None else hints.reset_s
            self.pause_until(now + reset)

    def pause_until(self, t: float) -> None:
        """Grant nothing before ``t``."""
        self.paused_until = max(self.paused_until, t)

    def _recover(self) -> None:
        cap = self.cap()
        if self.factor < cap:
            self.factor = min(cap, self.factor + self.config.step)
            return
        self._at_cap_periods += 1
        if self._at_cap_periods >= self.config.probe_periods:
            self._at_cap_periods = 0
            self.ceiling += self.config.probe_step
            self.factor = self.cap()


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_EPOCH_AFTER = 1e9  # a reset larger than this is a Unix time, not a delay


MAX_DELAY_S = 24 * 3600.0  # as a lease's report: a provider's "years" would stop the quota


def parse_delay(value: str, wall_now: float) -> float | None:
    """Seconds from now in ``value``: ``"2"``, ``"1.5"``, ``"6m0s"``, ``"20ms"``, a Unix time,
    or an HTTP date; None when it is none of those. Never negative, at most a day."""
    delay = _parse_delay(value.strip(), wall_now)
    return None if delay is None else min(delay, MAX_DELAY_S)


def _parse_delay(value: str, wall_now: float) -> float | None:
    try:
        number = float(value)
    except ValueError:
        return _parse_text_delay(value, wall_now)
    if not math.isfinite(number):
        return None
    return max(0.0, number - wall_now if number > _EPOCH_AFTER else number)


def _parse_text_delay(value: str, wall_now: float) -> float | None:
    parts = _DURATION.findall(value)
    if parts and "".join(n + u for n, u in parts) == value:
        return sum(float(n) * _UNIT_S[u] for n, u in parts)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - wall_now)


def parse_hints(headers: Mapping[str, str], wall_now: float) -> Hints:
    """``Retry-After`` and the ``x-ratelimit-remaining[-requests|-tokens]`` / ``-reset`` family
    from a response's headers (any case). ``remaining`` is the smallest family; ``reset_s`` the
    longest reset among exhausted families (else the soonest reset)."""
    lower = {k.lower(): v for k, v in headers.items()}
    retry = lower.get("retry-after")
    families = [
        (
            _number(lower.get(f"x-ratelimit-remaining{s}")),
            _delay(lower.get(f"x-ratelimit-reset{s}"), wall_now),
        )
        for s in _SUFFIXES
    ]
    remaining = [r for r, _ in families if r is not None]
    exhausted = [t for r, t in families if r is not None and r <= 0 and t is not None]
    resets = [t for _, t in families if t is not None]
    return Hints(
        retry_after_s=None if retry is None else parse_delay(retry, wall_now),
        remaining=min(remaining) if remaining else None,
        reset_s=max(exhausted) if exhausted else min(resets, default=None),
    )


_SUFFIXES = ("", "-requests", "-tokens")


def _number(value: str | None) -> float | None:
    try:
        number = float(value) if value is not None else None
    except ValueError:
        return None
    return number if number is not None and math.isfinite(number) else None


def _delay(value: str | None, wall_now: float) -> float | None:
    return None if value is None else parse_delay(value, wall_now)
