"""``tangram quota set|list``: the arguments of a quota and the table of what quotas learned.

Pure: argparse in, ``QuotaSpec`` out; ``QuotaState`` list in, text out (the CLI does the I/O).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from tangram.contract import QuotaSpec, QuotaState, checked_quota
from tangram.errors import InvalidRequest

COLUMNS = ("NAME", "LIMITS", "LEARNED/S", "IN USE", "QUEUED", "CALLS", "429s", "PAUSED", "HOSTS")


def add_set_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("--concurrency", type=int, default=None, help="calls in flight at once")
    p.add_argument("--per-second", type=float, default=None, help="calls per second")
    p.add_argument("--per-minute", type=int, default=None, help="calls per minute")
    p.add_argument("--per-day", type=int, default=None, help="calls per day")
    p.add_argument("--tokens-per-minute", type=int, default=None, help="LLM tokens per minute")
    p.add_argument(
        "--host", action="append", default=[], help="host[:port] calls may reach (repeatable)"
    )
    p.add_argument("--api-key-env", default=None, help="env var of the quota_manager with the key")


def spec_of(args: argparse.Namespace) -> QuotaSpec:
    """The QuotaSpec the arguments declare, validated (InvalidRequest naming the field)."""
    try:
        spec = QuotaSpec(
            args.name,
            concurrency=args.concurrency,
            per_second=args.per_second,
            per_minute=args.per_minute,
            per_day=args.per_day,
            tokens_per_minute=args.tokens_per_minute,
            hosts=tuple(args.host),
            api_key_env=args.api_key_env,
        )
    except ValueError as exc:
        raise InvalidRequest(f"bad quota: {exc}") from exc
    return checked_quota(spec)


def quota_table(states: Sequence[QuotaState], now: float | None = None) -> str:
    """Quotas as an aligned table, one row each, sorted by name."""
    if not states:
        return "no quotas (declare one with: tangram quota set NAME --per-second N ...)"
    now = time.time() if now is None else now
    rows = [COLUMNS, *(_row(s, now) for s in sorted(states, key=lambda s: s.spec.name))]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def _row(s: QuotaState, now: float) -> tuple[str, ...]:
    learned = "-" if s.learned_per_s is None else f"{s.learned_per_s:.3g}"
    paused = "-" if not s.paused_until or s.paused_until <= now else f"{s.paused_until - now:.1f}s"
    return (
        s.spec.name,
        limits_text(s.spec),
        learned,
        str(s.in_use),
        str(s.queued),
        str(s.calls),
        str(s.throttled),
        paused,
        ",".join(s.spec.hosts) or "-",
    )


def limits_text(spec: QuotaSpec) -> str:
    """``concurrency=4 per_second=10 ...`` for the limits the quota declares."""
    return " ".join(f"{k}={v:g}" for k, v in spec.limits().items())
