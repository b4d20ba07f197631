"""A per-action trace waterfall, pure: the action's phases from its timings, then its spans.

Phases: submit (the first span of its trace to its durable acceptance) -> queue (to its grant)
-> grant (to the command's start on the node) -> restore (a model service onto its GPUs)
-> exec -> result (back at the scheduler). Without stored spans the phases alone are drawn.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

PHASES = ("submit", "queue", "grant", "restore", "exec", "result")


class ActionTimes(msgspec.Struct, kw_only=True):
    """What the action's row says of its timing (wall-clock seconds)."""

    submitted_at: float
    granted_at: float | None = None  # its 'running' transition
    started_at: float | None = None
    finished_at: float | None = None
    restore_s: float = 0.0
    result_at: float | None = None  # submitted_at + the ACT the scheduler measured


class Span(msgspec.Struct, kw_only=True):
    trace_id: str
    span_id: str
    parent_id: str = ""
    action_id: str = ""
    name: str
    service: str
    start: float
    end: float
    error: bool = False


class Bar(msgspec.Struct, kw_only=True):
    label: str
    kind: str  # "phase" or "span"
    start: float
    end: float
    service: str = ""
    depth: int = 0
    error: bool = False

    @property
    def duration_s(self) -> float:
        return max(0.0, self.end - self.start)


class Waterfall(msgspec.Struct, kw_only=True):
    t0: float
    t1: float
    bars: list[Bar]
    spans: int  # how many bars are stored spans (0: drawn from the row alone)


def phases(t: ActionTimes, first_span_at: float | None = None) -> list[Bar]:
    """The phase bars the timings allow: a phase not reached is left out, and one whose end
    is unknown ends at the next mark known (an action cancelled in its queue: queue to its
    result)."""
    marks: list[tuple[str, float | None]] = [
        ("submit", first_span_at if first_span_at is not None else t.submitted_at),
        ("queue", t.submitted_at),
        ("grant", t.granted_at if t.granted_at is not None else t.started_at),
        ("restore", t.started_at),
        ("exec", t.started_at + t.restore_s if t.started_at is not None else None),
        ("result", t.finished_at),
        ("end", t.result_at),
    ]
    bars = []
    for i, (label, start) in enumerate(marks[:-1]):
        end = next((m for _, m in marks[i + 1 :] if m is not None), None)
        if start is None or end is None or end < start:
            continue
        if label in ("submit", "restore") and end == start:
            continue  # no span before the row, or no restore: nothing to draw
        bars.append(Bar(label=label, kind="phase", start=start, end=end))
    return bars


def span_bars(spans: Sequence[Span], action_id: str) -> list[Bar]:
    """The spans of ``action_id`` (and those of its trace that name no action), by start,
    indented under their parent."""
    mine = [s for s in spans if s.action_id in ("", action_id)]
    depth: dict[str, int] = {}
    bars = []
    for s in sorted(mine, key=lambda s: s.start):
        d = depth.get(s.parent_id, -1) + 1 if s.parent_id else 0
        depth[s.span_id] = d
        bars.append(
            Bar(
                label=s.name,
                kind="span",
                start=s.start,
                end=s.end,
                service=s.service,
                depth=min(d, 8),
                error=s.error,
            )
        )
    return bars


def waterfall(t: ActionTimes, spans: Sequence[Span], action_id: str) -> Waterfall:
    """Phases then spans, on one time axis."""
    sbars = span_bars(spans, action_id)
    first = min((b.start for b in sbars), default=None)
    bars = phases(t, first if first is not None and first < t.submitted_at else None) + sbars
    t0 = min((b.start for b in bars), default=t.submitted_at)
    t1 = max((b.end for b in bars), default=t0)
    return Waterfall(t0=t0, t1=max(t1, t0 + 1e-6), bars=bars, spans=len(sbars))
