"""OpenTelemetry setup and W3C trace-context helpers used by the bus middleware.

Exporting is on only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (OTLP over HTTP); otherwise
spans are not recorded, but incoming trace context still flows through every hop so that one
action stays one trace wherever a recording process sits on the path.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

log = logging.getLogger(__name__)

TRACER_NAME = "tangram"
_configured = False


def setup(service_name: str, endpoint: str | None, exporter: SpanExporter | None = None) -> bool:
    """Install an SDK tracer provider when an endpoint (or an explicit exporter) is given."""
    global _configured
    if _configured or (endpoint is None and exporter is None):
        return _configured
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=_traces_url(endpoint or ""))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _configured = True
    log.info("tracing to %s", endpoint or type(exporter).__name__)
    return True


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
    return trace.get_tracer(TRACER_NAME)


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
