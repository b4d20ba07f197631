"""HTML of the dashboard's pages, pure: server-rendered, no script needed to read them."""

from __future__ import annotations

import time
from collections.abc import Sequence
from html import escape
from urllib.parse import quote

from services.dashboard import act
from services.dashboard.queries import ActionDetail, ActionQuery, ActionRow, Event, Live
from services.dashboard.waterfall import Bar, Waterfall
from tangram import beats
from tangram.contract import SchedulerStatus

STYLE = """
body{font:14px system-ui,sans-serif;margin:0;color:#222}
nav{background:#1d2b3a;padding:8px 16px}nav a{color:#fff;margin-right:16px;text-decoration:none}
main{padding:12px 16px}table{border-collapse:collapse;margin:8px 0 16px}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;font-size:13px}
th{background:#f3f5f7}.succeeded{color:#1b7f3b}.failed,.err{color:#b3261e}.cancelled{color:#777}
form input,form select{margin-right:8px}.wf{position:relative;width:100%}
.wf .row{display:flex;align-items:center;height:20px}.wf .lab{width:34%;overflow:hidden;
white-space:nowrap;text-overflow:ellipsis;font-size:12px}.wf .track{position:relative;flex:1;
height:14px;background:#f6f6f6}.wf .bar{position:absolute;height:14px;min-width:2px}
.phase{background:#3a86c8}.phase.queue{background:#f2a541}.phase.grant{background:#7bb662}
.phase.restore{background:#e07a5f}.phase.result{background:#9b5de5}.phase.submit{background:#888}
.span{background:#5c6f82}.span.error{background:#b3261e}.dur{width:80px;text-align:right;
font-size:12px;padding-left:6px}
"""


def layout(title: str, body: str, refresh_s: int = 0) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{escape(title)} · tangram"
        f"</title>{meta}<style>{STYLE}</style></head><body><nav><a href='/actions'>Actions</a>"
        "<a href='/live'>Live</a><a href='/act'>ACT</a></nav>"
        f"<main><h2>{escape(title)}</h2>{body}</main></body></html>"
    )


def error_page(status: int, message: str) -> str:
    return layout(f"{status}", f"<p class='err' data-testid='error'>{escape(message)}</p>")


def _when(t: float | None) -> str:
    if t is None:
        return ""
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _secs(s: float | None) -> str:
    if s is None:
        return ""
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], testid: str) -> str:
    """A table of already-escaped cells."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    if not rows:
        body = f"<tr><td colspan='{len(header)}'>none</td></tr>"
    return f"<table data-testid='{testid}'><tr>{head}</tr>{body}</table>"


def actions_page(q: ActionQuery, rows: Sequence[ActionRow]) -> str:
    form = (
        "<form method='get' action='/actions' data-testid='search'>"
        f"<input name='id' placeholder='action id' value='{escape(q.id)}'>"
        f"<input name='job' placeholder='job' value='{escape(q.job)}'>"
        f"<input name='trajectory' placeholder='trajectory' value='{escape(q.trajectory)}'>"
        "<select name='status'>"
        + "".join(
            f"<option{' selected' if s == q.status else ''}>{s}</option>"
            for s in ("", "queued", "running", "succeeded", "failed", "cancelled")
        )
        + "</select><button type='submit'>Search</button></form>"
    )
    cells = [_action_cells(r) for r in rows]
    header = ["ACTION", "JOB", "TRAJECTORY", "KIND", "STATUS", "NODE", "SUBMITTED", "QUEUE", "EXEC"]
    return layout("Actions", form + table(header, cells, "actions"))


def _action_cells(r: ActionRow) -> list[str]:
    link = f"<a href='/actions/{quote(r.action_id, safe='')}'>{escape(r.action_id)}</a>"
    queue = r.started_at - r.submitted_at if r.started_at is not None else None
    run = r.finished_at - r.started_at if r.finished_at and r.started_at else None
    return [
        link,
        escape(r.job_id),
        escape(r.trajectory_id),
        escape(r.kind),
        f"<span class='{escape(r.status)}'>{escape(r.status)}</span>",
        escape(r.node_id or ""),
        _when(r.submitted_at),
        _secs(queue),
        _secs(run),
    ]


def action_page(d: ActionDetail) -> str:
    r, res = d.row, d.result
    facts = [
        ["status", f"<span class='{escape(r.status)}'>{escape(r.status)}</span>"],
        ["job / trajectory", f"{escape(r.job_id)} / {escape(r.trajectory_id)}"],
        ["kind / attempt / node", f"{escape(r.kind)} / {r.attempt} / {escape(r.node_id or '')}"],
        ["trace", escape(d.trace_id) or "none"],
    ]
    if res is not None and res.error is not None:
        facts.append(
            [
                "error",
                f"<span class='err'>{escape(res.error.kind.value)}: "
                f"{escape(res.error.message)}</span>",
            ]
        )
    if res is not None and res.timings is not None:
        t = res.timings
        facts.append(
            [
                "ACT",
                f"queue {_secs(t.queue_s)}, exec {_secs(t.exec_s)} (restore "
                f"{_secs(t.restore_s)}), overhead {_secs(t.overhead_s)}",
            ]
        )
    source = (
        f"{d.waterfall.spans} stored span(s)"
        if d.waterfall.spans
        else ("no stored spans: phases from the action's timings")
    )
    body = (
        table(["", ""], facts, "facts")
        + f"<h3>Waterfall</h3><p data-testid='wf-source'>{source}</p>"
        + waterfall_html(d.waterfall)
        + "<h3>Transitions</h3>"
        + table(
            ["AT", "ATTEMPT", "STATUS", "NODE", "DETAIL"], [_event(e) for e in d.events], "events"
        )
    )
    return layout(f"Action {r.action_id}", body)


def _event(e: Event) -> list[str]:
    return [
        _when(e.at),
        str(e.attempt),
        escape(e.status),
        escape(e.node_id or ""),
        escape(e.detail),
    ]


def waterfall_html(w: Waterfall) -> str:
    span = w.t1 - w.t0
    rows = "".join(_bar(b, w.t0, span) for b in w.bars)
    return f"<div class='wf' data-testid='waterfall'>{rows}</div>"


def _bar(b: Bar, t0: float, span: float) -> str:
    left = (b.start - t0) / span * 100
    width = max(b.duration_s / span * 100, 0.2)
    cls = f"{b.kind} {escape(b.label) if b.kind == 'phase' else ''}{' error' if b.error else ''}"
    label = (
        escape(b.label)
        if b.kind == "phase"
        else ("&nbsp;" * 2 * b.depth + f"{escape(b.service)}: {escape(b.label)}")
    )
    return (
        f"<div class='row' data-kind='{b.kind}' data-testid='{b.kind}'><div class='lab' "
        f"title='{escape(b.label)}'>{label}</div><div class='track'><div class='bar {cls}' "
        f"style='left:{left:.2f}%;width:{width:.2f}%'></div></div>"
        f"<div class='dur'>{_secs(b.duration_s)}</div></div>"
    )


NODE_HEADER = (
    *("NODE", "CORES IN USE", "CORES", "GPUS IN USE", "FREE MiB", "ENVS"),
    *("HEALTH", "PHASE", "LAST PROGRESS"),  # the health detector's judgement
)


def _ago(s: float | None) -> str:
    return "" if s is None else f"{s:.1f} s ago"


def _services(st: SchedulerStatus) -> str:
    """The gateways and schedulers, as the leader last heard their heartbeats."""
    rows = [[escape(c) for c in beats.cells(r)] for r in st.service_rows]
    return "<h3>Services</h3>" + table(beats.COLUMNS, rows, "services")


def live_page(live: Live) -> str:
    parts = [f"<p class='err' data-testid='live-error'>{escape(e)}</p>" for e in live.errors]
    st = live.status
    if st is not None:
        parts.append(
            f"<p data-testid='summary'>scheduler epoch {st.epoch}, policy "
            f"{escape(st.policy)}: {st.nodes} node(s), {st.queued} queued, "
            f"{st.running} running, {st.envs} environment(s)</p>"
        )
        parts.append(_services(st))
        parts.append(
            "<h3>Nodes</h3>"
            + table(
                NODE_HEADER,
                [
                    [
                        escape(n.node_id),
                        "" if n.gpus else str(n.cores - n.free_cores),  # GPU node: GPUs
                        "" if n.gpus else str(n.cores),
                        f"{n.gpus - n.free_gpus}/{n.gpus}" if n.gpus else "",
                        f"{n.free_memory_mb}/{n.memory_mb}",
                        str(n.envs),
                        escape(n.health),
                        escape(n.phase or ("draining" if n.draining else "")),
                        _ago(n.last_progress_s),
                    ]
                    for n in st.node_rows
                ],
                "nodes",
            )
        )
        parts.append(
            "<h3>Queue</h3>"
            + table(
                ["QUEUED", "TRAJECTORY", "CPUS", "WAITED", "WAITING FOR"],
                [
                    [
                        escape(q.action_id),
                        escape(q.trajectory_id),
                        str(q.cpus),
                        _secs(q.waited_s),
                        escape(q.reason),
                    ]
                    for q in st.queue_rows
                ],
                "queue",
            )
        )
        parts.append(
            "<h3>Running</h3>"
            + table(
                ["RUNNING", "TRAJECTORY", "NODE", "CORES", "FOR"],
                [
                    [
                        escape(r.action_id),
                        escape(r.trajectory_id),
                        escape(r.node_id),
                        str(r.cores),
                        _secs(r.running_s),
                    ]
                    for r in st.running_rows
                ],
                "running",
            )
        )
    parts.append(_gpus(live) + _quotas(live))
    return layout("Live", "".join(parts), refresh_s=5)


def _gpus(live: Live) -> str:
    services = live.resources.services if live.resources is not None else ()
    rows = [
        [
            escape(s.spec.name),
            escape(", ".join(s.prepared_on)),
            escape(", ".join(s.resident_on)) or "host only",
            f"{s.footprint_mb} MiB",
            str(s.calls),
            str(s.batches),
            escape(s.error),
        ]
        for s in services
    ]
    busy = [[escape(n), str(k)] for n, k in sorted(live.running_infer.items())]
    return (
        "<h3>GPU services</h3>"
        + table(
            [
                "SERVICE",
                "PREPARED ON",
                "RESIDENT ON (node:gpu)",
                "FOOTPRINT",
                "CALLS",
                "BATCHES",
                "ERROR",
            ],
            rows,
            "services",
        )
        + table(["GPU NODE", "INFER CALLS RUNNING"], busy, "gpu-busy")
    )


def _quotas(live: Live) -> str:
    quotas = live.resources.quotas if live.resources is not None else ()
    rows = [
        [
            escape(q.spec.name),
            f"{q.learned_per_s:.2f}/s" if q.learned_per_s is not None else "",
            str(q.in_use),
            str(q.queued),
            str(q.calls),
            str(q.throttled),
            _when(q.paused_until),
        ]
        for q in quotas
    ]
    header = ["QUOTA", "LEARNED RATE", "IN USE", "QUEUED", "CALLS", "429s", "PAUSED UNTIL"]
    return "<h3>Quotas</h3>" + table(header, rows, "quotas")


def act_page(series: Sequence[act.Bucket], minutes: float) -> str:
    done = sum(b.count for b in series)
    body = (
        f"<p>Mean ACT of the {done} action(s) finished in the last {minutes:g} min, split into "
        "queue, execution and overhead (hand-offs, dispatch, reporting).</p>"
        + act.svg(series)
        + "<form method='get' action='/act'><input name='minutes' value='"
        + f"{minutes:g}'><button>Window (min)</button></form>"
    )
    return layout("ACT over time", body, refresh_s=10)
