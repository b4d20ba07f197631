"""ACT (action completion time) over time, pure: buckets of finished actions split into queue,
execution and overhead (the rest: hand-offs, dispatch, reporting), and their SVG plot."""

from __future__ import annotations

import html
import time
from collections.abc import Sequence

import msgspec

PARTS = ("queue", "exec", "overhead")
COLORS = {"queue": "#f2a541", "exec": "#3a86c8", "overhead": "#9b5de5"}


class Finished(msgspec.Struct, array_like=True):
    """One finished action: when, and its ACT's parts (seconds)."""

    at: float
    queue_s: float
    exec_s: float
    overhead_s: float  # beyond queue and exec


class Bucket(msgspec.Struct, kw_only=True):
    start: float
    count: int = 0
    queue_s: float = 0.0  # means over the bucket's actions
    exec_s: float = 0.0
    overhead_s: float = 0.0

    @property
    def act_s(self) -> float:
        return self.queue_s + self.exec_s + self.overhead_s


def split(queue_s: float, exec_s: float, overhead_s: float) -> tuple[float, float, float]:
    """(queue, exec, rest) from a result's timings, whose overhead includes the queue."""
    return queue_s, exec_s, max(0.0, overhead_s - queue_s)


def buckets(rows: Sequence[Finished], since: float, until: float, n: int) -> list[Bucket]:
    """``n`` equal buckets over [since, until) with the mean parts of what finished in each."""
    width = max(until - since, 1e-9) / n
    out = [Bucket(start=since + i * width) for i in range(n)]
    for r in rows:
        i = int((r.at - since) / width)
        if 0 <= i < n:
            b = out[i]
            b.count += 1
            b.queue_s += r.queue_s
            b.exec_s += r.exec_s
            b.overhead_s += r.overhead_s
    for b in out:
        if b.count:
            b.queue_s, b.exec_s, b.overhead_s = (
                b.queue_s / b.count,
                b.exec_s / b.count,
                b.overhead_s / b.count,
            )
    return out


def svg(series: Sequence[Bucket], width: int = 720, height: int = 240) -> str:
    """Stacked bars of the mean ACT per bucket (queue, exec, overhead), with a legend."""
    top = max((b.act_s for b in series), default=0.0) or 1.0
    pad, plot_h = 40, height - 60
    bar_w = (width - pad) / max(len(series), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="mean ACT over time" data-testid="act-plot">',
        f'<text x="2" y="12" font-size="11">{_secs(top)}</text>',
        f'<text x="2" y="{plot_h + 10}" font-size="11">0</text>',
        f'<line x1="{pad}" y1="{plot_h + 10}" x2="{width}" y2="{plot_h + 10}" stroke="#999"/>',
    ]
    for i, b in enumerate(series):
        parts.extend(_stack(b, pad + i * bar_w, bar_w, plot_h, top))
    if series:  # the time axis: where the window starts, and where its last bucket does
        y = plot_h + 24
        parts.append(f'<text x="{pad}" y="{y}" font-size="11">{_clock(series[0].start)}</text>')
        parts.append(
            f'<text x="{width - 60}" y="{y}" font-size="11">{_clock(series[-1].start)}</text>'
        )
    for j, part in enumerate(PARTS):
        x = pad + j * 110
        parts.append(
            f'<rect x="{x}" y="{height - 18}" width="10" height="10" fill="{COLORS[part]}"/>'
        )
        parts.append(f'<text x="{x + 14}" y="{height - 9}" font-size="11">{part}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _stack(b: Bucket, x: float, w: float, plot_h: int, top: float) -> list[str]:
    y = plot_h + 10.0
    out = []
    for part, value in zip(PARTS, (b.queue_s, b.exec_s, b.overhead_s), strict=True):
        h = value / top * plot_h
        y -= h
        tip = html.escape(f"{b.count} actions: {part} {_secs(value)}")
        out.append(
            f'<rect x="{x + 1:.1f}" y="{y:.1f}" width="{max(w - 2, 1):.1f}" height="{h:.1f}" '
            f'fill="{COLORS[part]}"><title>{tip}</title></rect>'
        )
    return out


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


def _secs(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"
