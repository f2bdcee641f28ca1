"""A copy meant for one endpoint: what it carries, and what a dispatcher keeps of the message it came from."""

from __future__ import annotations

from typing import Any

import pytest

from hookline.dispatcher.settling import carried_headers
from hookline.shared.broker import topology
from hookline.shared.contracts import addressing
from hookline.shared.contracts.headers import Header


class _Message:
    def __init__(self, exchange: str, headers: dict[str, Any]) -> None:
        self.exchange = exchange
        self.headers = headers


def test_a_copy_names_its_endpoint_and_keeps_the_event_id() -> None:
    copy = addressing.message(b"{}", event_id="evt_1", endpoint_id="ep_1", headers={Header.ATTEMPT: 3})
    assert copy.message_id == "evt_1"
    assert (copy.headers or {})[Header.ENDPOINT_ID] == "ep_1"
    assert addressing.endpoint_named(copy.headers) == "ep_1"
    assert (copy.headers or {})[Header.ATTEMPT] == 3


@pytest.mark.parametrize(
    ("headers", "named"),
    [({Header.ENDPOINT_ID: "ep_1"}, "ep_1"), ({}, None), (None, None), ({Header.ENDPOINT_ID: ""}, None),
     ({Header.ENDPOINT_ID: 7}, None)],
)  # fmt: skip
def test_the_endpoint_a_message_names(headers: dict[str, Any] | None, named: str | None) -> None:
    assert addressing.endpoint_named(headers) == named


def test_an_upstreams_message_gives_a_copy_its_trace_context_and_nothing_of_hooklines() -> None:
    """Published to ``events``, a message's x-hookline-* headers are an upstream's claims (attempt 999, an
    old first attempt): never carried into a copy that the dispatchers trust."""
    upstream = _Message(
        topology.EVENTS_EXCHANGE,
        {"traceparent": "00-abc-def-01", Header.ATTEMPT: 999, Header.FIRST_ATTEMPT_AT: 1, "x-death": []},
    )
    assert carried_headers(upstream) == {"traceparent": "00-abc-def-01"}  # type: ignore[arg-type]


def test_a_copy_of_hooklines_own_message_keeps_its_headers_but_the_brokers() -> None:
    own = _Message(
        topology.DELAY_DELIVERY,
        {Header.ATTEMPT: 3, Header.ORIGIN: "replay", "x-death": [{}], "x-delivery-count": 2,
         "x-first-death-queue": "q", "traceparent": "00-abc-def-01"},
    )  # fmt: skip
    assert carried_headers(own) == {  # type: ignore[arg-type]
        Header.ATTEMPT: 3,
        Header.ORIGIN: "replay",
        "traceparent": "00-abc-def-01",
    }
