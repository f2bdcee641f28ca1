"""Traces, as an SRE following one event in their tracing backend: the publisher's ``traceparent`` (over
HTTP or as an AMQP header) reaches every attempt at the receiver, and with HOOKLINE_OTLP_ENDPOINT set
hookline's spans (``hookline.publish`` at the ingest, one ``hookline.deliver`` per attempt) are
exported over OTLP/HTTP to a real collector endpoint, linked parent to child."""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from support import services
from support.amqp import publish_event
from support.receiver import Received, Receiver, Reply
from support.system import System, tenant
from support.waiting import eventually

pytestmark = pytest.mark.e2e

COLLECTOR_PORT = services.free_port()
# Spans are exported in batches: every half second here (5 s by default).
SYSTEM_ENV = {
    "HOOKLINE_OTLP_ENDPOINT": f"http://127.0.0.1:{COLLECTOR_PORT}",
    "OTEL_BSP_SCHEDULE_DELAY": "500",
}


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]


class Collector:
    """An OTLP/HTTP receiver of traces (protobuf), as a collector exposes on :4318/v1/traces."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for resource in request.resource_spans:
                    for scope in resource.scope_spans:
                        for span in scope.spans:
                            collector.spans.append(
                                Span(
                                    name=span.name, trace_id=span.trace_id.hex(), span_id=span.span_id.hex(),
                                    parent_id=span.parent_span_id.hex(),
                                    attributes={a.key: _value(a.value) for a in span.attributes},
                                )
                            )  # fmt: skip
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *_: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", COLLECTOR_PORT), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    with Collector() as running:
        yield running


def traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent_id}-01", trace_id, parent_id


def deliveries(receiver: Receiver, path: str, event_id: str) -> list[Received]:
    return [r for r in receiver.requests if r.path == path and json.loads(r.body)["id"] == event_id]


async def test_a_posted_events_trace_reaches_the_receiver_through_hooklines_spans(
    collector: Collector, system: System, receiver: Receiver
) -> None:
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/traced"), ["order.*"])
    sent, trace_id, caller_span = traceparent()
    event_id = f"evt_traced_{acme}"
    async with httpx.AsyncClient(
        base_url=system.ingest.base_url, headers={"authorization": f"Bearer {services.TOKEN}"}
    ) as api:
        answer = await api.post(
            "/v1/events", json={"id": event_id, "tenant": acme, "type": "order.created", "data": {}},
            headers={"traceparent": sent, "tracestate": "vendor=abc"},
        )  # fmt: skip
    assert answer.status_code == 202, answer.text
    await eventually(lambda: asyncio.sleep(0, bool(deliveries(receiver, "/traced", event_id))))
    [delivery] = deliveries(receiver, "/traced", event_id)
    version, got_trace, got_parent, flags = delivery.headers["traceparent"].split("-")
    assert (version, got_trace, flags) == ("00", trace_id, "01")
    assert delivery.headers["tracestate"] == "vendor=abc"

    def spans() -> dict[str, Span] | None:
        mine = {s.name: s for s in collector.spans if s.trace_id == trace_id}
        return mine if {"hookline.publish", "hookline.deliver"} <= set(mine) else None

    found = await eventually(lambda: asyncio.sleep(0, spans()))
    publish, deliver = found["hookline.publish"], found["hookline.deliver"]
    assert publish.parent_id == caller_span  # under the caller's span
    assert deliver.parent_id == publish.span_id
    assert got_parent == deliver.span_id  # the receiver's span will be a child of the attempt
    assert deliver.attributes["hookline.event_id"] == event_id
    assert deliver.attributes["hookline.attempt"] == 1
    assert deliver.attributes["http.response.status_code"] == 204


async def test_an_amqp_publishers_trace_follows_every_attempt(
    collector: Collector, system: System, receiver: Receiver
) -> None:
    failures = {"left": 1}

    def respond(request: Received) -> Reply:
        if request.path == "/retried" and failures["left"]:
            failures["left"] -= 1
            return Reply(status=500)
        return Reply()

    receiver.responder = respond
    acme = tenant()
    system.add_endpoint(acme, receiver.url("/retried"), ["order.*"])
    sent, trace_id, publisher_span = traceparent()
    event_id = f"evt_amqp_traced_{acme}"
    event = {
        "id": event_id,
        "tenant": acme,
        "type": "order.created",
        "occurred_at": "2026-12-01T00:00:00Z",
        "data": {},
    }
    await publish_event(system.amqp_url, event, f"{acme}.order.created", headers={"traceparent": sent})
    await eventually(lambda: asyncio.sleep(0, len(deliveries(receiver, "/retried", event_id)) == 2))
    first, second = deliveries(receiver, "/retried", event_id)
    assert first.headers["traceparent"].split("-")[1] == trace_id
    assert second.headers["traceparent"].split("-")[1] == trace_id  # the retry kept the trace

    def attempts() -> list[Span] | None:
        mine = sorted(
            (s for s in collector.spans if s.trace_id == trace_id and s.name == "hookline.deliver"),
            key=lambda s: s.attributes["hookline.attempt"],
        )
        return mine if len(mine) == 2 else None

    one, two = await eventually(lambda: asyncio.sleep(0, attempts()))
    assert [one.attributes["http.response.status_code"], two.attributes["http.response.status_code"]] == [
        500,
        204,
    ]
    assert one.parent_id == two.parent_id == publisher_span
    assert first.headers["traceparent"].split("-")[2] == one.span_id
    assert second.headers["traceparent"].split("-")[2] == two.span_id
