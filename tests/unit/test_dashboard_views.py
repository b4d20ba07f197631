"""The dashboard's pure parts: a trace waterfall's bars, ACT buckets and their plot, the span
store's conversion of finished spans, and what a span is labelled with."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider

from services.dashboard import act, pages
from services.dashboard.waterfall import ActionTimes, Span, phases, waterfall
from tangram import telemetry
from tangram.contract import ActionSpec, ExecAction, Submit

T0 = 1_000.0


def test_phases_follow_the_action_from_submit_to_result() -> None:
    t = ActionTimes(
        submitted_at=T0,
        granted_at=T0 + 1,
        started_at=T0 + 1.5,
        finished_at=T0 + 4,
        restore_s=0.5,
        result_at=T0 + 4.25,
    )
    bars = phases(t, first_span_at=T0 - 0.1)
    got = [(b.label, round(b.start - T0, 3), round(b.end - T0, 3)) for b in bars]
    assert got == [
        ("submit", -0.1, 0.0),
        ("queue", 0.0, 1.0),
        ("grant", 1.0, 1.5),
        ("restore", 1.5, 2.0),
        ("exec", 2.0, 4.0),
        ("result", 4.0, 4.25),
    ]


def test_a_phase_not_reached_is_left_out() -> None:
    bars = phases(ActionTimes(submitted_at=T0, granted_at=None, started_at=None))
    assert bars == []
    queued_only = phases(ActionTimes(submitted_at=T0, granted_at=T0 + 2))
    assert [b.label for b in queued_only] == ["queue"]
    cancelled = phases(ActionTimes(submitted_at=T0, finished_at=T0 + 3, result_at=T0 + 3))
    assert [(b.label, b.end - b.start) for b in cancelled] == [("queue", 3.0), ("result", 0.0)]


def test_spans_of_other_actions_in_a_shared_trace_are_left_out_and_children_indented() -> None:
    spans = [
        Span(trace_id="t", span_id="a", name="gw", service="g", start=T0, end=T0 + 0.01),
        Span(
            trace_id="t",
            span_id="b",
            parent_id="a",
            action_id="x",
            name="node",
            service="c",
            start=T0 + 0.5,
            end=T0 + 0.6,
        ),
        Span(
            trace_id="t",
            span_id="c",
            parent_id="a",
            action_id="other",
            name="node",
            service="c",
            start=T0 + 0.5,
            end=T0 + 0.6,
        ),
    ]
    w = waterfall(
        ActionTimes(submitted_at=T0, started_at=T0 + 0.5, finished_at=T0 + 0.6), spans, "x"
    )
    got = [(b.label, b.depth) for b in w.bars if b.kind == "span"]
    assert got == [("gw", 0), ("node", 1)]
    assert w.spans == 2
    html = pages.waterfall_html(w)
    assert html.count("data-kind='span'") == 2


def test_act_buckets_average_their_actions_and_split_the_overhead() -> None:
    assert act.split(queue_s=1.0, exec_s=2.0, overhead_s=1.5) == (1.0, 2.0, 0.5)
    rows = [act.Finished(T0 + 1, 1.0, 2.0, 0.5), act.Finished(T0 + 2, 3.0, 2.0, 0.5)]
    b = act.buckets([*rows, act.Finished(T0 + 99, 9, 9, 9)], T0, T0 + 10, 2)
    assert (b[0].count, b[0].queue_s, b[0].exec_s, b[0].act_s) == (2, 2.0, 2.0, 4.5)
    assert b[1].count == 0
    svg = act.svg(b)
    assert svg.startswith("<svg")
    assert svg.count("<rect") == 2 * 3 + 3


def test_finished_spans_become_records_labelled_with_their_action() -> None:
    store = telemetry.SpanStore("tangram-test")
    provider = TracerProvider()
    provider.add_span_processor(store)
    spec = ActionSpec(
        action_id="a-1", job_id="j", trajectory_id="t", action=ExecAction(command="true")
    )
    attrs = telemetry.labels(Submit(spec=spec))
    with provider.get_tracer("t").start_as_current_span("outer", attributes=attrs) as outer:
        with provider.get_tracer("t").start_as_current_span("tangram.v1.spans SpanBatch"):
            pass  # the store's own shipping is never shipped
    [rec] = store.take()
    assert rec.action_id == "a-1"
    assert rec.trace_id == f"{outer.get_span_context().trace_id:032x}"
    assert rec.service == "tangram-test"
    assert rec.end >= rec.start > 0
    assert store.take() == []


def test_the_root_sampler_starts_at_most_its_rate_of_traces() -> None:
    now = [0.0]
    roots = telemetry.RootSampler(2.0, clock=lambda: now[0])
    assert [roots.take() for _ in range(3)] == [True, True, False]  # a burst of its rate
    now[0] += 0.5
    assert [roots.take() for _ in range(2)] == [True, False]  # one more each half second
    now[0] += 100.0
    assert sum(roots.take() for _ in range(10)) == 2  # idle time saves no more than a burst
    assert (roots.started, roots.skipped) == (5, 10)
