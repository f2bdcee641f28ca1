"""What endpoint filters cost where events are fanned out: the CPU a dispatcher spends per event to
screen it for 1, 10 and 100 filtered endpoints of its tenant (``screening.admitted``, the code the fan-out runs),
against the parse every event already costs (``decoding.parse``), measured in the same run.

    python -m bench.filters [--events 2000]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from typing import Any

import orjson

from hookline.dispatcher import decoding, screening
from hookline.shared.contracts.models import SigningSecret, StoredEndpoint

COUNTS = (1, 10, 100)
NOW = datetime.now(UTC)


def _events(count: int) -> list[bytes]:
    return [
        orjson.dumps(
            {
                "id": f"evt_{n:026d}",
                "type": "order.created",
                "tenant": "acme",
                "subject": f"o_{n}",
                "occurred_at": NOW.isoformat(),
                "schema_version": 1,
                "data": {
                    "amount": (n * 7) % 2000,
                    "currency": ("EUR", "USD")[n % 2],
                    "customer": {"id": f"c_{n % 50}", "country": "DE"},
                    "items": [{"sku": f"s_{i}", "qty": 1 + i % 3, "price": 9.5 * i} for i in range(5)],
                },
            }
        )
        for n in range(count)
    ]


def _endpoints(count: int, *, filtered: bool) -> list[StoredEndpoint]:
    secret = SigningSecret(value="whsec_" + "A" * 44, created_at=NOW)
    return [
        StoredEndpoint(
            id=f"ep_{n:026d}",
            tenant="acme",
            url="https://example.com/",
            event_types=["order.*"],
            created_at=NOW,
            updated_at=NOW,
            secrets=[secret],
            filter=f'data.amount >= {n * 19 % 2000} && data.currency == "EUR"' if filtered else None,
        )
        for n in range(count)
    ]


def _parse(body: bytes) -> decoding.Inbound:
    parsed = decoding.parse(
        body, message_id=orjson.loads(body)["id"], content_type="application/json", exchange="events",
        routing_key="acme.order.created", headers=None, endpoint_tenant="acme", max_bytes=262_144,
    )  # fmt: skip
    assert isinstance(parsed, decoding.Inbound)
    return parsed


def _us_per_event(parsed: list[decoding.Inbound], endpoints: list[StoredEndpoint]) -> float:
    started = time.process_time()
    for item in parsed:
        screening.admitted(item.event, endpoints)
    return (time.process_time() - started) / len(parsed) * 1e6


def run(*, events: int) -> dict[str, Any]:
    bodies = _events(events)
    started = time.process_time()
    parsed = [_parse(body) for body in bodies]
    parse_us = (time.process_time() - started) / events * 1e6
    result: dict[str, Any] = {"events": events, "parse_us": round(parse_us, 1), "screen_us": {}}
    for count in COUNTS:
        _us_per_event(parsed[:50], _endpoints(count, filtered=True))  # compiled once, as a dispatcher does
        unfiltered = _us_per_event(parsed, _endpoints(count, filtered=False))
        filtered = _us_per_event(parsed, _endpoints(count, filtered=True))
        result["screen_us"][count] = {"filtered": round(filtered, 1), "unfiltered": round(unfiltered, 1)}
    return result


def markdown(result: dict[str, Any]) -> list[str]:
    """make bench's row for a result of :func:`run`."""
    costs = ", ".join(
        f"{count} filtered: {costs['filtered']:.0f} µs ({costs['filtered'] / result['parse_us']:.1f}× the parse)"
        for count, costs in result["screen_us"].items()
    )
    return [
        f"| endpoint filters (CEL) where {result['events']:,} events are fanned out, per event | {costs}; "
        f"the event's parse {result['parse_us']:.0f} µs; unfiltered endpoints "
        f"{result['screen_us'][100]['unfiltered']:.0f} µs for 100 | |"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=2000)
    result = run(events=parser.parse_args().events)
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
