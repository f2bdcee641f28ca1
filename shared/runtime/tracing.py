"""Traces: a W3C ``traceparent`` follows an event from its publisher to every attempt at every endpoint.

The ingest takes it from ``POST /v1/events`` (an upstream publishing to AMQP sets the ``traceparent``
header itself); it travels in the event's AMQP headers, through the retries, and each attempt sends it
to the receiver. With ``HOOKLINE_OTLP_ENDPOINT`` set, hookline's own spans join the trace and are
exported over OTLP/HTTP: ``hookline.publish`` at the ingest and one ``hookline.deliver`` per attempt,
whose context is what the receiver gets (its span is then a child of the attempt). Without it (the
default) nothing is recorded or exported, and the receiver gets the publisher's context unchanged.
Spans carry ids, types, statuses and timings; never payloads, URLs' queries or secrets.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
# version 00: trace id and parent id not all zeros (checked below), lowercase hex.
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
_PROPAGATOR = TraceContextTextMapPropagator()


@dataclass(frozen=True, slots=True)
class TraceContext:
    traceparent: str
    tracestate: str | None = None

    @property
    def trace_id(self) -> str:
        return self.traceparent.split("-")[1]

    def headers(self) -> dict[str, str]:
        found = {TRACEPARENT: self.traceparent}
        if self.tracestate:
            found[TRACESTATE] = self.tracestate
        return found


def from_headers(headers: Mapping[str, Any] | None) -> TraceContext | None:
    """The trace context in HTTP or AMQP headers, if well formed (a malformed one is dropped, as W3C says)."""
    if not headers:
        return None
    parent = headers.get(TRACEPARENT)
    if isinstance(parent, bytes):
        parent = parent.decode("ascii", "replace")
    if not isinstance(parent, str):
        return None
    parent = parent.strip()
    match = _TRACEPARENT.match(parent)
    if match is None or set(match.group(1)) == {"0"} or set(match.group(2)) == {"0"}:
        return None
    state = headers.get(TRACESTATE)
    if isinstance(state, bytes):
        state = state.decode("ascii", "replace")
    return TraceContext(parent, state[:512] if isinstance(state, str) and state else None)


class Tracing:
    """Owns the span exporter when traces are exported; ``span()`` is a no-op otherwise."""

    def __init__(self, service: str, otlp_endpoint: str | None) -> None:
        self._provider: TracerProvider | None = None
        self._tracer: trace.Tracer | None = None
        if otlp_endpoint:
            self._provider = TracerProvider(resource=Resource.create({"service.name": f"hookline-{service}"}))
            endpoint = otlp_endpoint.rstrip("/")
            if not endpoint.endswith("/v1/traces"):
                endpoint += "/v1/traces"
            # Batched and exported from a thread of its own: a slow collector never holds a delivery.
            self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
            self._tracer = self._provider.get_tracer("hookline")

    @property
    def exporting(self) -> bool:
        return self._tracer is not None

    @contextlib.contextmanager
    def span(
        self,
        name: str,
        parent: TraceContext | None,
        attributes: Mapping[str, str | int | float],
        *,
        kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    ) -> Iterator[tuple[TraceContext | None, trace.Span | None]]:
        """A span under ``parent``: yields the context to send on (the span's own when exporting, else
        ``parent`` unchanged) and the span, to add what happened to it."""
        if self._tracer is None:
            yield parent, None
            return
        context = _PROPAGATOR.extract(parent.headers()) if parent is not None else None
        with self._tracer.start_as_current_span(
            name, context=context, kind=kind, attributes=dict(attributes)
        ) as span:
            carrier: dict[str, str] = {}
            _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
            yield from_headers(carrier), span

    def shutdown(self) -> None:
        """Export what is left (bounded by the exporter's own timeout)."""
        if self._provider is not None:
            self._provider.shutdown()
