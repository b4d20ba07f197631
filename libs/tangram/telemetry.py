"""OpenTelemetry setup, the span store, and W3C trace-context helpers used by the bus middleware.

A service records spans when it exports them over OTLP (``OTEL_EXPORTER_OTLP_ENDPOINT``) or
stores them (``traces_per_s``: the default of every service; shipped in batches to the
dashboard, which keeps them in Postgres); both may be on. A process doing neither records
nothing, but incoming trace context still flows through every hop so that one action stays
one trace wherever a recording process sits on the path.

Storing alone starts at most ``traces_per_s`` new traces a second (:class:`RootSampler`), each
at a submit to the gateway: one arriving without trace context starts one only while that
budget lasts, and one that does not carries no context on, so the untraced path costs what it
cost with tracing off. Every message carrying a started trace's context is traced. At a few
actions a second every action is traced; under load the cost stays bounded (a traced message
costs ~30-40 us of CPU here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Final

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from tangram.contract import ActionResult, Completion, Dispatch, Enqueue, Submit, SubmitMany
from tangram.contract.spans import MAX_SPANS, SpanBatch, SpanRecord
from tangram.subjects import SPANS

if TYPE_CHECKING:
    from tangram.bus import Bus

log = logging.getLogger(__name__)

TRACER_NAME = "tangram"
ACTION_ID: Final = "tangram.action_id"  # the span attribute naming the action a span served
SHIP_EVERY_S: Final = 0.5
BUFFERED: Final = 50_000  # finished spans held while the broker is away; the oldest go first
_configured = False
_store: SpanStore | None = None
_roots: RootSampler | None = None  # None: every message without context starts a trace
_tracer: trace.Tracer | None = None  # the installed provider's, got once (see tracer())


def setup(
    service_name: str,
    endpoint: str | None,
    exporter: SpanExporter | None = None,
    *,
    traces_per_s: float = 0.0,
) -> bool:
    """Install an SDK tracer provider when spans are exported (an endpoint or an explicit
    exporter is given) or stored (``traces_per_s`` > 0: new traces a second, at most)."""
    global _configured, _store, _roots, _tracer
    store = traces_per_s > 0
    if _configured or (endpoint is None and exporter is None and not store):
        return _configured
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if endpoint is not None and exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=_traces_url(endpoint))
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
        log.info("tracing to %s", endpoint or type(exporter).__name__)
    if store:
        _store = SpanStore(service_name)
        provider.add_span_processor(_store)
        if exporter is None:  # an exporter is given every trace, as before
            _roots = RootSampler(traces_per_s)
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer(TRACER_NAME)  # the global provider's (the first set wins)
    _configured = True
    return True


class RootSampler:
    """A token bucket of new traces: ``rate`` a second, up to ``rate`` (at least one) at once."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = max(rate, 1.0)
        self._clock = clock
        self._tokens = self.burst
        self._at = clock()
        self.started = 0
        self.skipped = 0

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            self.started += 1
            return True
        self.skipped += 1
        return False


def start_trace(msg: object) -> bool:
    """Whether ``msg``, arrived without trace context, starts a trace here: any message when
    spans are exported; when they are only stored, a submit while the budget lasts (an
    action's trace starts where the action enters the mesh)."""
    if not _configured:
        return False
    if _roots is None:
        return True
    return isinstance(msg, Submit | SubmitMany) and _roots.take()


class SpanStore(SpanProcessor):
    """Holds finished spans until :func:`ship_spans` sends them (bounded: while nobody takes
    them, the oldest are dropped). ``on_end`` only appends: the conversion happens at ship
    time, off the path of the message that ended the span."""

    def __init__(self, service: str, limit: int = BUFFERED) -> None:
        self.service = service
        self._spans: deque[ReadableSpan] = deque(maxlen=limit)

    def on_start(self, span: Any, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        self._spans.append(span)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True

    def take(self) -> list[SpanRecord]:
        """Every span held, as records (the store's own shipping excluded), oldest first."""
        out = []
        while self._spans:
            span = self._spans.popleft()
            if not span.name.startswith(SPANS.subject):
                out.append(record(span, self.service))
        return out


def record(span: ReadableSpan, service: str) -> SpanRecord:
    """The wire form of a finished span."""
    ctx, parent = span.context, span.parent
    assert ctx is not None  # an SDK span always has one
    return SpanRecord(
        trace_id=f"{ctx.trace_id:032x}",
        span_id=f"{ctx.span_id:016x}",
        parent_id=f"{parent.span_id:016x}" if parent is not None else "",
        name=span.name[:256],
        service=service,
        start=(span.start_time or 0) / 1e9,
        end=(span.end_time or 0) / 1e9,
        error=span.status.status_code is trace.StatusCode.ERROR,
        action_id=str((span.attributes or {}).get(ACTION_ID, ""))[:128],
    )


async def ship_spans(
    stack: contextlib.AsyncExitStack, nats_url: str, name: str, every_s: float = SHIP_EVERY_S
) -> None:
    """Ship the stored spans to ``SPANS`` every ``every_s`` over a connection of their
    own, until ``stack`` unwinds (then once more); nothing when spans are not stored."""
    if _store is None:
        return
    from tangram.bus import open_bus

    bus = await open_bus(stack, nats_url, f"{name}-spans")
    task = asyncio.get_running_loop().create_task(_ship_loop(bus, _store, every_s))
    stack.push_async_callback(_stop_shipping, task, bus, _store)


async def _ship_loop(bus: Bus, store: SpanStore, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        await ship(bus, store)


async def _stop_shipping(task: asyncio.Task[None], bus: Bus, store: SpanStore) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await ship(bus, store)


async def ship(bus: Bus, store: SpanStore) -> int:
    """Publish what the store holds, in batches; a batch the broker refuses is dropped (trace
    detail only: the actions keep their timings). Returns the spans published."""
    from tangram.errors import TangramError

    spans, sent = store.take(), 0
    for i in range(0, len(spans), MAX_SPANS):
        try:
            await bus.publish(SPANS, SpanBatch(spans=tuple(spans[i : i + MAX_SPANS])))
            sent += len(spans[i : i + MAX_SPANS])
        except TangramError as exc:
            log.info("dropped %d spans: %s", len(spans) - i, exc)
            break
    return sent


def labels(msg: object) -> dict[str, str] | None:
    """The attributes of a consumer span for ``msg``: the action it serves, when it is one."""
    match msg:
        case Submit(spec=spec) | SubmitMany(items=[Submit(spec=spec)]):
            return {ACTION_ID: spec.action_id}
        case Enqueue(action=action) | Dispatch(action=action):
            return {ACTION_ID: action.spec.action_id}
        case ActionResult(action_id=aid) | Completion(action_id=aid):
            return {ACTION_ID: aid}
    return None


def consumer_span(
    subject: str, msg: object, ctx: Context
) -> contextlib.AbstractContextManager[trace.Span]:
    """The span of one handled message (a context manager; current while the handler runs)."""
    return tracer().start_as_current_span(
        f"{subject} {type(msg).__name__}",
        context=ctx,
        kind=trace.SpanKind.CONSUMER,
        attributes=labels(msg),
    )


def shutdown() -> None:
    """Flush and stop the tracer provider, if one was installed."""
    provider = trace.get_tracer_provider()
    stop = getattr(provider, "shutdown", None)
    if stop is not None:
        stop()


def _traces_url(endpoint: str) -> str:
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else f"{endpoint}/v1/traces"


def tracer() -> trace.Tracer:
    """The tracer of this process's provider: got once at setup, since asking the SDK for it
    costs ~8 us a span (a fifth of a traced hop's CPU, measured with cProfile)."""
    return _tracer if _tracer is not None else trace.get_tracer(TRACER_NAME)


def recording() -> bool:
    """Whether this process exports spans (else a message without trace context needs no span:
    there is nothing to record and no context to pass on)."""
    return _configured


def inject(ctx: Context | None = None) -> dict[str, str]:
    """Headers carrying the trace context of ``ctx`` (or the current one)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context found in message headers (an empty context when there is none)."""
    return propagate.extract(dict(headers) if headers else {})


def from_traceparent(traceparent: str) -> Context:
    """A context whose parent is the span named by a stored ``traceparent`` value."""
    return extract({"traceparent": traceparent} if traceparent else None)


def current_traceparent() -> str:
    """The ``traceparent`` of the current span, or '' when there is none."""
    return inject().get("traceparent", "")


def attach(ctx: Context) -> object:
    return otel_context.attach(ctx)


def detach(token: object) -> None:
    otel_context.detach(token)  # type: ignore[arg-type]
